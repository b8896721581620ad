"""Peak bytes of the tensors an operation creates, on the CPU: a dispatch mode that counts each new storage from its
creation until it is freed (views and pre-existing tensors not counted). For checking the planner's transient terms on
this machine; the GPU's kernels can hold other workspaces (bench/probes/mem_peak.py reads the GPU's own history).

    python3 bench/probes/live_bytes.py [tokens] [vocab]

measures the head's loss as the Llama models of transformers compute it (transformers' ForCausalLMLoss: the logits
upcast to fp32, cross entropy) with its backward, in bytes per token and vocabulary entry (planner.activation_bytes'
"logits" term)."""

import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """``peak``: the most bytes of storages created inside the mode alive at once; ``at_peak``: (bytes, op) of
    those alive then. ``ignore``: storages (data pointers) that existed before, whose views are not new."""

    def __init__(self, ignore=()):
        super().__init__()
        self.ignore = {t.untyped_storage().data_ptr() for t in ignore}
        self.live = self.peak = 0
        self.alive: dict[int, tuple[int, str]] = {}
        self.at_peak: list[tuple[int, str]] = []

    def _free(self, key: int, n: int) -> None:
        self.live -= n
        self.alive.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key, n = st.data_ptr(), st.nbytes()
            if n == 0 or key in self.alive or key in self.ignore:
                continue
            self.live += n
            self.alive[key] = (n, str(func))
            weakref.finalize(st, self._free, key, n)
            if self.live > self.peak:
                self.peak, self.at_peak = self.live, sorted(self.alive.values(), reverse=True)
        return out


def loss_bytes(tokens: int, vocab: int, hidden: int = 64, dtype=torch.bfloat16, loss=None) -> tuple[float, list]:
    """Peak bytes per token and vocabulary entry of a ``dtype`` head's loss (``loss(logits, labels, vocab_size=)``,
    transformers' ForCausalLMLoss if None) and its backward (the logits dropped before the backward, as the engine
    does)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(0)
    h = torch.randn(1, tokens, hidden, dtype=dtype, requires_grad=True)
    w = torch.randn(vocab, hidden, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    with LiveBytes(ignore=(h, w, labels)) as m:
        logits = h @ w.t()
        value = (loss or ForCausalLMLoss)(logits, labels, vocab_size=vocab)
        del logits
        value.backward()
    return m.peak / (tokens * vocab), m.at_peak


if __name__ == "__main__":
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    vocab = int(sys.argv[2]) if len(sys.argv) > 2 else 32000
    per, at = loss_bytes(tokens, vocab)
    print(f"{tokens} tokens x {vocab} vocabulary: peak {per:.3f} B per token and entry")
    for n, op in at[:6]:
        print(f"  {n / (tokens * vocab):.3f} B  {op}")
