"""The ``zerofit`` command: a thin layer over the Python API.

    zerofit train                 # train the embedded demo model (see zerofit.demo)
    zerofit config show ds.json   # the resolved configuration, or the error
    zerofit doctor --disk /nvme   # this machine's limits, before choosing an offload plan
    zerofit export CKPT OUT       # a checkpoint's weights as a Hugging Face model directory
    zerofit estimate --shape llama-2-13b --max-gpu-memory 24GiB --nvme /nvme   # the plan, before launch
    zerofit generate --model DIR --prompt "Hello" --max-gpu-memory 24GiB       # offloaded generation
    zerofit chat --model runs/x/export                                          # chat in the terminal
    zerofit serve --model runs/x/export --max-gpu-memory 24GiB                  # OpenAI's API over HTTP
    zerofit deepspeed train.py --deepspeed_config ds.json                       # a DeepSpeed script, unchanged

Each ``train`` option maps onto one config field (or describes the run); the
logic lives in :mod:`zerofit.demo`, :mod:`zerofit.cli.doctor` and :mod:`zerofit.config`.
Exit codes: 0 done, 1 the run failed (or its folder is in use, its checkpoints refused), 2 bad configuration,
option or path, 130 / 143 a run stopped by Ctrl-C / SIGTERM (docs/cli.md); every error is one line ([Note: one
line per error], zerofit.cli.errors), its traceback only with ``--debug`` or ZEROFIT_DEBUG=1.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text
from typer.core import TyperGroup
from typer.exceptions import TyperException

from zerofit.cli import errors as cli_errors
from zerofit.cli import infer, serve, train
from zerofit.cli.common import EXIT_BAD_CONFIG, fail, fail_on


class _Commands(TyperGroup):
    """The command group: an error a command did not handle is one line and an exit status ([Note: one line per
    error]), not a traceback."""

    def invoke(self, ctx: typer.Context):
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, TyperException):  # exits, and usage errors typer prints itself
            raise
        except Exception as e:  # noqa: BLE001 - each is described, see cli_errors
            if cli_errors.debug_requested():
                raise
            fail_on(e)


app = typer.Typer(
    name="zerofit",
    no_args_is_help=True,
    add_completion=False,
    cls=_Commands,
    help="Train language models whose training state is larger than GPU memory.",
)
config_app = typer.Typer(no_args_is_help=True, help="Read and check configurations.")
app.add_typer(config_app, name="config")


@app.callback()
def _root(
    ctx: typer.Context,
    debug: Annotated[
        bool, typer.Option("--debug", help="Show an error's full traceback (also ZEROFIT_DEBUG=1).")
    ] = False,
) -> None:
    cli_errors.debug_flag(debug)


@app.command()
def estimate(
    model: Annotated[
        Path | None,
        typer.Option(help="Hugging Face model directory (only config.json is read: a 4-bit folder's form too)."),
    ] = None,
    shape: Annotated[
        str | None,
        typer.Option(
            help=(
                "A named shape instead of --model: llama-3.2-3b, llama-2-7b, llama-3.1-8b, llama-2-13b, llama-3-70b, "
                "qwen3-8b, qwen3-32b, qwen2.5-72b (or 3b, 7b, 13b, 70b)."
            )
        ),
    ] = None,
    config: Annotated[Path | None, typer.Option(help="DeepSpeed or zerofit JSON config.")] = None,
    max_gpu_memory: Annotated[str | None, typer.Option(help="GPU memory budget, e.g. 24GiB.")] = None,
    max_host_memory: Annotated[str | None, typer.Option(help="Host memory budget, e.g. 64GiB.")] = None,
    nvme: Annotated[
        Path | None,
        typer.Option(
            help="Folder for the disk tier (offload.optimizer_device and param_device nvme, offload.nvme_path)."
        ),
    ] = None,
    micro_batch_size: Annotated[int | None, typer.Option(min=1, help="Sequences per micro-batch.")] = None,
    grad_accum: Annotated[int | None, typer.Option(min=1, help="Micro-batches per step.")] = None,
    seq_len: Annotated[
        int | None, typer.Option(min=8, help="Tokens per sequence (default: the model's, <= 2048).")
    ] = None,
    cpu: Annotated[bool, typer.Option("--cpu", help="Plan for training on the CPU instead of a GPU.")] = False,
    gpus: Annotated[
        int,
        typer.Option(
            min=1, help="Ranks on one host, one GPU each: GPU bytes per GPU, host bytes for the host (docs/ranks.md)."
        ),
    ] = 1,
    nnodes: Annotated[
        int,
        typer.Option(
            min=1,
            help="Hosts, each with --gpus ranks: both layouts across them (hybrid, full), their host bytes per node, "
            "the bytes that cross the nodes per step, and which is faster (docs/ranks.md).",
        ),
    ] = 1,
    inter_node_gbps: Annotated[
        float | None,
        typer.Option(min=0.0, help="The bandwidth between the hosts, GB/s (with --nnodes): the time of those bytes."),
    ] = None,
    measure: Annotated[bool, typer.Option(help="Measure this machine's speeds to predict the step time.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the estimate as JSON.")] = False,
    lora: Annotated[
        bool, typer.Option("--lora", help="Plan LoRA (r 16, alpha 32, all linears) over a frozen base.")
    ] = False,
    qlora: Annotated[bool, typer.Option("--qlora", help="Plan QLoRA: --lora with the base's linears in NF4.")] = False,
    serve: Annotated[
        bool,
        typer.Option("--serve", help="Plan zerofit serve: the KV cache of --concurrency x --context, blocks streamed."),
    ] = False,
    concurrency: Annotated[int, typer.Option(min=1, help="With --serve: requests decoded together (--max-batch).")] = 8,
    context: Annotated[
        int | None, typer.Option(min=2, help="With --serve: tokens per request (default: the model's, <= 4096).")
    ] = None,
    grpo: Annotated[
        bool,
        typer.Option(
            "--grpo",
            help="Plan a GRPO run (TRL's GRPOTrainer on zerofit): generation, scoring, training (docs/rl.md).",
        ),
    ] = False,
    prompt_len: Annotated[int, typer.Option(min=1, help="With --grpo: tokens per prompt.")] = 256,
    completion_len: Annotated[int, typer.Option(min=1, help="With --grpo: max_completion_length.")] = 1024,
    generations: Annotated[int, typer.Option(min=1, help="With --grpo: num_generations per prompt.")] = 8,
    prompts: Annotated[int, typer.Option(min=1, help="With --grpo: prompts per optimizer step.")] = 1,
    beta: Annotated[float, typer.Option(min=0.0, help="With --grpo: the KL weight (> 0 scores a reference).")] = 0.0,
    iterations: Annotated[
        int, typer.Option(min=1, help="With --grpo: num_iterations (> 1 scores the old policy).")
    ] = 1,
) -> None:
    """The plan zerofit would choose, the GPU, host and disk bytes it needs and the predicted step time,
    without allocating the model. When nothing fits: what would, with the numbers (exit 2)."""
    from zerofit.config import ConfigError, load_config
    from zerofit.estimate import estimate as run_estimate
    from zerofit.models import WeightFileError

    console = Console()
    if (model is None) == (shape is None):
        fail(console, "give --model DIR or --shape NAME (one of them)")
    if serve:
        from zerofit.estimate.serve import estimate_serve

        info, text = estimate_serve(
            model, shape, max_gpu_memory=max_gpu_memory, concurrency=concurrency, context=context, gpu=not cpu
        )
        print(json.dumps(info, indent=2)) if as_json else console.print(Text(text), soft_wrap=True)
        if not info["fits"]:
            raise typer.Exit(EXIT_BAD_CONFIG)
        return
    overrides: dict = {}
    for key, value in (
        ("max_gpu_memory", max_gpu_memory),
        ("max_host_memory", max_host_memory),
        ("micro_batch_size", micro_batch_size),
        ("gradient_accumulation_steps", grad_accum),
        ("seq_len", seq_len),
    ):
        if value is not None:
            overrides[key] = value
    try:
        base = load_config(str(config) if config else {}, world_size=gpus if gpus > 1 else None).config.model_dump(
            mode="json"
        )
        if nvme is not None:
            base["offload"] = {
                **base.get("offload", {}),
                "optimizer_device": "nvme",
                "param_device": "nvme",
                "nvme_path": str(nvme),
            }
        if cpu:
            base["device"] = "cpu"
        if "micro_batch_size" in overrides or "gradient_accumulation_steps" in overrides:
            base.pop("train_batch_size", None)
        from zerofit.estimate import meta_model

        meta = model if model is not None else meta_model(shape=shape)  # a folder: its config.json alone
        if qlora:
            base["quantize_base"] = "nf4"
        if grpo:
            from zerofit.estimate.grpo import estimate_grpo

            for key in ("max_gpu_memory", "max_host_memory"):
                if key in overrides:
                    base[key] = overrides[key]
            est = estimate_grpo(
                meta,
                base,
                prompt_len=prompt_len,
                completion_len=completion_len,
                generations=generations,
                prompts=prompts,
                micro_batch_size=micro_batch_size,
                beta=beta,
                num_iterations=iterations,
                lora=lora or qlora or None,
                measure=measure,
                gpu=not cpu,
            )
        else:
            est = run_estimate(  # type: ignore[assignment]
                meta,
                base,
                measure=measure,
                gpu=not cpu,
                lora=lora or qlora or None,
                nnodes=nnodes,
                inter_node_gb_per_s=inter_node_gbps,
                **overrides,
            )
    except (ConfigError, WeightFileError, ValueError) as e:
        fail(console, f"{type(e).__name__}: {e}")
    if as_json:
        print(json.dumps(est.to_dict(), indent=2))
    else:
        console.print(Text(est.render()), soft_wrap=True)
    if est.refusal is not None:
        raise typer.Exit(EXIT_BAD_CONFIG)


app.command()(train.train)


@config_app.command("show")
def config_show(
    file: Annotated[Path, typer.Argument(help="DeepSpeed or zerofit JSON config.")],
) -> None:
    """Print the resolved configuration (and how each DeepSpeed key was read), or the error."""
    from zerofit.config import ConfigError, load_config, render_config

    try:
        loaded = load_config(file)
    except ConfigError as e:
        fail(Console(stderr=True), f"{file}: {e}")
    typer.echo(render_config(loaded))


@config_app.command("keys")
def config_keys(
    markdown: Annotated[bool, typer.Option("--markdown", help="Print a Markdown table.")] = False,
) -> None:
    """List every DeepSpeed key zerofit knows and how it reads it (honoured, mapped, not-applicable)."""
    from zerofit.config.deepspeed_keys import key_table

    rows = key_table()
    if markdown:
        typer.echo("| key | status | how zerofit reads it |\n| --- | --- | --- |")
        for path, status, note in rows:
            typer.echo(f"| `{path}` | {status} | {note.replace('|', '/')} |")
        return
    width = max(len(p) for p, _, _ in rows)
    for path, status, note in rows:
        typer.echo(f"{path:<{width}}  {status:<14}  {note}".rstrip())


@app.command()
def doctor(
    disk: Annotated[Path, typer.Option(help="Folder whose disk to measure (the would-be NVMe tier).")] = Path("."),
    as_json: Annotated[bool, typer.Option("--json", help="Print the measurements as JSON.")] = False,
    inter_node: Annotated[
        bool,
        typer.Option(
            "--inter-node",
            help="Only the bandwidth between the nodes, launched on each node like training (torchrun "
            "--nnodes N --node-rank i ... -m zerofit.cli doctor --inter-node, or srun): rank 0 "
            "prints it.",
        ),
    ] = False,
) -> None:
    """Measure GPU, host<->GPU bandwidth, CPU AdamW speed, RAM and disk (under 30 s)."""
    from zerofit.cli.doctor import run_doctor

    if inter_node:
        from zerofit.cli.doctor import inter_node_bandwidth, inter_node_text

        try:
            r = inter_node_bandwidth()
        except ValueError as e:
            fail(Console(stderr=True), str(e))
        if int(os.environ.get("RANK", "0")) == 0:
            typer.echo(json.dumps(r, indent=2) if as_json else inter_node_text(r))
        return
    if not disk.is_dir():
        fail(Console(stderr=True), f"--disk {disk}: not a folder")
    report = run_doctor(disk)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
        return
    from zerofit.cli.doctor import render

    render(report, Console())


@app.command("export")
def export(
    checkpoint: Annotated[
        Path, typer.Argument(help="A checkpoint folder (save_dir/<tag>) or a save folder (its 'latest' is used).")
    ],
    out_dir: Annotated[Path, typer.Argument(help="Folder for the Hugging Face model (created).")],
    dtype: Annotated[
        str | None, typer.Option(help="Weights dtype: bf16, fp16 or fp32 (default: the trained model's own dtype).")
    ] = None,
    max_shard_size: Annotated[str, typer.Option(help="Largest shard, e.g. 5GB or 2GiB.")] = "5GB",
    merge: Annotated[
        bool,
        typer.Option(
            "--merge",
            help="A LoRA run's checkpoint: merge the adapter into its base "
            "and write a Hugging Face model (default: the adapter).",
        ),
    ] = False,
    base: Annotated[
        Path | None,
        typer.Option(help="With --merge: the base model directory (default: the one the checkpoint was trained over)."),
    ] = None,
) -> None:
    """Write a checkpoint's weights as a Hugging Face model (config.json, sharded safetensors, tokenizer); a LoRA
    run's checkpoint as PEFT's adapter folder, or merged (--merge)."""
    from zerofit.checkpoint import CheckpointError, export_checkpoint

    said: list[str] = []
    try:
        out = export_checkpoint(checkpoint, out_dir, dtype, max_shard_size, merge=merge, base=base, said=said)
    except (CheckpointError, ValueError) as e:
        fail(Console(stderr=True), f"export failed: {e}")
    for line in said:
        typer.echo(line)
    if (out / "adapter_config.json").is_file():
        typer.echo(f"exported {checkpoint} -> {out} (a PEFT adapter: PeftModel.from_pretrained(base, {out}))")
        return
    written = json.loads((out / "config.json").read_text())["dtype"]
    how = "as asked" if dtype else "the model's own dtype; --dtype to change it"
    typer.echo(f"exported {checkpoint} -> {out} ({written}: {how})")


@app.command(
    "deepspeed", add_help_option=False, context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
def deepspeed_launch(ctx: typer.Context) -> None:
    """Run a DeepSpeed training script unchanged, in one process, its `import deepspeed` zerofit's:
    `zerofit deepspeed train.py --deepspeed_config ds.json` (DeepSpeed's launcher options; --help)."""
    from zerofit.deepspeed.launcher import main as launch
    from zerofit.engine.faces.deepspeed_names import DeepSpeedUnsupported

    # the command line itself where it is this command's (click drops a `--` the script may want)
    argv = sys.argv[2:] if sys.argv[1:2] == ["deepspeed"] else list(ctx.args)
    try:
        code = launch(argv)
    except (DeepSpeedUnsupported, FileNotFoundError, ValueError) as e:  # the launch itself; not the script's
        fail(Console(stderr=True), str(e))
    raise typer.Exit(code)


app.command()(infer.generate)
app.command()(infer.chat)
app.command()(serve.serve)


def main() -> None:
    # DeepSpeed, when installed, is imported by transformers and warns on a machine without a GPU that it chose
    # the CPU: zerofit's commands use its config format, not its accelerator; on a GPU machine it finds CUDA
    # itself, and a DS_ACCELERATOR the user set is kept
    if "DS_ACCELERATOR" not in os.environ and not _has_cuda():
        os.environ["DS_ACCELERATOR"] = "cpu"
    app()


def _has_cuda() -> bool:
    """Whether a CUDA device is visible, without importing torch (``zerofit --help`` stays fast): the driver's
    device files."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version")


if __name__ == "__main__":
    main()
