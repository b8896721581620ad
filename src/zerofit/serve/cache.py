"""The server's KV cache: one row per batch slot, each row its own sequence at its own length.

    cache = SlotCache(layers=L, slots=S, context=C, kv_heads=H, head_dim=D, dtype=..., device=...)
    cache.begin(rows=[3, 0], starts=[17, 0], new=[1, 9])        # this forward: rows, their lengths, new tokens
    out = model(input_ids, position_ids=cache.position_ids(), attention_mask=cache.mask(impl), past_key_values=cache)
    cache.commit()                                               # the rows' lengths advance by their new tokens

[Note: a row per sequence]
transformers' caches keep one length for the whole batch, so sequences of
different lengths share it only through left padding, which shifts every
position of a joining request and cannot take a request in half-way through
another's decoding. Here every slot is its own row of ``(slots, kv_heads,
context, head_dim)`` tensors allocated once (the bytes ``InferShape.kv_bytes``
counts for ``slots x context``): a sequence's keys sit at columns
``0..length-1`` of its row, its positions are ``0..length-1`` as if it were
alone, and a forward over several rows writes each row's new keys at that
row's own columns. The attention mask lets query ``i`` of a row whose length
was ``start`` see columns ``j <= start + i``: the sequence's own past and
itself, never padding (a row with fewer new tokens than the forward's width
is padded on the right; its padded queries see garbage and their outputs are
dropped). Each row then computes what it would alone, to the rounding of the
batched kernels: the tokens are those of ``generate`` (the tests check it).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _SlotLayer(CacheLayerMixin):
    """One decoder layer's keys and values for every slot; its ``update`` writes the forward's rows."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: SlotCache, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.owner = owner
        self.keys = keys  # (slots, kv_heads, context, head_dim), the weights' dtype, on the device
        self.values = values
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # allocated once, in SlotCache
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        o = self.owner
        # (B, kv_heads, T, head_dim) -> row r's columns starts[r] .. starts[r] + T - 1
        self.keys[o._rows_col, :, o._cols] = key_states.transpose(1, 2)
        self.values[o._rows_col, :, o._cols] = value_states.transpose(1, 2)
        if o._contiguous:  # rows 0..B-1: a view, no copy
            return self.keys[: o.batch, :, : o.width], self.values[: o.batch, :, : o.width]
        return (
            self.keys.index_select(0, o._rows)[:, :, : o.width],
            self.values.index_select(0, o._rows)[:, :, : o.width],
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.width, 0

    def get_seq_length(self) -> int:
        return self.owner.width

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class SlotCache(Cache):
    """Keys and values of ``slots`` independent sequences of up to ``context`` tokens ([Note: a row per
    sequence]). ``lengths[s]``: the tokens slot ``s`` holds."""

    def __init__(
        self,
        *,
        layers: int,
        slots: int,
        context: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (slots, kv_heads, context, head_dim)
        super().__init__(
            layers=[
                _SlotLayer(
                    self,
                    torch.zeros(shape, dtype=dtype, device=device),
                    torch.zeros(shape, dtype=dtype, device=device),
                )
                for _ in range(layers)
            ]
        )
        self.slots, self.context, self.device = slots, context, torch.device(device)
        self.lengths = [0] * slots
        self.batch = 0
        self.width = 0  # the columns this forward attends over: the longest row after it

    def begin(self, rows: list[int], starts: list[int], new: list[int]) -> int:
        """Set up one forward over ``rows`` (slot numbers), row ``r`` holding ``starts[r]`` tokens and getting
        ``new[r]`` (the forward's width is the largest). Returns the width."""
        T = max(new)
        if any(s + T > self.context for s in starts):
            raise ValueError(f"a row would pass the cache's context of {self.context} tokens")
        self.batch, self._new = len(rows), list(new)
        self._slots_of, self._starts = list(rows), list(starts)
        dev = self.device
        self._rows = torch.tensor(rows, dtype=torch.long, device=dev)
        self._rows_col = self._rows[:, None]  # (B, 1)
        self._start_t = torch.tensor(starts, dtype=torch.long, device=dev)[:, None]  # (B, 1)
        self._cols = self._start_t + torch.arange(T, device=dev)[None, :]  # (B, T)
        self._contiguous = rows == list(range(len(rows)))
        self.width = max(s + T for s in starts)
        return T

    def position_ids(self) -> torch.Tensor:
        """(B, T): each row's positions, as if it were alone."""
        return self._cols

    def mask(self, impl: str, dtype: torch.dtype) -> torch.Tensor:
        """(B, 1, T, width): query ``i`` of a row that held ``start`` tokens sees columns ``<= start + i``; a
        boolean mask for SDPA, an additive one for eager attention."""
        cols = torch.arange(self.width, device=self.device)[None, None, :]  # (1, 1, W)
        allowed = (cols <= self._cols[:, :, None])[:, None]  # (B, 1, T, W)
        if impl == "sdpa":
            return allowed
        if impl == "eager":
            out = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
            return out.masked_fill_(~allowed, torch.finfo(dtype).min)
        raise ValueError(f"attention implementation {impl!r}: the server batches with sdpa or eager attention")

    def commit(self) -> None:
        """The forward ran: each row now holds its new tokens too."""
        for s, start, n in zip(self._slots_of, self._starts, self._new):
            self.lengths[s] = start + n

    def free(self, slot: int) -> None:
        if slot < self.slots:  # (a slot beyond the rows: a request that left before its first step)
            self.lengths[slot] = 0

    def release(self) -> None:
        """Its device memory given back now (its layers refer to it: a cycle the collector would free later)."""
        for la in self.layers:
            la.keys = la.values = torch.empty(0)

    def rows_to_host(self, n: int) -> tuple:
        """Rows ``0..n-1`` (their keys and values up to the longest of them, and their lengths) in host memory, for
        a cache of other rows to take (:meth:`rows_from_host`)."""
        w = max(self.lengths[:n], default=0)
        return [(la.keys[:n, :, :w].cpu(), la.values[:n, :, :w].cpu()) for la in self.layers], self.lengths[:n]

    def rows_from_host(self, kept: tuple) -> None:
        layers, lengths = kept
        for la, (k, v) in zip(self.layers, layers):
            la.keys[: k.shape[0], :, : k.shape[2]].copy_(k)
            la.values[: v.shape[0], :, : v.shape[2]].copy_(v)
        self.lengths[: len(lengths)] = lengths

    @property
    def bytes(self) -> int:
        return sum(la.keys.numel() * la.keys.element_size() * 2 for la in self.layers)
