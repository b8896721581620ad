"""python bench/engine_fsdp2.py --workload W1 --cap 24GiB --steps 2 --result /tmp/fsdp2.json
python bench/engine_fsdp2.py --workload smoke --device cpu --steps 2   # dry run: gloo, no offload

PyTorch FSDP2 (``fully_shard``) with CPU offload, one process: the second peer.

``fully_shard`` on every decoder layer and then on the root, with
``CPUOffloadPolicy(pin_memory=True)`` and ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``; process group ``cpu:gloo,cuda:nccl`` of world size 1;
``torch.optim.AdamW`` (lr 1e-4, weight decay 0.01) steps the fp32 sharded
parameters on the CPU; Hugging Face gradient checkpointing on every decoder
layer. It is slow (31.9 s/step on W1): run it with ``--steps 2`` (1 warm-up,
1 timed).

The model is initialised on the CPU in fp32 and then sharded unit by unit;
the buffers FSDP does not manage (the rotary ``inv_freq``) go to the GPU.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


class FSDP2:
    def __init__(self, args, w, res):
        if common.lora_wanted(args, w):
            raise common.Refused("fsdp2 has no LoRA run (W6's peers are plain, deepspeed and zerofit)")
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        self.torch = torch
        cuda = args.device.startswith("cuda")
        common.single_process_env()  # torchrun's environment, or one rank of one
        world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
        self.device = torch.device("cuda", local) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(local)
            dist.init_process_group(backend="cpu:gloo,cuda:nccl", device_id=self.device)
        else:
            dist.init_process_group(backend="gloo")
        mesh = init_device_mesh(self.device.type, (world,))

        # Initialised on the CPU as plain tensors, then sharded: fully_shard moves each
        # unit's parameters to the GPU and its offload policy copies the (here: whole)
        # shard back to pinned CPU memory, a transient of one unit at a time. This
        # keeps random initialisation off DTensors (no DTensor RNG on a CUDA mesh).
        model = common.build_model(w, "cpu")  # fp32
        kw = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
        if cuda and args.offload:  # CPU offload needs a GPU to offload from; the CPU dry run shards in place
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=args.pin_memory)
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        res.extra["fsdp"] = {
            "units": len(model.model.layers) + 1,
            "offload": cuda and args.offload,
            "world": world,
            "pin_memory": args.pin_memory,
            "optimizer": args.optimizer,
        }
        # Buffers (the rotary inv_freq) are not sharded and must be where the compute is.
        for mod in model.modules():
            for name, buf in list(mod.named_buffers(recurse=False)):
                mod._buffers[name] = buf.to(self.device)
        res.extra["param_device"] = str(next(model.parameters()).to_local().device)
        common.enable_checkpointing(model)
        self.model = model

        opt_kw = {"lr": 1e-4, "weight_decay": 0.01}
        if args.optimizer == "foreach":
            opt_kw["foreach"] = True
        elif args.optimizer == "fused":
            opt_kw["fused"] = True
        self.opt = torch.optim.AdamW(model.parameters(), **opt_kw)

    def step(self, micro_batches):
        torch = self.torch
        g = len(micro_batches)
        losses = []
        for ids in micro_batches:
            ids = ids.to(self.device, non_blocking=True)  # (B, S) int64
            loss = self.model(input_ids=ids, labels=ids).loss
            (loss / g).backward()
            losses.append(loss.detach())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return torch.stack(losses).float().mean().item()  # sync point


def main() -> int:
    p = common.engine_args(__doc__)
    p.add_argument(
        "--optimizer",
        default="default",
        choices=["default", "foreach", "fused"],
        help="torch.optim.AdamW implementation on the CPU shards (default: torch's choice)",
    )
    p.add_argument(
        "--no-offload",
        dest="offload",
        action="store_false",
        help="no CPU offload: the sharded state stays on the GPUs (the in-GPU ceiling on several GPUs)",
    )
    p.add_argument(
        "--no-pin-memory", dest="pin_memory", action="store_false", help="CPUOffloadPolicy(pin_memory=False)"
    )
    args = p.parse_args()
    return common.run_engine("fsdp2", args, FSDP2, FSDP2.step, uses_cap=True)


if __name__ == "__main__":
    common.exit_now(main())
