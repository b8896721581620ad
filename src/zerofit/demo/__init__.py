"""The embedded default that ``zerofit train`` and ``make demo`` run: no download of any kind.

- :mod:`~zerofit.demo.tokenizer`: bytes are tokens (256 + BOS/EOS);
- :mod:`~zerofit.demo.corpus`: Python's own standard-library source as text, random windows;
- :mod:`~zerofit.demo.model`: a ~3 M-parameter Hugging Face Llama, sampling, held-out loss;
- :mod:`~zerofit.demo.options`: what ``zerofit train`` can set;
- :mod:`~zerofit.demo.run`: the training run through ``zerofit.initialize``;
- :mod:`~zerofit.demo.report`: how the run reads on the terminal.

Names are imported on first use, so that ``zerofit --help`` does not pay for torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ByteTokenizer": "tokenizer",
    "Corpus": "corpus",
    "load_corpus": "corpus",
    "micro_batches": "corpus",
    "build_model": "model",
    "sample": "model",
    "DemoOptions": "options",
    "DemoResult": "run",
    "run_demo": "run",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'zerofit.demo' has no attribute {name!r}")
    return getattr(importlib.import_module(f"zerofit.demo.{_EXPORTS[name]}"), name)
