"""``zerofit generate`` and ``zerofit chat``: offloaded generation from a model folder or a checkpoint."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

from zerofit.cli.common import (
    EXIT_INTERRUPTED,
    fail,
)

GEN_MODEL_OPT = typer.Option(
    help="A Hugging Face model directory or a zerofit checkpoint (a tag folder, or a save "
    "folder whose 'latest' is used)."
)


def _sampling_options(temperature, top_k, top_p, repetition_penalty, stop, seed, greedy) -> dict:
    return {
        "do_sample": False if greedy else None,
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "repetition_penalty": repetition_penalty,
        "stop": stop or None,
        "seed": seed,
    }


def inference_engine(
    console: Console, model: Path, max_gpu_memory, dtype, device, max_host_memory=None, nvme=None, adapter=None
):
    """The generation engine for ``model``: the offloaded inference engine, or for an encoder-decoder's folder the
    hooked mode's (zerofit/infer/seq2seq.py: the choice is made there, by the folder's config)."""
    from zerofit.engine.disk.tier import DiskTierError
    from zerofit.engine.plan.search import PlanError
    from zerofit.infer.seq2seq import open_engine
    from zerofit.models import WeightFileError

    try:
        return open_engine(
            model,
            adapter=adapter,
            max_gpu_memory=max_gpu_memory,
            dtype=dtype,
            device=device,
            max_host_memory=max_host_memory,
            nvme_path=nvme,
        )
    except (WeightFileError, ValueError, OSError, DiskTierError, PlanError) as e:
        fail(console, f"cannot load {model}: {e}")


GPU_OPT = typer.Option(help="GPU memory budget, e.g. 24GiB: the blocks that do not fit stream through the GPU.")
DTYPE_OPT = typer.Option(
    help="Weights and KV cache dtype: bf16, fp16 or fp32 (default: the model's own, config.json's dtype, as "
    "transformers loads it)."
)
DEVICE_OPT = typer.Option(help="cuda, cuda:1 or cpu (default: the GPU if there is one).")
HOST_OPT = typer.Option(help="Host memory budget for the blocks' 16-bit weights, e.g. 16GiB: the rest go to --nvme.")
NVME_OPT = typer.Option(
    help="Folder for the blocks that do not fit --max-host-memory (a swap file, removed at the end)."
)


def generate(
    model: Annotated[Path, GEN_MODEL_OPT],
    prompt: Annotated[list[str] | None, typer.Option(help="A prompt (repeat for several).")] = None,
    prompts: Annotated[
        Path | None,
        typer.Option(help="JSON-lines file: each line a string or an object with prompt, text or messages (a chat)."),
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate per prompt.")] = 128,
    batch_size: Annotated[int, typer.Option(min=1, help="Prompts decoded together.")] = 8,
    max_gpu_memory: Annotated[str | None, GPU_OPT] = None,
    max_host_memory: Annotated[str | None, HOST_OPT] = None,
    nvme: Annotated[Path | None, NVME_OPT] = None,
    dtype: Annotated[str | None, DTYPE_OPT] = None,
    device: Annotated[str | None, DEVICE_OPT] = None,
    chat: Annotated[
        bool, typer.Option("--chat", help="Wrap each text prompt as a user message in the model's chat template.")
    ] = False,
    system: Annotated[str | None, typer.Option(help="System message for chat prompts.")] = None,
    greedy: Annotated[
        bool, typer.Option("--greedy", help="Greedy decoding even if the model's generation config samples.")
    ] = False,
    temperature: Annotated[float | None, typer.Option(help="Sampling temperature (sets sampling on).")] = None,
    top_k: Annotated[int | None, typer.Option(help="Sample from the k most likely tokens.")] = None,
    top_p: Annotated[float | None, typer.Option(help="Nucleus sampling threshold.")] = None,
    repetition_penalty: Annotated[float | None, typer.Option(help="Penalty > 1 for repeated tokens.")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop at this text (repeat for several).")] = None,
    seed: Annotated[int | None, typer.Option(help="Random seed (sampling is reproducible with it).")] = None,
    output: Annotated[
        Path | None, typer.Option(help="Write one JSON line per prompt (prompt, text, tokens, finish) to this file.")
    ] = None,
    adapter: Annotated[
        Path | None,
        typer.Option(
            help="A PEFT adapter folder (zerofit train --lora's OUTPUT/adapter) over --model, the base directory."
        ),
    ] = None,
) -> None:
    """Generate text with a model or checkpoint larger than the GPU: as many blocks as fit stay resident, the
    others stream from pinned host memory. One prompt streams its tokens to the terminal."""
    from zerofit.infer import InferencePlanError
    from zerofit.infer.text import complete, read_prompts

    err = Console(stderr=True)
    if (prompt is None) == (prompts is None):
        fail(err, "give --prompt TEXT (repeatable) or --prompts FILE.jsonl (one of them)")
    try:
        items = list(prompt) if prompt else read_prompts(prompts)
    except (OSError, ValueError) as e:
        fail(err, f"--prompts: {e}")
    engine = inference_engine(err, model, max_gpu_memory, dtype, device, max_host_memory, nvme, adapter)
    sampling = _sampling_options(temperature, top_k, top_p, repetition_penalty, stop, seed, greedy)
    one = len(items) == 1
    stream = (lambda piece: (sys.stdout.write(piece), sys.stdout.flush())) if one and output is None else None
    t0 = time.perf_counter()
    try:
        done = complete(
            engine,
            items,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            chat=chat,
            system=system,
            stream=stream,
            **sampling,
        )
    except InferencePlanError as e:
        engine.close()
        fail(err, f"refused before the first token: {e}")
    except ValueError as e:
        engine.close()
        fail(err, str(e))
    if stream is not None:
        sys.stdout.write("\n")
    elif output is None:
        for i, c in enumerate(done):
            typer.echo(f"--- {i}: {c.new_tokens} tokens ({c.finish})")
            typer.echo(c.text)
    if output is not None:
        with open(output, "w") as f:
            for item, c in zip(items, done):
                f.write(
                    json.dumps(
                        {
                            "prompt": item,
                            "text": c.text,
                            "prompt_tokens": c.prompt_tokens,
                            "new_tokens": c.new_tokens,
                            "finish": c.finish,
                        }
                    )
                    + "\n"
                )
    new = sum(c.new_tokens for c in done)
    wall = time.perf_counter() - t0
    err.print(
        Text(
            f"{len(done)} prompts, {new} new tokens in {wall:.2f} s ({new / max(wall, 1e-9):.1f} tokens/s); "
            f"{engine.summary()}",
            style="dim",
        ),
        soft_wrap=True,
    )
    engine.close()


def chat(
    model: Annotated[Path, GEN_MODEL_OPT],
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Most tokens per answer.")] = 512,
    max_gpu_memory: Annotated[str | None, typer.Option(help="GPU memory budget, e.g. 24GiB.")] = None,
    max_host_memory: Annotated[str | None, HOST_OPT] = None,
    nvme: Annotated[Path | None, NVME_OPT] = None,
    dtype: Annotated[str | None, DTYPE_OPT] = None,
    device: Annotated[str | None, typer.Option(help="cuda, cuda:1 or cpu.")] = None,
    system: Annotated[str | None, typer.Option(help="System message.")] = None,
    temperature: Annotated[float | None, typer.Option(help="Sampling temperature (default: greedy).")] = None,
    top_p: Annotated[float | None, typer.Option(help="Nucleus sampling threshold.")] = None,
    seed: Annotated[int | None, typer.Option(help="Random seed.")] = None,
    adapter: Annotated[
        Path | None,
        typer.Option(
            help="A PEFT adapter folder (zerofit train --lora's OUTPUT/adapter) over --model, the base directory."
        ),
    ] = None,
) -> None:
    """Chat with a model or checkpoint in the terminal (its chat template; the conversation is kept).
    /help lists the commands; /reset starts over; /quit, /exit or Ctrl-D (end of input) ends it."""
    from zerofit.infer import InferencePlanError
    from zerofit.infer.chat import HINT, Chat, run_chat
    from zerofit.infer.text import complete, prompt_ids
    from zerofit.models.directory import positions

    err = Console(stderr=True)
    err.print(Text(f"loading {model} ...", style="dim"), soft_wrap=True)
    t0 = time.perf_counter()
    engine = inference_engine(err, model, max_gpu_memory, dtype, device, max_host_memory, nvme, adapter)
    if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
        engine.close()
        fail(err, f"{model}: its tokenizer has no chat template: use zerofit generate with plain prompts")
    err.print(Text(f"loaded in {time.perf_counter() - t0:.1f} s; {engine.summary()}", style="dim"), soft_wrap=True)
    err.print(Text(HINT), soft_wrap=True)
    sampling = _sampling_options(temperature, None, top_p, None, None, seed, temperature is None)
    context, _ = positions(engine.model.config)

    def prompt_length(messages: list[dict]) -> int:
        return len(prompt_ids(engine.tokenizer, messages, chat=True))

    def fits(messages: list[dict]) -> bool:  # the history with a whole answer within the model's context
        return context is None or prompt_length(messages) + max_new_tokens <= context

    def answer(messages: list[dict], stream) -> str | None:
        room = max_new_tokens if context is None else min(max_new_tokens, context - prompt_length(messages))
        if room < 1:
            return None
        try:
            (c,) = complete(engine, [messages], max_new_tokens=room, stream=stream, **sampling)
        except InferencePlanError as e:
            engine.close()
            fail(err, f"refused: {e}")
        return c.text

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        run_chat(Chat(system=system), answer, input, write, fits)
    except KeyboardInterrupt:  # Ctrl-C: the chat ends, the engine's memory is given back
        write("\n")
        engine.close()
        raise typer.Exit(EXIT_INTERRUPTED) from None
    engine.close()
