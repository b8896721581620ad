"""A Hugging Face model directory on local disk: its config, its weight files, its tokenizer files.

    md = ModelDir.open("path/to/Llama-2-7b-hf")   # reads config.json and the safetensors headers only
    model = md.build_meta()                        # the model's own class, every parameter on the meta device
    engine = zerofit.initialize("path/to/Llama-2-7b-hf", config)   # the same, then weights stream in

Nothing is downloaded: the path must exist. The weights are read later, one
tensor at a time, by the engine's materialization (see [Note: one tensor's
worth] in :mod:`zerofit.models.safetensors`). Every error names the file and,
where there is one, the tensor.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from zerofit.models.safetensors import TensorInfo, WeightFileError, descriptor, read_header, read_into

__all__ = ["ModelDir", "ModelDirError", "WeightFileError", "TOKENIZER_FILES", "read_config"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# what a tokenizer and generation defaults need, copied into checkpoints and exports
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


class ModelDirError(WeightFileError):
    """The model directory cannot be used: missing, incomplete, or of an architecture zerofit cannot build."""


@dataclass
class ModelDir:
    """A local Hugging Face causal-LM directory: ``config.json`` and safetensors weights (sharded or not)."""

    path: Path
    config: object  # transformers.PretrainedConfig
    weights: dict[str, TensorInfo] = field(repr=False)  # every tensor of every weight file, by name
    prefix: str = ""  # the model class's base_model_prefix: some checkpoints store names without it

    @classmethod
    def open(cls, path: str | os.PathLike, config_only: bool = False) -> ModelDir:
        """The folder at ``path``, its config and every weight file's header read (``config_only``: config.json
        alone, for planning: no weights are needed, or read)."""
        p = Path(path).expanduser()
        if not p.is_dir():
            what = "is a file, not a model directory" if p.exists() else "does not exist"
            raise ModelDirError(f"{p}: {what} (expected a folder with config.json and *.safetensors)")
        if not (p / "config.json").is_file():
            raise ModelDirError(f"{p / 'config.json'}: no such file: {p} is not a Hugging Face model directory")
        return cls(p, read_config(p), {} if config_only else _weight_table(p))

    # ------------------------------------------------------------------ the model

    def model_class(self) -> type:
        """The causal-LM class named by config.json (``architectures``, else its ``model_type``)."""
        import transformers
        from transformers import AutoModelForCausalLM

        names = list(getattr(self.config, "architectures", None) or [])
        for name in names:
            cls = getattr(transformers, name, None)
            if isinstance(cls, type) and issubclass(cls, nn.Module):
                return cls
        try:
            return AutoModelForCausalLM._model_mapping[type(self.config)]
        except KeyError:
            pass
        raise ModelDirError(
            f"{self.path / 'config.json'}: unknown architecture {names or '(none)'} of model_type "
            f"{getattr(self.config, 'model_type', None)!r}: transformers {transformers.__version__} has no causal-LM "
            "class for it"
        )

    def build_meta(self) -> nn.Module:
        """The model with every parameter on the meta device (no memory), fp32, ready for the engine."""
        cls = self.model_class()
        self.prefix = getattr(cls, "base_model_prefix", "") or ""
        try:
            with torch.device("meta"):
                model = (
                    cls._from_config(self.config, dtype=torch.float32)
                    if hasattr(cls, "_from_config")
                    else cls(self.config)
                )
        except Exception as e:  # noqa: BLE001 - a value the config class let through, that the model cannot use
            raise ModelDirError(
                f"{self.path / 'config.json'}: {cls.__name__} cannot be built from it "
                f"({type(e).__name__}: {_one_line(e)}): correct that value in config.json"
            ) from None
        if (self.path / "generation_config.json").is_file() and hasattr(model, "generation_config"):
            from transformers import GenerationConfig  # the folder's generation defaults, as from_pretrained's

            model.generation_config = GenerationConfig.from_pretrained(self.path, local_files_only=True)
        return model

    # ------------------------------------------------------------------ the weights

    def tensor(self, names: list[str]) -> TensorInfo:
        """The stored tensor for a parameter known by any of ``names`` (tied weights have several). Hugging
        Face checkpoints sometimes store names without (or with) the base model's prefix: try both."""
        prefix = self.prefix
        for n in names:
            for cand in (n, n.removeprefix(prefix + ".") if prefix else n, f"{prefix}.{n}" if prefix else n):
                if cand in self.weights:
                    return self.weights[cand]
        files = sorted({str(i.file.name) for i in self.weights.values()})
        raise ModelDirError(
            f"{self.path}: tensor {names[0]!r} is not in any weight file "
            f"({', '.join(files)}); the files do not match config.json"
        )

    def tokenizer_files(self) -> list[Path]:
        return [self.path / n for n in TOKENIZER_FILES if (self.path / n).is_file()]

    # ------------------------------------------------------------------ a WeightSource (models/source.py)

    def dtype(self) -> torch.dtype:
        """As transformers' ``from_pretrained`` loads the folder (``dtype="auto"``): config.json's ``dtype``
        (``torch_dtype`` in older files), else the dtype most of its stored weights' elements have; fp32 when
        nothing says."""
        cfg = json.loads((self.path / "config.json").read_text())
        named = cfg.get("dtype") or cfg.get("torch_dtype")
        if named in DTYPE_OF_NAME:
            return DTYPE_OF_NAME[named]
        return most_dtype((i.dtype, i.numel) for i in self.weights.values())

    def tokenizer(self):
        """The folder's own tokenizer (local files only), or None when it has none."""
        return load_tokenizer(self.path)

    def fill(self, names: list[str], dst: torch.Tensor) -> None:
        load_tensor(self, names, dst, self.__dict__.setdefault("_fds", {}))

    def close(self) -> None:
        for fd in self.__dict__.pop("_fds", {}).values():
            os.close(fd)

    # ------------------------------------------------------------------ a 4-bit folder ([Note: a 4-bit folder])

    @property
    def quant4(self):
        """The folder's 4-bit form (:class:`~zerofit.models.quantized.FolderQuant`), None if it is not quantized;
        a quantization zerofit does not read raises :class:`ModelDirError`."""
        from zerofit.models.quantized import STATE, QuantizedFolderError, folder_quant

        try:
            form = folder_quant(self.config, self.path / "config.json")
        except QuantizedFolderError as e:
            raise ModelDirError(str(e)) from None
        if form is not None and self.weights and not any(STATE in n for n in self.weights):
            raise ModelDirError(
                f"{self.path / 'config.json'}: its quantization_config says 4 bits, but no weight of "
                "the folder is stored so (no quant states beside them): remove quantization_config "
                "from config.json if these are the 16-bit weights"
            )
        return form

    def is_packed(self, names: list[str]) -> bool:
        """Whether the weight known as ``names`` is stored in 4 bits (with only config.json read: every linear of
        the blocks is, as transformers' 4-bit loading quantizes them)."""
        from zerofit.models.quantized import state_key

        if not self.weights:  # (a PEFT model's adapters are its own, never the folder's)
            from zerofit.models.adapter_names import is_adapter_param

            return self.quant4 is not None and not any(is_adapter_param(n) for n in names)
        try:
            info = self.tensor(names)
        except ModelDirError:
            return False
        return state_key(self.weights, info.name) is not None

    def weight_shape(self, names: list[str]) -> tuple:
        """The model's shape of the weight known as ``names`` (a 4-bit one's from its quant state)."""
        from zerofit.models.quantized import QuantizedFolderError, weight_shape

        try:
            return weight_shape(self.weights, self.tensor(names))
        except QuantizedFolderError as e:
            raise ModelDirError(str(e)) from None

    def check_packed(self, names: list[str], shape: tuple) -> None:
        """The 4-bit weight known as ``names`` checked from the headers and its quant state alone (before anything
        is allocated); nothing to check with only config.json read."""
        from zerofit.models.quantized import QuantizedFolderError, check_packed

        if not self.weights:
            return
        try:
            check_packed(self.weights, self.tensor(names), shape, self.quant4)
        except QuantizedFolderError as e:
            raise ModelDirError(str(e)) from None

    def packed(self, names: list[str], shape: tuple):
        """The 4-bit weight known as ``names`` as stored (:class:`~zerofit.models.nf4.Packed`), checked."""
        from zerofit.models.quantized import QuantizedFolderError, read_packed

        try:
            return read_packed(self.weights, self.tensor(names), shape, self.quant4)
        except QuantizedFolderError as e:
            raise ModelDirError(str(e)) from None


def read_config(folder: Path):
    """``folder/config.json`` as transformers reads it (its ``AutoConfig``), or :class:`ModelDirError` naming the
    file, the field and what is wrong: not JSON, not an object, a value of the wrong type (transformers' config
    classes check each field's type), a combination the config class refuses."""
    path = Path(folder) / "config.json"
    try:
        body = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelDirError(
            f"{path}: not a JSON file ({e}): a model directory's config.json is the JSON object "
            "transformers' save_pretrained writes"
        ) from None
    if not isinstance(body, dict):
        raise ModelDirError(
            f"{path}: holds a JSON {type(body).__name__}; expected an object with the model's "
            "configuration (model_type, hidden_size, ...)"
        )
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many types here; each is named in the message
        raise ModelDirError(f"{path}: {_config_problem(e, body)}") from None


def _config_problem(e: BaseException, body: dict) -> str:
    """What transformers' refusal of a config.json says, in one line, with what to do."""
    import re

    import transformers

    cls = getattr(transformers, f"{str(body.get('model_type', '')).capitalize()}Config", None)
    reader = f"transformers {transformers.__version__}" + (f"'s {cls.__name__}" if isinstance(cls, type) else "")
    m = re.match(r"Validation error for field '([^']+)'", str(e))
    if m and e.__cause__ is not None:  # huggingface_hub's strict dataclasses: one field's type
        field, cause = m.group(1), _one_line(e.__cause__)
        wanted = list(
            dict.fromkeys(
                _JSON_TYPES.get(t, t) for t, _ in re.findall(r"expected (?:an? )?([\w\[\]]+), got (\w+)", cause)
            )
        )
        if not wanted:
            return f"field {field!r}: {cause} ({reader} checks each field's type): correct it in config.json"
        return (
            f"field {field!r}: expected {' or '.join(wanted)}, found {json.dumps(body.get(field))[:80]} ({reader} "
            f"checks each field's type): write {field} as {wanted[0]} in config.json"
        )
    if type(e).__name__.startswith("StrictDataclass") and e.__cause__ is not None:
        return f"{reader} refuses it ({_one_line(e.__cause__)}): correct config.json"
    return f"cannot read the model configuration ({type(e).__name__}: {_one_line(e)})"


_JSON_TYPES = {
    "NoneType": "null",
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "list": "a list",
    "dict": "an object",
}


def _one_line(e: BaseException) -> str:
    return " ".join(line.strip() for line in str(e).splitlines() if line.strip())


def _weight_table(p: Path) -> dict[str, TensorInfo]:
    """Read the index (or find the single file) and every file's header; check the index against the files."""
    index = p / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelDirError(f"{index}: malformed index ({e!r})") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (p / f).is_file()]
        if missing:
            example = next(n for n, f in weight_map.items() if f == missing[0])
            raise ModelDirError(
                f"{p / missing[0]}: missing shard (listed in {INDEX}, holds tensor {example!r}"
                f"{f' and {len(missing) - 1} more files' if len(missing) > 1 else ''})"
            )
    elif (p / SINGLE).is_file():
        files, weight_map = [SINGLE], None
    else:
        files = sorted(f.name for f in p.glob("*.safetensors"))
        weight_map = None
        if not files:
            other = sorted(f.name for f in p.iterdir() if f.suffix in (".bin", ".pt", ".pth", ".ckpt"))
            hint = (
                (
                    f" (found {', '.join(other)}: convert them to safetensors, e.g. load with transformers and "
                    "save_pretrained)"
                )
                if other
                else ""
            )
            raise ModelDirError(f"{p}: no {SINGLE}, {INDEX} or *.safetensors file{hint}")
    table: dict[str, TensorInfo] = {}
    for f in files:
        infos, _ = read_header(p / f)
        for name, info in infos.items():
            if weight_map is not None and weight_map.get(name) != f:
                continue  # the index decides which file holds a name
            table[name] = info
    if weight_map is not None:
        absent = [n for n in weight_map if n not in table]
        if absent:
            raise ModelDirError(
                f"{p / weight_map[absent[0]]}: tensor {absent[0]!r} listed in {INDEX} is not in that file"
            )
    return table


# the dtypes a config.json (and a checkpoint's record) names, by the names it uses
DTYPE_OF_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def most_dtype(sizes) -> torch.dtype:
    """The dtype most of the elements have, of ``(dtype, numel)`` pairs (fp32, bf16 and fp16 counted); fp32 when
    none: what a model (or a folder) of mostly 16-bit weights with a few fp32 norms is."""
    count: dict[torch.dtype, int] = {}
    for dt, n in sizes:
        if dt in DTYPE_OF_NAME.values():
            count[dt] = count.get(dt, 0) + n
    return max(count, key=count.__getitem__) if count else torch.float32


def load_tokenizer(folder: Path | None):
    """The folder's own tokenizer (local files only), or None when it has none."""
    if folder is None or not any((Path(folder) / n).is_file() for n in TOKENIZER_FILES[:5]):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def load_tensor(md: ModelDir, names: list[str], dst: torch.Tensor, fds: dict | None = None) -> None:
    """Read the parameter known as ``names`` into ``dst`` (any dtype/device), checking its shape.
    ``fds``: open file descriptors by path, reused across calls (the caller closes them). A source that
    holds some values itself (``own_value``: a PEFT model's adapters, zerofit.lora.model) gives those."""
    own = getattr(md, "own_value", None)
    value = own(names) if own is not None else None
    if value is not None:
        dst.copy_(value)
        return
    info = md.tensor(names)
    if tuple(info.shape) != tuple(dst.shape):
        raise ModelDirError(
            f"{info.file}: tensor {info.name!r} has shape {list(info.shape)}, the model built "
            f"from config.json expects {list(dst.shape)}"
        )
    if info.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ModelDirError(
            f"{info.file}: tensor {info.name!r} is {info.dtype}: zerofit trains from fp32, bf16 "
            "or fp16 weights (dequantize first)"
        )
    read_into(info, dst, descriptor(fds, info.file))


def positions(config) -> tuple[int | None, bool]:
    """The model's context (``max_position_embeddings``, GPT-2's ``n_positions``...) and whether its positions
    are learnt (a table: a longer sequence indexes past it and fails) rather than rotary (a longer sequence runs,
    beyond what the model was trained on)."""
    n = next(
        (
            v
            for k in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
            if isinstance(v := getattr(config, k, None), int) and v > 0
        ),
        None,
    )
    rotary = any(getattr(config, k, None) is not None for k in ("rope_theta", "rope_parameters", "rope_scaling"))
    return n, n is not None and not rotary


def window_length(seq_len: int | None, config) -> tuple[int, str | None]:
    """The tokens per training window for ``config``'s model: ``seq_len`` as given, else its context, at most
    2048. With it, a warning (or None) where ``seq_len`` passes a rotary model's context; one past learnt
    positions raises :class:`ModelDirError` (it would index past the model's position table)."""
    n, learnt = positions(config)
    if seq_len is None:
        return min(n or 2048, 2048), None
    if n is None or seq_len <= n:
        return seq_len, None
    if learnt:
        raise ModelDirError(
            f"--seq-len {seq_len} is longer than the model's {n} positions (config.json's learnt "
            f"position table): give --seq-len {n} or less"
        )
    return seq_len, (
        f"--seq-len {seq_len} is longer than the model's context of {n} tokens (config.json's "
        f"max_position_embeddings; {rope_scaling(config)}): it trains as asked, beyond what the model was trained "
        "on (long-context fine-tuning)"
    )


def rope_scaling(config) -> str:
    """The rotary positions' scaling in words: its type and factor, or that there is none."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return "no rope_scaling"
    factor = params.get("factor")
    return f"rope_scaling {kind}" + (f" x{factor:g}" if isinstance(factor, (int, float)) else "")
