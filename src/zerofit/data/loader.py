"""Optimizer steps of packed windows, endless over epochs, resumable at any step.

    loader = StepLoader(data.train, micro_batch_size=8, gradient_accumulation_steps=4, seed=0)
    for step in range(steps):
        loss = engine.train_batch(next(loader))   # a list of 4 dicts {"input_ids", "labels"}, each (8, T) int64
        ...
        client_state = {"data": loader.state_dict()}   # plain JSON-able; saved with the checkpoint

    loader = StepLoader(data.train, 8, 4, seed=0)
    loader.load_state_dict(client_state["data"])      # yields exactly what the saved one would have yielded next

[Note: window order] The windows are visited as one endless sequence: epoch 0's order, then epoch 1's, ...;
epoch ``e``'s order is a seeded permutation of all windows (``permutation(W, seed, EPOCH, e)``, identity without
shuffling). A step takes the next ``micro_batch_size * gradient_accumulation_steps`` windows of that sequence,
crossing an epoch boundary if it must, so no window is dropped and every micro-batch is full. The position in
the sequence, ``(epoch, position)``, is the whole state: a restored loader recomputes the permutations from the
seed and continues there.
"""

from __future__ import annotations

from typing import Any

import torch

from zerofit.data.packing import PackedDataset
from zerofit.data.pairs import PairDataset
from zerofit.data.shuffle import EPOCH, permutation

STATE_VERSION = 1


class StepLoader:
    """Yields one optimizer step at a time: ``gradient_accumulation_steps`` micro-batch dicts of
    ``micro_batch_size`` windows (see [Note: window order]); the input of ``engine.train_batch``."""

    def __init__(
        self,
        data: PackedDataset | PairDataset,
        micro_batch_size: int,
        gradient_accumulation_steps: int = 1,
        seed: int = 0,
        *,
        shuffle: bool = True,
    ):
        if micro_batch_size < 1 or gradient_accumulation_steps < 1:
            raise ValueError(
                f"micro_batch_size ({micro_batch_size}) and gradient_accumulation_steps"
                f" ({gradient_accumulation_steps}) must be at least 1"
            )
        if len(data) == 0:
            raise ValueError("the training set has no window: it needs at least 2 tokens")
        if seed < 0:
            raise ValueError(f"seed must be non-negative, found {seed}")
        self.data = data
        self.micro_batch_size = micro_batch_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0  # epochs completed
        self.position = 0  # windows of epoch ``epoch`` already yielded
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, its order of windows): a cache

    @property
    def windows_per_step(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps

    @property
    def steps_per_epoch(self) -> float:
        return len(self.data) / self.windows_per_step

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            n = len(self.data)
            order = (
                torch.from_numpy(permutation(n, self.seed, EPOCH, epoch)) if self.shuffle else torch.arange(n)
            )  # (W,) int64
            self._order = (epoch, order)
        return self._order[1]

    def _take(self, k: int) -> torch.Tensor:
        """The next ``k`` window indices, ``(k,)`` int64, advancing ``(epoch, position)``."""
        parts = []
        while k:
            order = self._epoch_order(self.epoch)
            n = min(k, len(order) - self.position)
            parts.append(order[self.position : self.position + n])
            self.position += n
            k -= n
            if self.position == len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return torch.cat(parts)

    def __iter__(self) -> StepLoader:
        return self

    def __next__(self) -> list[dict[str, torch.Tensor]]:
        return [self.data.batch(self._take(self.micro_batch_size)) for _ in range(self.gradient_accumulation_steps)]

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is, as a plain JSON-able dict (ints, strings, a bool)."""
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "position": self.position,
            "num_windows": len(self.data),
            "seq_len": self.data.seq_len,
            "fingerprint": self.data.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any], *, check_data: bool = True) -> None:
        """Continue from ``state`` (its seed and shuffling included). The batch shape may differ from the saved
        loader's: the sequence of windows continues where it stopped. ``check_data`` refuses data whose windows
        differ from those the state was saved with (other files, tokenizer, ``seq_len`` or split seed)."""
        missing = {"version", "seed", "shuffle", "epoch", "position", "num_windows", "seq_len"} - set(state)
        if missing:
            raise ValueError(f"loader state lacks {sorted(missing)}: not a StepLoader.state_dict()")
        if state["version"] != STATE_VERSION:
            raise ValueError(f"loader state version {state['version']}, this zerofit reads {STATE_VERSION}")
        found = (state["num_windows"], state["seq_len"], state.get("fingerprint"))
        here = (len(self.data), self.data.seq_len, self.data.fingerprint)
        if check_data and found != here:
            raise ValueError(
                f"the loader state was saved on other data: {found[0]} windows of {found[1]} tokens (content"
                f" {found[2]}), this loader has {here[0]} windows of {here[1]} (content {here[2]}); resume with the"
                " same files, tokenizer, seq_len and seed, or pass check_data=False to continue on new data"
            )
        if not 0 <= int(state["position"]) < len(self.data) or int(state["epoch"]) < 0:
            raise ValueError(
                f"loader state epoch {state['epoch']}, position {state['position']}: expected an epoch"
                f" >= 0 and a position in 0..{len(self.data) - 1}"
            )
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = None
