"""The user's data for training: local files in, packed windows and resumable optimizer steps out.

    from zerofit.data import build_datasets, load_tokenizer, StepLoader, evaluate

    tokenizer = load_tokenizer("path/to/model_dir")                # the model directory's own, offline
    data = build_datasets(["notes/", "chat.jsonl"], tokenizer, seq_len=2048, eval_size=0.02, seed=0)
    loader = StepLoader(data.train, micro_batch_size=4, gradient_accumulation_steps=8, seed=0)
    loss = engine.train_batch(next(loader))                        # one optimizer step
    state = loader.state_dict()                                    # JSON-able; load_state_dict(state) resumes
    result = evaluate(data.eval, lambda b: engine(**b).loss, micro_batch_size=4)   # .loss, .perplexity

One concept per module:

- :mod:`~zerofit.data.sources`: which files (``.txt``, ``.jsonl``/``.json``, ``.parquet``), read through
  Hugging Face ``datasets`` with local files only;
- :mod:`~zerofit.data.formats`: what a row is (``text``, ``prompt``+``completion``, chat ``messages``);
- :mod:`~zerofit.data.encode`: tokens and loss targets per row (BOS/EOS, prompt and non-assistant masking);
- :mod:`~zerofit.data.packing`: documents back to back in windows of ``seq_len``, every target scored once;
- :mod:`~zerofit.data.shuffle`: seeded permutations stable across machines and versions;
- :mod:`~zerofit.data.build`: files to a training set and a held-out set;
- :mod:`~zerofit.data.loader`: the resumable step loader;
- :mod:`~zerofit.data.evaluation`: token-weighted held-out loss and perplexity.

docs/data.md describes the formats, the masking, the packing and resuming. Names are imported on first use, so
that ``import zerofit.data`` stays light (``datasets`` loads only when files are read).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "DataError": "sources",
    "find_files": "sources",
    "Document": "encode",
    "PackedDataset": "packing",
    "pack": "packing",
    "IGNORE_INDEX": "packing",
    "DataSplit": "build",
    "DataStats": "build",
    "Documents": "build",
    "build_datasets": "build",
    "load_documents": "build",
    "load_tokenizer": "build",
    "load_pairs": "build",
    "PairDataset": "pairs",
    "split_documents": "build",
    "StepLoader": "loader",
    "EvalResult": "evaluation",
    "evaluate": "evaluation",
    "count_targets": "evaluation",
    "model_loss_fn": "evaluation",
    "scored_tokens": "evaluation",
    "small_held_out": "evaluation",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'zerofit.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"zerofit.data.{_EXPORTS[name]}"), name)
