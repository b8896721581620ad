"""zerofit: train language models whose training state is many times larger than GPU memory.

The Python API is the product; the CLI is a thin layer over it::

    import zerofit
    engine = zerofit.initialize(model, config)   # config: dict, path, or zerofit.config.ZerofitConfig
    loss = engine.train_batch(micro_batches)     # one optimizer step over the micro-batches
    engine.timeline()                            # where the last step's time went
"""

from __future__ import annotations

import logging as _logging

from zerofit.version import __version__

# bitsandbytes warns at import, on machines without the optional `kernels` package, that its CPU 4-bit matmul
# kernel is missing: zerofit never calls that kernel (it dequantizes a 4-bit base itself), and peft imports
# bitsandbytes whenever it is installed, so the line would follow every LoRA command
_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(_logging.ERROR)

__all__ = ["initialize", "generate", "__version__"]


def initialize(model, config=None, *, param_groups=None, **overrides):
    """Wrap ``model`` in a training engine configured by ``config``.

    ``model`` is an ``nn.Module`` (real, or built on the meta device) or the path of a local Hugging Face
    model directory (``config.json`` and ``*.safetensors``, sharded or not): that one is built on the meta
    device and its weights are read tensor by tensor into the engine's own buffers, so the host never
    holds the model twice.

    ``config`` may be a DeepSpeed-style dict or JSON path, a zerofit dict or a
    :class:`zerofit.config.ZerofitConfig`. Keyword ``overrides`` replace fields of
    the resolved zerofit config (for example ``max_gpu_memory="24GiB"``).

    ``param_groups``: AdamW parameter groups in ``torch.optim``'s format, e.g.
    ``[{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]``: parameters of
    ``model`` or their names; a group may set ``lr``, ``weight_decay``, ``betas`` and ``eps`` and takes the
    config's value for the others. Every parameter must be in exactly one group (zerofit trains them all).
    None: one group with the config's values. See docs/config.md.
    """
    from zerofit.engine.engine import Engine

    return Engine.create(model, config, param_groups=param_groups, **overrides)


def generate(model, prompts, **kwargs):
    """Generate text with ``model`` (a model directory, a zerofit checkpoint, an ``nn.Module``, a training
    engine), streaming the blocks that do not fit ``max_gpu_memory`` through the GPU: see
    :func:`zerofit.infer.text.generate` and docs/inference.md."""
    from zerofit.infer.text import generate as _generate

    return _generate(model, prompts, **kwargs)
