"""``zerofit serve``: an OpenAI-compatible HTTP server over offloaded generation (docs/serve.md).

    zerofit serve --model runs/x/export --max-gpu-memory 24GiB                       # http://127.0.0.1:8000/v1
    zerofit serve --model BASE --adapter runs/a/adapter --adapter support=runs/b/adapter --max-batch 16
    zerofit serve --model BASE --host 0.0.0.0 --api-key "$KEY"                       # beyond loopback: a key

The server's own packages (FastAPI, uvicorn) are the ``serve`` extra: without them the command says so in one line.
SIGTERM or Ctrl-C stops it: the requests in flight finish first (uvicorn's graceful shutdown), then it exits 0.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

from zerofit.cli.common import fail
from zerofit.cli.infer import DEVICE_OPT, DTYPE_OPT, GEN_MODEL_OPT, GPU_OPT, HOST_OPT, NVME_OPT

SERVE_PACKAGES = ("fastapi", "uvicorn", "starlette")
DEFAULT_CONTEXT = 4096  # tokens per request when the model's own context is longer (or unknown)


def serve(
    model: Annotated[Path, GEN_MODEL_OPT],
    adapter: Annotated[
        list[str] | None,
        typer.Option(
            help="A PEFT adapter folder over --model, served as its folder's name (repeat for several; "
            "NAME=DIR names it). A request's 'model' picks the base or an adapter."
        ),
    ] = None,
    served_model_name: Annotated[
        str | None, typer.Option(help="The base model's name in requests (default: --model's folder name).")
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on (beyond loopback, --api-key is required).")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on.")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(help="Clients must send 'Authorization: Bearer KEY' (also ZEROFIT_API_KEY).", show_default=False),
    ] = None,
    max_batch: Annotated[
        int, typer.Option(min=1, help="Requests decoded together at most: the KV cache's rows (the plan counts them).")
    ] = 8,
    context: Annotated[
        int | None,
        typer.Option(
            min=2,
            help=f"Tokens per request, prompt and answer (default: the model's context, at most {DEFAULT_CONTEXT}).",
        ),
    ] = None,
    max_waiting: Annotated[
        int, typer.Option(min=0, help="Requests queued beyond --max-batch before new ones are answered 503.")
    ] = 256,
    prefill_tokens: Annotated[
        int | None,
        typer.Option(min=1, help="Padded prompt tokens of one prefill forward at most (default: --context)."),
    ] = None,
    max_gpu_memory: Annotated[str | None, GPU_OPT] = None,
    max_host_memory: Annotated[str | None, HOST_OPT] = None,
    nvme: Annotated[Path | None, NVME_OPT] = None,
    dtype: Annotated[str | None, DTYPE_OPT] = None,
    device: Annotated[str | None, DEVICE_OPT] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn's log level: info logs every request.")] = "warning",
) -> None:
    """Serve a model (and LoRA adapters over it) through OpenAI's API: /v1/chat/completions, /v1/completions,
    /v1/models, streaming; requests in flight are batched step by step, each streamed block uploaded once per
    step for all of them."""
    err = Console(stderr=True)
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ModuleNotFoundError as e:
        if e.name not in SERVE_PACKAGES:
            raise
        fail(err, f"zerofit serve needs {e.name}, which is not installed: pip install 'zerofit[serve]'")
    api_key = api_key or os.environ.get("ZEROFIT_API_KEY") or None
    if not _loopback(host) and api_key is None:
        fail(err, f"--host {host} listens beyond this machine: give --api-key KEY (or ZEROFIT_API_KEY)")
    from zerofit.infer import InferencePlanError
    from zerofit.models.directory import positions
    from zerofit.serve.adapters import adapter_names

    if adapter:
        from zerofit.infer.seq2seq import encoder_decoder_config

        config = encoder_decoder_config(model)
        if config is not None:
            arch = ", ".join(getattr(config, "architectures", None) or [config.model_type])
            fail(
                err, f"--adapter: adapters are served over a decoder-only base; {model} is an encoder-decoder ({arch})"
            )
    try:
        adapters = adapter_names(list(adapter or []))
    except ValueError as e:
        fail(err, str(e))
    name = served_model_name or Path(model).resolve().name
    if name in adapters:
        fail(err, f"the adapter name {name!r} is the base model's: give --served-model-name or --adapter NAME=DIR")
    t0 = time.perf_counter()
    engine = _load(err, model, adapters, max_gpu_memory, dtype, device, max_host_memory, nvme)
    if engine.tokenizer is None:
        engine.close()
        fail(err, f"{model}: no tokenizer files beside the model: the server reads and writes text")
    own, _ = positions(engine.model.config)
    ctx = context or min(own or DEFAULT_CONTEXT, DEFAULT_CONTEXT)
    if own is not None and ctx > own:
        engine.close()
        fail(err, f"--context {ctx} is longer than the model's {own} positions: give --context {own} or less")
    from zerofit.serve.app import Served, create_app
    from zerofit.serve.scheduler import Scheduler
    from zerofit.serve.seq2seq import Seq2SeqScheduler

    try:
        if getattr(engine, "is_encoder_decoder", False):  # [Note: an encoder-decoder's requests, a batch at a time]
            sched: Scheduler = Seq2SeqScheduler(
                engine, slots=max_batch, context=ctx, prefill_tokens=prefill_tokens, max_waiting=max_waiting
            )
        else:
            sched = Scheduler(
                engine,
                slots=max_batch,
                context=ctx,
                prefill_tokens=prefill_tokens,
                max_waiting=max_waiting,
                adapters=tuple(adapters),
            )
    except InferencePlanError as e:
        engine.close()
        fail(err, f"refused before serving: {e} (fewer --max-batch or a shorter --context fit in less)")
    served = Served(sched, name, tuple(adapters), api_key)
    names = ", ".join([name, *adapters])
    err.print(
        Text(
            f"loaded in {time.perf_counter() - t0:.1f} s; serving {names} on http://{host}:{port}/v1; "
            f"{max_batch} requests x {ctx} tokens at once; {engine.summary()}",
            style="dim",
        ),
        soft_wrap=True,
    )
    config = uvicorn.Config(create_app(served), host=host, port=port, log_level=log_level, lifespan="off")
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it has drained; the server's stop is its normal end (exit
    # 0), so the signal meets a handler that does nothing
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        sched.close()
        engine.close()
    if not server.started:
        fail(err, f"could not listen on {host}:{port} (uvicorn's message above)")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _load(err: Console, model: Path, adapters: dict, max_gpu_memory, dtype, device, max_host_memory, nvme):
    """The engine over the base, with every adapter beside it (zerofit/serve/adapters.py)."""
    from zerofit.cli.infer import inference_engine

    if not adapters:
        return inference_engine(err, model, max_gpu_memory, dtype, device, max_host_memory, nvme)
    from zerofit.infer.engine import InferenceEngine
    from zerofit.lora import LoraError
    from zerofit.models import WeightFileError
    from zerofit.serve.adapters import MultiAdapterSource

    try:
        return InferenceEngine.from_source(
            MultiAdapterSource(model, adapters),
            dtype=dtype,
            max_gpu_memory=max_gpu_memory,
            device=device,
            max_host_memory=max_host_memory,
            nvme_path=nvme,
        )
    except (WeightFileError, LoraError, ValueError, OSError) as e:
        fail(err, f"cannot load {model} with its adapters: {e}")
