"""Checkpoints (save, load, exact resume) and Hugging Face export. See docs/checkpoints.md.

| module | concept |
| --- | --- |
| ``format.py`` | safetensors shards with an index, written from the caller's buffers, read into place |
| ``durable.py`` | durable writes with a running CRC32, fsync of files and folders, atomic replace |
| ``commit.py`` | the commit protocol: temp folder, commit record last, rename, ``latest`` |
| ``save.py`` / ``load.py`` | one checkpoint written / found, verified, matched and copied |
| ``state.py`` | the engine's training state as tensors, and the engine made consistent after a load |
| ``rng.py`` | every random generator's state as JSON |
| ``model_files.py`` | config.json, generation_config.json, tokenizer files |
| ``export.py`` | a Hugging Face model directory from an engine or a checkpoint |
| ``lock.py`` | one holder per folder: a run folder's or a save folder's lock |
| ``seams.py`` | test seams: pause at a phase, inject write errors |
| ``errors.py`` | the typed errors |
"""

from zerofit.checkpoint.commit import RECORD as COMMIT_RECORD
from zerofit.checkpoint.commit import list_tags, prune
from zerofit.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointDiskFullError,
    CheckpointError,
    CheckpointIncompleteError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointStateError,
    ChecksumMismatchError,
    EngineStateLostError,
    MissingFileError,
    TruncatedFileError,
)


def __getattr__(name: str):
    # export (and torch) on first use: `zerofit train` takes its run folder's lock (lock.py) before torch loads
    if name == "export_checkpoint":
        from zerofit.checkpoint.export import export_checkpoint

        return export_checkpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "COMMIT_RECORD",
    "export_checkpoint",
    "list_tags",
    "prune",
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointDiskFullError",
    "CheckpointIncompleteError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointStateError",
    "ChecksumMismatchError",
    "EngineStateLostError",
    "MissingFileError",
    "TruncatedFileError",
]
