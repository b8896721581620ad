"""python bench/engine_deepspeed.py --workload W1 --cap 24GiB --result /tmp/ds.json

DeepSpeed ZeRO-3 with parameters and optimizer offloaded to pinned CPU memory (the main peer).

Single process (rank 0 of 1 on 127.0.0.1, NCCL). The config is the one of
``bench/WORKLOADS.md``: bf16, ZeRO stage 3, ``offload_optimizer`` and
``offload_param`` on ``cpu`` with ``pin_memory``, ``overlap_comm``,
``contiguous_gradients``, ``stage3_max_live_parameters`` 1e9,
``stage3_prefetch_bucket_size`` 5e8, ``stage3_param_persistence_threshold``
1e6, ``reduce_bucket_size`` 5e8; optimizer ``AdamW`` (so DeepSpeedCPUAdam,
lr 1e-4, weight decay 0.01); micro-batch 2, 4 gradient-accumulation steps. The
model is built under ``deepspeed.zero.Init`` with Hugging Face gradient
checkpointing on every decoder layer.

``--lora`` (and the W6 workloads): PEFT + ZeRO-3 with the same offload, the field's usual route on a 24 GB card.
The base is built under ``deepspeed.zero.Init`` (bf16, partitioned, offloaded), gradient checkpointing on, then
``peft.get_peft_model`` with W6's LoRA (common.LORA); ``deepspeed.initialize`` partitions the adapters PEFT added
and gets the trainable parameters only (DeepSpeedCPUAdam, lr 2e-4, over the adapters' fp32 masters).

``--no-offload-param``: ``offload_param`` ``none`` (the parameter shards stay on
the GPUs; only the optimizer, fp32 master weights and gradients go to pinned
CPU memory), the ZeRO-3 CPU-offload setting for when the host cannot hold the
16-bit parameters as well.

Under torchrun with several ranks (which sets OMP_NUM_THREADS=1), each rank
gets its share of the cores for DeepSpeedCPUAdam's OpenMP loops
(``torch.set_num_threads``, reported in ``extra.threads``), as zerofit's ranks
do; one process keeps torch's default.

DeepSpeed's ``cpu_adam`` op compiles on first use (nvcc, g++, ninja); it is
built before the model, and its build time is reported in ``extra.op_build_s``
(it is inside the seconds-to-first-step figure too). Set TORCH_EXTENSIONS_DIR
and TORCH_CUDA_ARCH_LIST=9.0 (bench/gpu/setup.sh does) to keep it short.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


def ds_config(w: common.Workload, bf16: bool = True, offload_param: bool = True, lr: float = 1e-4) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": w.micro_batch,
        "gradient_accumulation_steps": w.grad_accum,
        "train_batch_size": w.micro_batch * w.grad_accum * int(os.environ.get("WORLD_SIZE", "1")),
        "bf16": {"enabled": bf16},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-8}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_max_live_parameters": 1e9,
            "stage3_prefetch_bucket_size": 5e8,
            "stage3_param_persistence_threshold": 1e6,
            "reduce_bucket_size": 5e8,
        },
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if not offload_param:
        config["zero_optimization"]["offload_param"] = {"device": "none"}
    return config


def infinity(config: dict, nvme: str) -> dict:
    """ZeRO-Infinity: parameters and optimizer state on the NVMe path, with the settings that let it run on
    W1 here (bench/WORKLOADS.md: the defaults fail with "More elements ... than buffer size" and "Not
    enough buffers 0 for swapping 1")."""
    z = config["zero_optimization"]
    z["offload_param"] = {
        "device": "nvme",
        "nvme_path": nvme,
        "pin_memory": True,
        "buffer_count": 8,
        "buffer_size": 4.5e8,
    }
    z["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "pin_memory": True}
    z["stage3_max_live_parameters"] = 4e8
    z["stage3_prefetch_bucket_size"] = 1e8
    config["aio"] = {
        "block_size": 1 << 20,
        "queue_depth": 8,
        "thread_count": 1,
        "single_submit": False,
        "overlap_events": True,
    }
    return config


def reinit_partitioned(model) -> None:
    """Hugging Face's weight init, again, on full (gathered) parameters.

    Under ``zero.Init`` each module's parameters are partitioned as soon as it is
    built, so ``post_init``'s initialisation ran on empty shards and left torch's
    constructor defaults (N(0, 1) embeddings: a loss near 250 instead of ln V).
    ``initialize_weights_zero3`` gathers each module's parameters and runs the
    model's ``_init_weights`` on them; the ``_is_hf_initialized`` marks left by
    the first pass must go first, or it skips every module.
    """
    from transformers.integrations.deepspeed import initialize_weights_zero3

    for obj in (*model.modules(), *model.parameters(), *model.buffers()):
        obj.__dict__.pop("_is_hf_initialized", None)
    initialize_weights_zero3(model)


class DeepSpeedEngine:
    def __init__(self, args, w, res):
        import torch

        common.single_process_env()
        import deepspeed

        self.torch = torch
        deepspeed.init_distributed(dist_backend="nccl" if args.device.startswith("cuda") else "gloo")
        if args.device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if local_world > 1:  # torchrun's OMP_NUM_THREADS=1 would make DeepSpeedCPUAdam single-threaded
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            torch.set_num_threads(max(1, cores // local_world))
        res.extra["threads"] = torch.get_num_threads()

        # Build the CPU Adam op now, so its (one-time) compile is measured on its own.
        t = time.perf_counter()
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load()
        res.extra["op_build_s"] = round(time.perf_counter() - t, 1)
        print(f"[deepspeed] cpu_adam op ready in {res.extra['op_build_s']} s", flush=True)

        if common.qlora_wanted(args, w):
            raise common.Refused("deepspeed has no QLoRA run (W6c's peers: plain, PEFT + bitsandbytes in the GPU)")
        lora = common.lora_wanted(args, w)
        config = ds_config(w, offload_param=not args.no_offload_param, lr=common.LORA.lr if lora else 1e-4)
        if args.nvme:
            config = infinity(config, args.nvme)
            from deepspeed.ops.op_builder import AsyncIOBuilder

            t = time.perf_counter()
            AsyncIOBuilder().load()
            res.extra["aio_build_s"] = round(time.perf_counter() - t, 1)
        res.extra["ds_config"] = config
        t = time.perf_counter()
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = common.model_class(w)(common.model_config(w))
        reinit_partitioned(model)
        res.extra["zero_init_s"] = round(time.perf_counter() - t, 1)
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": args.reentrant_checkpointing}
        )
        model.config.use_cache = False
        model.train()
        params = model.parameters()
        if lora:  # PEFT over the partitioned base; the adapters are partitioned by deepspeed.initialize
            torch.manual_seed(args.seed)
            model = common.lora_wrap(model, args.seed)
            model.train()
            common.lora_record(res, model)
            params = [p for p in model.parameters() if p.requires_grad]
        t = time.perf_counter()
        self.engine, self.opt, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)
        res.extra["ds_initialize_s"] = round(time.perf_counter() - t, 1)
        res.extra["optimizer"] = (
            type(self.engine.optimizer).__name__
            + " / "
            + type(getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)).__name__
        )
        self.device = self.engine.device

    def step(self, micro_batches):
        torch = self.torch
        losses = []
        for item in micro_batches:
            batch = {k: v.to(self.device, non_blocking=True) for k, v in common.batch_dict(item).items()}
            loss = self.engine(**batch).loss
            self.engine.backward(loss)
            self.engine.step()  # steps the optimizer at the gradient-accumulation boundary
            losses.append(loss.detach())
        self.micro_losses = torch.stack(losses).float().tolist()  # sync point
        total = sum(self.micro_losses) / len(self.micro_losses)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return total


def main() -> int:
    p = common.engine_args(__doc__)
    p.add_argument(
        "--reentrant-checkpointing",
        action="store_true",
        help="use_reentrant=True for HF checkpointing (fallback if non-reentrant fails under ZeRO-3)",
    )
    p.add_argument(
        "--nvme", default=None, help="ZeRO-Infinity: offload_param and offload_optimizer on nvme under this folder"
    )
    p.add_argument(
        "--no-offload-param",
        action="store_true",
        help="offload_param none: parameter shards on the GPUs, only the optimizer on the CPU",
    )
    args = p.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # dry runs only; must precede `import deepspeed`
    return common.run_engine(
        "deepspeed", args, DeepSpeedEngine, DeepSpeedEngine.step, uses_cap=True, version_modules=("deepspeed",)
    )


if __name__ == "__main__":
    common.exit_now(main())
