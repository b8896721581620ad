"""Generation from an encoder-decoder's folder (T5, BART...: its config's ``is_encoder_decoder``): transformers' own
``generate``, each of the model's layers streamed by the training engine's hooked mode.

    gen = open_engine("runs/t5/model", max_gpu_memory="8GiB")     # a Seq2SeqEngine here, an InferenceEngine else
    out = gen.generate(input_ids, attention_mask, max_new_tokens=64)  # (B, 1 + new): the decoder's tokens

:func:`open_engine` is where ``zerofit generate``, ``zerofit chat``, ``zerofit serve`` and ``zerofit.generate(path)``
choose between the two, by the folder's config alone.

[Note: an encoder-decoder generates through the hooked mode]
The inference engine (engine.py) streams one chain of blocks in a fixed cyclic order, with a key/value cache of one
stack. An encoder-decoder is two stacks, the decoder's blocks reading the encoder's output (cross-attention): not
such a chain. The training engine's hooked mode streams any model by its modules' calls ([Note: the hooked mode],
engine/model/hooked.py) and runs the model's own ``generate`` with each unit uploaded per call ([Note: generation in
the hooked mode], engine/step/hooked.py): that is the path here, the folder read tensor by tensor into the engine's
host buffers (never loaded whole, on the host or the device), the planner choosing which units stay resident within
``max_gpu_memory`` and which stream. Every parameter is frozen (``untrained``: an engine for forwards and generate
alone): no optimizer state, no gradient buffer ([Note: frozen parameters], engine/memory/store.py), and every weight
is the folder's. The weights are held in the compute dtype
(``precision``): the folder's own unless ``dtype`` says otherwise, as [Note: the model's own dtype] (engine.py) has
it for decoder-only models, so an fp32 folder generates transformers' tokens on the same weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from zerofit.infer.engine import as_dtype

__all__ = ["Seq2SeqEngine", "encoder_decoder_config", "open_engine"]

PRECISION = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _config_folder(path: str | os.PathLike) -> tuple[Path, bool]:
    """The folder whose config.json describes the model at ``path``, and whether ``path`` is a zerofit checkpoint
    (a tag folder, or a save folder whose ``latest`` names one)."""
    from zerofit.checkpoint.commit import RECORD

    p = Path(path).expanduser()
    if p.is_dir() and ((p / RECORD).is_file() or (p / "latest").is_file()):
        from zerofit.checkpoint.load import open_checkpoint

        found = open_checkpoint(p, None)
        return (p if found is None else found[0]), True
    return p, False


def encoder_decoder_config(path: str | os.PathLike):
    """The config of the model at ``path`` (a model directory or a checkpoint) when it is an encoder-decoder
    (``is_encoder_decoder``, as transformers reads config.json), else None. A folder that cannot be read is None
    too: the decoder-only path reports what is wrong with it, as before."""
    from zerofit.models.directory import read_config

    try:
        folder, _ = _config_folder(path)
        if not (folder / "config.json").is_file():
            return None
        config = read_config(folder)
    except Exception:  # noqa: BLE001 - not readable here: the decoder-only path names the problem
        return None
    return config if getattr(config, "is_encoder_decoder", False) else None


def _architecture(config) -> str:
    return ", ".join(getattr(config, "architectures", None) or [str(getattr(config, "model_type", "?"))])


def open_engine(path: str | os.PathLike, adapter: str | os.PathLike | None = None, **kw):
    """The generation engine for the model at ``path``: a :class:`Seq2SeqEngine` for an encoder-decoder's folder
    ([Note: an encoder-decoder generates through the hooked mode]), else
    :meth:`InferenceEngine.from_pretrained <zerofit.infer.engine.InferenceEngine.from_pretrained>` (``adapter``:
    a PEFT adapter folder over it). ``kw``: ``max_gpu_memory``, ``max_host_memory``, ``dtype``, ``device``,
    ``nvme_path``."""
    config = encoder_decoder_config(path)
    if config is None:
        from zerofit.infer.engine import InferenceEngine

        return InferenceEngine.from_pretrained(path, adapter=adapter, **kw)
    arch = _architecture(config)
    if adapter is not None:
        raise ValueError(
            f"{path} is an encoder-decoder ({arch}): generation with an adapter over a base is for decoder-only "
            "models; merge the adapter into the model (PEFT's merge_and_unload, then save_pretrained) and give "
            "that folder"
        )
    if _config_folder(path)[1]:
        raise ValueError(
            f"{path} is a zerofit checkpoint of an encoder-decoder ({arch}): generation reads its model folder: "
            f"zerofit export {path} FOLDER, then --model FOLDER"
        )
    return Seq2SeqEngine.from_pretrained(path, **kw)


class Seq2SeqEngine:
    """An encoder-decoder ready for generation: an engine (``engine``) in the hooked mode, every weight frozen
    ([Note: an encoder-decoder generates through the hooked mode]). ``model``: the engine's
    model, in evaluation mode; ``tokenizer``: the folder's."""

    is_encoder_decoder = True  # text.complete pads on the right and reads the answer after the decoder's start

    def __init__(self, engine, tokenizer=None, dtype_origin: str = "the model's own"):
        self.engine = engine
        self.tokenizer = tokenizer
        self.dtype_origin = dtype_origin
        self.model.eval()  # dropout off: generate's tokens are the model's in evaluation mode

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        max_gpu_memory: int | str | None = None,
        max_host_memory: int | str | None = None,
        dtype=None,
        device: str | torch.device | None = None,
        nvme_path: str | os.PathLike | None = None,
    ) -> Seq2SeqEngine:
        """The encoder-decoder of the model directory ``path``, built on the meta device and read into the
        engine's buffers tensor by tensor. ``dtype``: the weights' (None: the folder's own, [Note: the model's own
        dtype]); the budgets and the device as the engine's config has them (``nvme_path``: its disk tier)."""
        from zerofit.config import load_config
        from zerofit.engine.engine import Engine
        from zerofit.models import ModelDir

        md = ModelDir.open(path)
        weights = as_dtype(dtype) or md.dtype()
        model = md.build_meta()
        model.requires_grad_(False)  # an engine for generate alone: nothing trains
        config: dict = {
            "adapter": "hooked",
            "precision": PRECISION[weights],
            "device": "auto" if device is None else str(device),
            "steps_per_print": None,
        }
        for key, value in (("max_gpu_memory", max_gpu_memory), ("max_host_memory", max_host_memory)):
            if value is not None:
                config[key] = value
        if nvme_path is not None:
            config["offload"] = {"nvme_path": str(nvme_path)}
        try:
            engine = Engine(model, load_config(config).config, source=md, untrained=True)
        finally:
            md.close()
        return cls(engine, md.tokenizer(), "as asked" if dtype is not None else "the model's own")

    @property
    def model(self):
        return self.engine.adapter.model

    @property
    def device(self) -> torch.device:
        return self.engine.dev.device

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.dtype

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int = 128,
        **kwargs,
    ) -> torch.Tensor:
        """transformers' ``generate`` of the model on the encoder's ``input_ids`` (padded on the right, as an
        encoder reads them), each unit streamed ([Note: generation in the hooked mode]): the decoder's sequences
        (B, 1 + new), its start token first. Every generation option of transformers applies."""
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if self.tokenizer is not None and kwargs.get("stop_strings"):
            kwargs.setdefault("tokenizer", self.tokenizer)
        return self.engine.generate(input_ids=input_ids, max_new_tokens=max_new_tokens, **kwargs)

    def summary(self) -> str:
        """What runs, in one line: the path, the units streamed and resident, the weights' dtype."""
        from zerofit.engine.memory.store import Home

        units = self.engine.blocks
        streamed = sum(u.home is Home.STREAMED for u in units)
        name = str(self.dtype).replace("torch.", "")
        return (
            f"encoder-decoder ({_architecture(self.model.config)}): transformers' generate in zerofit's hooked mode, "
            f"{len(units)} layers as units, {streamed} streamed and {len(units) - streamed} resident; "
            f"{name} weights ({self.dtype_origin})"
        )

    def close(self) -> None:
        """Release the engine's buffers (unusable afterwards)."""
        self.engine.close()
