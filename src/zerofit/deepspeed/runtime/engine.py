"""``deepspeed.runtime.engine``: ``DeepSpeedEngine``, the type of what ``deepspeed.initialize`` returns.

``isinstance(x, DeepSpeedEngine)`` is True for zerofit's engines (:class:`zerofit.engine.engine.Engine`),
so code that unwraps an engine (accelerate's ``extract_model_from_parallel``, which Hugging Face's
``save_pretrained`` calls whenever DeepSpeed is installed: ``while isinstance(model, DeepSpeedEngine): model =
model.module``) gets the model back. Building one directly is refused: ``deepspeed.initialize`` builds it."""

from __future__ import annotations

from zerofit.deepspeed import DeepSpeedOptimizerCallable, DeepSpeedSchedulerCallable
from zerofit.deepspeed.names import refusing_getattr
from zerofit.engine.faces.deepspeed_names import DeepSpeedUnsupported

__all__ = ["DeepSpeedEngine", "DeepSpeedOptimizerCallable", "DeepSpeedSchedulerCallable"]


class _EngineType(type):
    def __instancecheck__(cls, obj) -> bool:
        from zerofit.engine.engine import Engine

        return isinstance(obj, Engine)

    def __subclasscheck__(cls, sub) -> bool:
        from zerofit.engine.engine import Engine

        return isinstance(sub, type) and issubclass(sub, Engine)


class DeepSpeedEngine(metaclass=_EngineType):
    """The type of zerofit's engines under DeepSpeed's name (``isinstance`` only)."""

    def __new__(cls, *args, **kwargs):
        raise DeepSpeedUnsupported(
            "DeepSpeedEngine(...): build the engine with deepspeed.initialize(model=..., "
            "config=...), which returns zerofit's Engine (zerofit.engine.engine.Engine)"
        )


__getattr__ = refusing_getattr(
    __name__,
    {
        "DeepSpeedOptimizer": "zerofit runs its own AdamW; initialize() returns a view of it (engine.optimizer)",
        "MUON_OPTIMIZER": "zerofit runs AdamW only",
    },
)
