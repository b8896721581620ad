"""A byte-level tokenizer: token ``i < 256`` is the byte ``i``; two specials follow.

No vocabulary file, no download, and every string round-trips exactly
(``decode(encode(s)) == s`` for any text, since UTF-8 is lossless).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ByteTokenizer:
    """Bytes 0..255 are tokens 0..255; ``bos_id`` and ``eos_id`` follow them."""

    bos_id: int = 256
    eos_id: int = 257

    @property
    def vocab_size(self) -> int:
        return 258

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """Text of ``ids``; special tokens are dropped, broken UTF-8 becomes U+FFFD."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
