"""python bench/engine_zerofit.py --workload W1 --cap 24GiB --result /tmp/zerofit.json
python bench/engine_zerofit.py --workload smoke --device cpu --steps 2

zerofit through its Python API, the way a user calls it.

The model is built on the meta device; ``zerofit.initialize`` materialises and
places it. The GPU cap goes into the config (``max_gpu_memory``): zerofit sets
the allocator's fraction itself, so this script does not. The result carries
zerofit's per-phase timeline of the last step (``engine.timeline()``) and its
``memory_stats()``.

``--lora`` (and the W6 workloads): the base built on the meta device, wrapped by ``zerofit.lora.model.wrap``
(``peft.get_peft_model`` with W6's LoRA, what ``zerofit train --lora`` calls), its adapters made real with PEFT's
own init (common.init_meta_adapters, as ``from_model_dir`` does); zerofit initializes the frozen base unit by unit
where it lives and trains the adapters with AdamW lr 2e-4 (docs/lora.md).

Peak GPU memory is over the whole process, as for the other engines: zerofit
resets the allocator's peak counters at the end of ``initialize``, and
``common.PeakKeeper`` keeps the peak seen before each reset.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))  # the working tree's zerofit

import common  # noqa: E402

_LIVE: list = []  # engines to release before the process exits at once (common.exit_now)


def build(w, lora: bool, seed: int = 0):
    """The workload's model on the meta device; with ``lora``, the PEFT model over it (adapters real, on the CPU)."""
    model = common.build_meta(w)
    if not lora:
        return model
    from zerofit.lora.model import LoraOptions, wrap

    L = common.LORA
    opts = LoraOptions(r=L.r, alpha=L.alpha, targets=",".join(L.targets), dropout=L.dropout)
    return common.init_meta_adapters(wrap(model, opts), seed)


def estimate_apart(workload, config: dict, lora: bool = False) -> tuple[dict, str]:
    """zerofit estimate's prediction (as a dict, and its text) from a process of its own, started and ended before
    the engine: as a user runs `zerofit estimate` before the training run. In the engine's process its probes
    (plain models, a 2-block engine, copies) left the caching allocator fragmented under the cap: W1 at 24 GiB
    ran 1.12-1.59 s steps, slower at each (docs/benchmarks.md)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_estimate_child, args=(workload, config, lora, send))
    proc.start()
    send.close()
    try:
        out = recv.recv()
    except EOFError:
        out = None
    proc.join()
    if out is None or isinstance(out, BaseException):
        raise RuntimeError(f"zerofit estimate failed (exit code {proc.exitcode}): {out!r}")
    return out


def _estimate_child(workload, config: dict, lora: bool, send) -> None:
    from zerofit.estimate import estimate

    try:
        model = common.build_meta(workload)
        L = common.LORA  # LoRA: estimate's own wrap (with_lora), W6's settings
        est = estimate(model, config, lora=dict(r=L.r, alpha=L.alpha, targets=list(L.targets)) if lora else None)
        send.send((est.to_dict(), est.render()))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        send.send(RuntimeError(f"{type(e).__name__}: {e}"))
        raise


class Zerofit:
    def __init__(self, args, w, res):
        import torch

        import zerofit

        self.torch, self.args, self.res = torch, args, res
        res.versions["zerofit"] = getattr(zerofit, "__version__", "?")
        res.extra["zerofit_path"] = os.path.dirname(zerofit.__file__)
        lora = common.lora_wanted(args, w)
        model = build(w, lora, args.seed)
        if lora:
            common.lora_record(res, model, qlora=common.qlora_wanted(args, w))
        self.config = common.zerofit_config(w, lora)
        if common.qlora_wanted(args, w):  # W6c: the blocks' linears in NF4 in host memory ([Note: an NF4 base])
            self.config["quantize_base"] = "nf4"
        if args.clip:
            self.config["gradient_clipping"] = args.clip
        if args.precision:
            self.config["precision"] = args.precision
        if common.parse_bytes(args.cap):
            self.config["max_gpu_memory"] = args.cap
        for item in args.offload:  # e.g. assisted_fraction=0.4, speculative_updates=false
            key, _, value = item.partition("=")
            self.config.setdefault("offload", {})[key] = json.loads(value)
        for item in args.set:  # e.g. max_host_memory=32GiB (JSON, else the text itself)
            key, _, value = item.partition("=")
            try:
                self.config[key] = json.loads(value)
            except json.JSONDecodeError:
                self.config[key] = value
        if args.nvme:
            self.config.setdefault("offload", {}).update(optimizer_device="nvme", nvme_path=args.nvme)
        res.extra["zerofit_config"] = self.config
        if args.estimate:  # zerofit estimate's prediction, made before anything is allocated
            res.extra["estimate"], text = estimate_apart(w, self.config, lora)
            print(f"[zerofit] estimate:\n{text}", flush=True)
        self.engine = zerofit.initialize(model, self.config)
        _LIVE.append(self.engine)
        kernels = getattr(self.engine, "kernels", None)  # [Note: fast kernels]: what computes, and why
        if kernels is not None:
            res.extra["kernels"] = kernels.describe()
            res.extra["compile_seconds"] = kernels.compile_seconds  # filled by the first step's calls
        res.extra["plan"] = self.engine.plan.describe()
        # how the model streams: a chain of blocks, or its units in the hooked mode (docs/engine.md)
        res.extra["streaming"] = "hooked" if self.engine.adapter.hooked else "chain"
        res.extra["units"] = len(self.engine.blocks)
        tier = getattr(self.engine, "_tier", None)
        if tier is not None:
            res.extra["disk"] = {
                "path": str(tier.file.path),
                "bytes": tier.file.nbytes,
                "direct": tier.file.direct,
                **getattr(self.engine, "disk_speed", {}),
            }
            self._disk0 = (tier.bytes_read, tier.bytes_written)
        print(f"[zerofit] {res.extra['plan']}", flush=True)

    def step(self, micro_batches):
        batches = [common.batch_dict(item) for item in micro_batches]
        if self.args.api == "deepspeed":  # DeepSpeed-shaped code: one micro-batch per call
            total = 0.0
            if self.args.announce:  # the window's micro-batches announced first (engine.forward_window)
                self.engine.forward_window(batches)
            if self.args.loader:  # drawn from the engine's own loader (deepspeed_io), as the tutorial does
                torch = self.torch

                class Window(torch.utils.data.Dataset):
                    def __len__(self):
                        return len(micro_batches) * micro_batches[0].shape[0]

                    def __getitem__(self, i):
                        ids = micro_batches[i // micro_batches[0].shape[0]][i % micro_batches[0].shape[0]]
                        return {"input_ids": ids, "labels": ids}

                batches = self.engine.deepspeed_io(
                    Window(),
                    batch_size=micro_batches[0].shape[0],
                    data_sampler=torch.utils.data.SequentialSampler(range(len(Window()))),
                )
            for b in batches:
                out = self.engine(**b)
                self.engine.backward(out.loss)
                self.engine.step()
                total += float(out.loss)
            loss = total / len(batches)
        else:
            loss = float(self.engine.train_batch(batches))
        self.res.timeline = {k: round(float(v), 4) for k, v in self.engine.timeline().items()}
        if hasattr(self.engine, "speculation_stats"):
            self.res.extra["speculation"] = dict(self.engine.speculation_stats)
        if hasattr(self.engine, "window_stats"):
            self.res.extra["window_stats"] = dict(self.engine.window_stats)
        if getattr(self.engine, "last_grad_norm", None) is not None:
            self.res.extra.setdefault("grad_norms", []).append(round(float(self.engine.last_grad_norm), 4))
        print(f"[zerofit] timeline: {self.res.timeline}", flush=True)
        if hasattr(self.engine, "memory_stats"):
            self.res.extra["memory_stats"] = self.engine.memory_stats()
        tier = getattr(self.engine, "_tier", None)
        if tier is not None:  # bytes moved on the disk in this step (the writes behind it may still run)
            r, w = tier.bytes_read, tier.bytes_written
            self.res.extra.setdefault("disk_steps", []).append(
                {"read": r - self._disk0[0], "written": w - self._disk0[1]}
            )
            self._disk0 = (r, w)
        if hasattr(self.engine, "trace"):  # the last step, interval by interval (engine.trace())
            self.res.extra["trace"] = self.engine.trace()
        return loss


def main() -> int:
    parser = common.engine_args(__doc__)
    parser.add_argument(
        "--clip",
        type=float,
        default=0.0,
        help="gradient_clipping (global norm); > 0 makes CPU updates wait for the norm",
    )
    parser.add_argument("--precision", default=None, choices=["bf16", "fp16", "fp32"])
    parser.add_argument(
        "--offload",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="an offload setting of zerofit's config, e.g. assisted_fraction=0.4 (repeatable)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help='a top-level setting of zerofit\'s config, e.g. max_host_memory="32GiB" (repeatable)',
    )
    parser.add_argument("--nvme", default=None, help="offload.optimizer_device nvme with this nvme_path")
    parser.add_argument("--estimate", action="store_true", help="record zerofit estimate's prediction first")
    parser.add_argument(
        "--loader",
        action="store_true",
        help="with --api deepspeed: draw each step's micro-batches from engine.deepspeed_io's loader",
    )
    parser.add_argument(
        "--announce",
        action="store_true",
        help="with --api deepspeed: announce each window's micro-batches with engine.forward_window",
    )
    parser.add_argument(
        "--api",
        default="train_batch",
        choices=["train_batch", "deepspeed"],
        help="train_batch, or DeepSpeed-shaped engine(**b); backward(loss); step() per micro-batch",
    )
    args = parser.parse_args()
    code = common.run_engine("zerofit", args, Zerofit, Zerofit.step, uses_cap=False, version_modules=("zerofit",))
    for engine in _LIVE:  # the disk tier's swap file is removed (exit_now skips every finalizer)
        engine.release()
    return code


if __name__ == "__main__":
    common.exit_now(main())
