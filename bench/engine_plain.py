"""python bench/engine_plain.py --workload W1 --cap none --result /tmp/plain.json
python bench/engine_plain.py --workload smoke --device cpu          # dry run on CPU

Everything on the GPU, no cap: the in-GPU speed the offloading engines are measured against.

``--liger``: the same with Liger-Kernel's Llama kernels patched in (plain + Liger, PEFT + Liger: the peers of
zerofit's fast kernels).

``--qlora`` (and W6c): PEFT over bitsandbytes' 4-bit model on the GPU (common.build_qlora_model), W6c's in-GPU
peer: 70B in NF4 (~35 GB) fits an H200.

``--lora`` (and the W6 workloads): PEFT on the GPU, the in-GPU ceiling of W6. The base in bf16 on the device
(built there, frozen), ``peft.get_peft_model`` with W6's LoRA (common.LORA: fp32 adapters, PEFT's own init),
gradient checkpointing on every decoder layer, fused AdamW (lr 2e-4) over the adapters only, bf16 autocast.

fp32 parameters on the device, bf16 compute under ``torch.autocast``, Hugging
Face gradient checkpointing (non-reentrant) on every decoder layer, fused AdamW
(lr 1e-4, weight decay 0.01), loss / G summed over the G micro-batches. The
model is built on the meta device and initialised where it lives (no CPU copy).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


class Plain:
    def __init__(self, args, w, res):
        import torch

        self.torch, self.device = torch, args.device
        if args.liger:  # the classes are patched before the model is built from them
            import liger_kernel
            from liger_kernel.transformers import apply_liger_kernel_to_llama

            apply_liger_kernel_to_llama()
            res.extra["liger_kernel"] = getattr(liger_kernel, "__version__", "installed")
        if common.qlora_wanted(args, w):  # W6c: bitsandbytes' Linear4bit in the GPU, PEFT over it
            base = common.build_qlora_model(w, args.device)
            torch.manual_seed(args.seed)
            self.model = common.lora_wrap(base, args.seed)
            self.model.train()
            common.lora_record(res, self.model, qlora=True)
            params, lr = [p for p in self.model.parameters() if p.requires_grad], common.LORA.lr
            res.extra["optimizer"] = (
                "torch.optim.AdamW(fused=True) over the adapters (fp32); NF4 base on device "
                "(bitsandbytes Linear4bit, double quantization)"
            )
        elif common.lora_wanted(args, w):  # W6: the bf16 base on the device, frozen; fp32 adapters trained
            base = common.build_model(w, args.device, dtype=torch.bfloat16, init_in_dtype=True)
            common.enable_checkpointing(base)
            torch.manual_seed(args.seed)  # PEFT's adapter init draws from the global generator
            self.model = common.lora_wrap(base, args.seed)
            self.model.train()
            common.lora_record(res, self.model)
            params, lr = [p for p in self.model.parameters() if p.requires_grad], common.LORA.lr
            res.extra["optimizer"] = "torch.optim.AdamW(fused=True) over the adapters (fp32); bf16 base on device"
        else:
            self.model = common.build_model(w, args.device)  # fp32 master weights on the device
            common.enable_checkpointing(self.model)
            params, lr = self.model.parameters(), 1e-4
            res.extra["optimizer"] = "torch.optim.AdamW(fused=True), fp32 params on device"
        # fused=True needs the CUDA (or CPU) fused kernel; both exist in torch >= 2.4.
        self.opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, fused=True)
        self.device_type = "cuda" if args.device.startswith("cuda") else "cpu"
        self.clip, self.res = args.clip, res
        if args.clip:
            res.extra["gradient_clipping"] = args.clip
            res.extra["grad_norms"] = []

    def step(self, micro_batches):
        torch = self.torch
        g = len(micro_batches)
        total = torch.zeros((), device=self.device)
        for item in micro_batches:
            batch = {k: v.to(self.device, non_blocking=True) for k, v in common.batch_dict(item).items()}
            with torch.autocast(self.device_type, dtype=torch.bfloat16):
                loss = self.model(**batch).loss
            (loss / g).backward()
            total += loss.detach() / g
        if self.clip:  # global-norm clipping, as the Hugging Face Trainer does (max_grad_norm 1.0)
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            self.res.extra["grad_norms"].append(round(float(norm), 4))  # a sync, as the Trainer's logging
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total.item()  # sync point: the step is done on the GPU


def main() -> int:
    parser = common.engine_args(__doc__)
    parser.add_argument("--clip", type=float, default=0.0, help="gradient_clipping (global norm); 0 = none")
    parser.add_argument(
        "--liger",
        action="store_true",
        help="Liger-Kernel's Llama kernels (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy), patched into "
        "transformers' Llama classes before the model is built (apply_liger_kernel_to_llama)",
    )
    args = parser.parse_args()
    return common.run_engine("plain", args, Plain, Plain.step, uses_cap=True)


if __name__ == "__main__":
    common.exit_now(main())
