"""What ``zerofit train --lora`` sets (no torch import: the CLI reads it before torch loads)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoraOptions:
    """What ``zerofit train --lora`` sets: PEFT's ``LoraConfig`` fields."""

    r: int = 16  # rank (LoraConfig.r)
    alpha: float = 32  # LoraConfig.lora_alpha (scaling alpha / r; rsLoRA alpha / sqrt(r))
    targets: str = "all-linear"  # LoraConfig.target_modules: "all-linear" or names, comma-separated
    dropout: float = 0.0  # LoraConfig.lora_dropout
    rslora: bool = False  # LoraConfig.use_rslora
    modules_to_save: tuple[str, ...] = ()  # LoraConfig.modules_to_save (trained whole, e.g. lm_head)
    qlora: bool = False  # the base's linears in NF4 (config quantize_base: nf4)

    def config(self):
        from peft import LoraConfig

        targets = (
            self.targets if self.targets == "all-linear" else [t.strip() for t in self.targets.split(",") if t.strip()]
        )
        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            target_modules=targets,
            lora_dropout=self.dropout,
            use_rslora=self.rslora,
            modules_to_save=list(self.modules_to_save) or None,
            task_type="CAUSAL_LM",
        )
