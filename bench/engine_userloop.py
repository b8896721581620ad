"""python bench/engine_userloop.py --workload W1 --backend zerofit --cap 24GiB --result /tmp/zf_fsdp1.json
python bench/engine_userloop.py --workload smoke --backend zerofit --device cpu --steps 2      # dry run
(``--backend torch`` needs a GPU: torch's FSDP refuses a machine without an accelerator)

W7 (bench/WORKLOADS.md): the FSDP1-shaped script users write, run as written on a backend:

    model = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(LlamaDecoderLayer),
                                     cpu_offload=CPUOffload(offload_params=True),
                                     mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                                    reduce_dtype=torch.float32), device_id=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    for each step: 4 micro-batches from a DataLoader, no_sync() on the first three, loss.backward();
    model.clip_grad_norm_(1.0);
    optimizer.step(); optimizer.zero_grad()

``--backend torch``: ``torch.distributed.fsdp.FullyShardedDataParallel`` (one process, world size 1; the model
built on the CPU in fp32, Hugging Face gradient checkpointing on every decoder layer; the CPU step is torch's
AdamW over the offloaded parameters). ``--backend zerofit``: ``zerofit.fsdp.FullyShardedDataParallel``, the one
import changed (the model built on the meta device, the engine initializes it; its cap from ``--cap``;
zerofit checkpoints the blocks itself). ``--loop accelerate``: the same step through an ``Accelerator``
(``prepare``, ``accumulate``, ``backward``, ``clip_grad_norm_``), the model wrapped the same way first.
``--loop fabric``: the same through Lightning Fabric (``setup``, ``no_backward_sync``, ``backward``,
``clip_gradients``); its stock run (``--backend torch``) is Fabric's own ``FSDPStrategy(cpu_offload=True)``, which
wraps the model itself.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


class UserLoopBench:
    def __init__(self, args, w, res):
        import torch
        from torch.distributed.fsdp import CPUOffload, MixedPrecision
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
        from transformers import LlamaForCausalLM
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        if common.lora_wanted(args, w):
            raise common.Refused("the W7 loop trains the whole model (no LoRA run)")
        self.torch, self.args, self.res = torch, args, res
        self.engine = None  # zerofit's engine: its timeline after each step
        cuda = args.device.startswith("cuda")
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if args.backend == "zerofit":
            from zerofit.fsdp import FullyShardedDataParallel as FSDP

            with torch.device("meta"):
                model = LlamaForCausalLM(common.llama_config(w))
            extra = {"max_gpu_memory": args.cap} if common.parse_bytes(args.cap) else {}
            # the batch the placement is made for, as a user of zerofit.fsdp names it (docs/userloop.md): the
            # wrapper sees no batch before the first forward
            extra.update(seq_len=w.seq, micro_batch_size=w.micro_batch)
            if args.window > 1:  # the loop's micro-batches held, each block's backward over all of them
                extra["gradient_accumulation_steps"] = args.window
            self.model = FSDP(
                model,
                auto_wrap_policy=policy,
                cpu_offload=CPUOffload(offload_params=True),
                mixed_precision=mp,
                device_id=0 if cuda else None,
                zerofit_config=extra,
            )
            self.engine = self.model.zerofit_engine
            res.extra["plan"] = self.engine.plan.describe()
            print(f"[userloop] {res.extra['plan']}", flush=True)
        elif args.loop == "fabric":  # the stock Fabric run: its FSDPStrategy with CPU offload wraps the model
            from lightning.fabric.strategies import FSDPStrategy

            common.single_process_env()
            model = common.build_model(w, "cpu")
            common.enable_checkpointing(model)
            self.strategy = FSDPStrategy(
                auto_wrap_policy={LlamaDecoderLayer}, cpu_offload=True, mixed_precision=mp, use_orig_params=True
            )
            self.model = model
        else:
            import torch.distributed as dist
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            common.single_process_env()
            if not dist.is_initialized():
                dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
            model = common.build_model(w, "cpu")
            common.enable_checkpointing(model)
            self.model = FSDP(
                model,
                auto_wrap_policy=policy,
                use_orig_params=True,
                cpu_offload=CPUOffload(offload_params=True) if cuda else None,
                mixed_precision=mp,
                device_id=torch.cuda.current_device() if cuda else None,
            )
        self.fabric = None
        if args.loop == "fabric":  # Lightning Fabric: setup, no_backward_sync, backward, clip_gradients, step
            from lightning.fabric import Fabric

            if args.backend == "zerofit":
                self.fabric = Fabric(accelerator="cuda" if cuda else "cpu", devices=1, precision="32-true")
            else:
                self.fabric = Fabric(accelerator="cuda", devices=1, strategy=self.strategy, precision="32-true")
            self.fabric.launch()
            if args.backend != "zerofit":
                self.model = self.fabric.setup_module(self.model)  # FSDP wraps here; the optimizer after it
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=1e-4, weight_decay=0.01, fused=args.backend == "zerofit" or not cuda
        )
        if self.fabric is not None:
            if args.backend == "zerofit":
                self.model, self.opt = self.fabric.setup(self.model, self.opt)
            else:
                self.opt = self.fabric.setup_optimizers(self.opt)
        res.extra["loop"], res.extra["backend"] = args.loop, args.backend
        self.acc = None
        if args.loop == "accelerate":
            from accelerate import Accelerator

            self.acc = Accelerator(gradient_accumulation_steps=w.grad_accum, cpu=not cuda)
            self.model, self.opt = self.acc.prepare(self.model, self.opt)
        self.device = "cuda" if cuda else "cpu"

    def step(self, micro_batches):
        loss = self._step(micro_batches)
        if self.engine is not None:  # as engine_zerofit.py records them (bench/trace.py reads the trace)
            self.res.timeline = {k: round(float(v), 4) for k, v in self.engine.timeline().items()}
            self.res.extra["trace"] = self.engine.trace()
            print(f"[userloop] timeline: {self.res.timeline}", flush=True)
        return loss

    def _step(self, micro_batches):
        g = len(micro_batches)
        total = 0.0
        # the micro-batches come from a DataLoader, as a script's do (zerofit reads each window ahead from one:
        # docs/fsdp.md); --from-list: from the list itself
        batches = [{"input_ids": ids, "labels": ids} for ids in micro_batches]
        source = batches if self.args.from_list else self.torch.utils.data.DataLoader(batches, batch_size=None)
        if self.fabric is not None:
            fabric = self.fabric
            for i, batch in enumerate(source):
                ids = batch["input_ids"].to(self.device, non_blocking=True)
                with fabric.no_backward_sync(self.model, enabled=i < g - 1):
                    loss = self.model(input_ids=ids, labels=ids).loss
                    fabric.backward(loss / g)
                total += loss.item() / g
            fabric.clip_gradients(self.model, self.opt, max_norm=1.0)
            self.opt.step()
            self.opt.zero_grad()
            return total
        if self.acc is not None:
            for batch in source:
                ids = batch["input_ids"].to(self.device, non_blocking=True)
                with self.acc.accumulate(self.model):
                    loss = self.model(input_ids=ids, labels=ids).loss
                    self.acc.backward(loss)
                    if self.acc.sync_gradients:
                        self.acc.clip_grad_norm_(self.model.parameters(), 1.0)
                    self.opt.step()
                    self.opt.zero_grad()
                total += loss.item() / g
            return total
        for i, batch in enumerate(source):
            ids = batch["input_ids"].to(self.device, non_blocking=True)
            ctx = self.model.no_sync() if i < g - 1 else contextlib.nullcontext()
            with ctx:
                loss = self.model(input_ids=ids, labels=ids).loss
                (loss / g).backward()
            total += loss.item() / g
        norm = self.model.clip_grad_norm_(1.0)
        self.res.extra.setdefault("clip_norms", []).append(round(float(norm), 4))  # > 1.0: a clipped step
        self.opt.step()
        self.opt.zero_grad()
        if self.engine is not None:  # the steps whose 16-bit casts ran in their backward ([Note: a speculated cast])
            self.res.extra["cast_steps"] = self.engine.speculator.cast_steps
        return total


def main() -> int:
    parser = common.engine_args(__doc__)
    parser.add_argument("--backend", choices=("zerofit", "torch"), default="zerofit")
    parser.add_argument("--loop", choices=("fsdp1", "accelerate", "fabric"), default="fsdp1")
    parser.add_argument(
        "--window",
        type=int,
        default=1,
        help="zerofit: hold this many micro-batches before their blocks' backward (zerofit_config "
        "gradient_accumulation_steps; 1: each backward() runs its own)",
    )
    parser.add_argument(
        "--from-list",
        action="store_true",
        help="the loop takes its micro-batches from a list (default: from a torch DataLoader over them, as scripts "
        "do: zerofit reads each window ahead from it)",
    )
    args = parser.parse_args()
    name = f"{'zerofit' if args.backend == 'zerofit' else 'fsdp1'}-{args.loop}"
    return common.run_engine(
        name,
        args,
        UserLoopBench,
        UserLoopBench.step,
        uses_cap=True,
        version_modules={"accelerate": ("accelerate",), "fabric": ("lightning",)}.get(args.loop, ()),
    )


if __name__ == "__main__":
    common.exit_now(main())
