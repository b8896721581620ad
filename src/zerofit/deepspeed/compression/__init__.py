"""``deepspeed.compression``: DeepSpeed 0.19.8 keeps only ``compression.helper`` (``recursive_getattr``,
``recursive_setattr``, which DeepSpeed-Chat's LoRA code imports from there); its compression library is gone."""

from zerofit.deepspeed.names import refusing_getattr

__getattr__ = refusing_getattr(__name__, {}, submodules=("helper",))
