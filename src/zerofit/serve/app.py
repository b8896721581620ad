"""The HTTP face of ``zerofit serve``: OpenAI's ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``
(FastAPI on uvicorn), over the continuous batcher (scheduler.py).

    app = create_app(Served(engine, scheduler, "llama-8b", adapters=("support",)))
    uvicorn.run(app, host="127.0.0.1", port=8000)

[Note: requests on the event loop, tokens on the scheduler's thread]
The handlers never run the model: they read the request, turn it into
sequences and submit them; the scheduler's thread calls each sequence's
``emit``, which hands the event to the handler's loop (``call_soon_threadsafe``
into an ``asyncio.Queue``). A handler that stops listening (its client left, a
stream cancelled) cancels its sequences, whose slots are free at the next step.
Every error a request can cause is answered in OpenAI's shape
(schema.APIError); the loop and the scheduler go on serving the others.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from zerofit.serve.scheduler import Busy, Delta, Done, Failed, Sampling, Scheduler, Sequence
from zerofit.serve.schema import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    APIError,
    ChatRequest,
    CompletionRequest,
    validation_error,
)

POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


@dataclass
class Served:
    """What one server serves: the scheduler over the engine, the base's name and the adapters' names (the
    ``model`` field of a request picks one), and the API key (None: none asked)."""

    scheduler: Scheduler
    name: str
    adapters: tuple[str, ...] = ()
    api_key: str | None = None
    created: int = 0

    @property
    def tokenizer(self):
        return self.scheduler.tok

    @property
    def context(self) -> int:
        return self.scheduler.context

    def adapter_for(self, model: str) -> str | None:
        """The adapter ``model`` names (None: the base); 404 for a name not served."""
        if model == self.name:
            return None
        if model in self.adapters:
            return model
        served = ", ".join([self.name, *self.adapters])
        raise APIError(
            404, f"the model {model!r} does not exist here; served: {served}", param="model", code="model_not_found"
        )


def create_app(served: Served) -> FastAPI:
    app = FastAPI(title="zerofit serve", docs_url=None, redoc_url=None, openapi_url=None)
    served.created = served.created or int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        err = validation_error(list(e.errors()))
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        body = APIError(e.status_code, str(e.detail), type=kind).body()
        return JSONResponse(body, status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception):
        body = APIError(500, f"{type(e).__name__}: {e}", type="server_error").body()
        return JSONResponse(body, status_code=500)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if served.api_key is not None and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), served.api_key):
                err = APIError(
                    401,
                    "a valid API key is needed: Authorization: Bearer <key>",
                    type="authentication_error",
                    code="invalid_api_key",
                )
                return JSONResponse(err.body(), status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok", **served.scheduler.stats()}

    @app.get("/v1/models")
    async def models():
        def card(name: str, parent: str | None) -> dict:
            return {
                "id": name,
                "object": "model",
                "created": served.created,
                "owned_by": "zerofit",
                "root": name,
                "parent": parent,
                "max_model_len": served.context,
            }

        data = [card(served.name, None)] + [card(a, served.name) for a in served.adapters]
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        body.refuse_unsupported(("tool_choice",))
        adapter = served.adapter_for(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = _chat_ids(served.tokenizer, messages)
        return await _answer(served, request, body, adapter, [ids], chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        body.refuse_unsupported(("suffix",))
        if body.echo:
            raise APIError(400, "echo is not supported by this server", param="echo")
        adapter = served.adapter_for(body.model)
        tok = served.tokenizer
        prompts = [p if isinstance(p, list) else list(tok(p)["input_ids"]) for p in body.prompts()]
        return await _answer(served, request, body, adapter, prompts, chat=False)

    return app


def _chat_ids(tok, messages: list[dict]) -> list[int]:
    from zerofit.infer.text import prompt_ids

    try:
        return prompt_ids(tok, messages, chat=True)
    except Exception as e:  # noqa: BLE001 - the template refused these messages (a role it does not know...)
        raise APIError(400, f"the chat template refused the messages: {e}", param="messages") from None


def _budget(served: Served, body, prompts: list[list[int]], chat: bool) -> int:
    """max_tokens for these prompts: as asked when prompt + answer fit the context (else 400; a prompt that
    leaves no room at all: 413); unset: the rest of the context for chat, OpenAI's 16 for completions."""
    ctx = served.context
    longest = max(len(p) for p in prompts)
    if min(len(p) for p in prompts) == 0:
        raise APIError(400, "a prompt encodes to no tokens", param="prompt")
    if longest >= ctx:
        raise APIError(
            413,
            f"the prompt is {longest} tokens: this server's context is {ctx} tokens (the prompt "
            "and at least one new token)",
            param="messages" if chat else "prompt",
            code="context_length_exceeded",
        )
    asked = body.limit()
    if asked is None:
        return ctx - longest if chat else min(COMPLETION_DEFAULT_MAX_TOKENS, ctx - longest)
    if longest + asked > ctx:
        raise APIError(
            400,
            f"this server's context is {ctx} tokens: the prompt is {longest} tokens and max_tokens "
            f"{asked} asks for {longest + asked}; give max_tokens {ctx - longest} or less",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return asked


async def _answer(served: Served, request: Request, body, adapter, prompts: list[list[int]], chat: bool):
    max_tokens = _budget(served, body, prompts, chat)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    seqs: list[Sequence] = []
    for p in prompts:
        for k in range(body.n):
            index = len(seqs)
            sampling = Sampling(
                max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                seed=None if body.seed is None else body.seed + k,
                stop=body.stops(),
            )

            def emit(ev, index=index):
                loop.call_soon_threadsafe(events.put_nowait, (index, ev))

            seqs.append(Sequence(list(p), sampling, emit, adapter=adapter))
    sched = served.scheduler
    try:
        for seq in seqs:
            sched.submit(seq)
    except (Busy, RuntimeError) as e:
        for seq in seqs:
            sched.cancel(seq)
        raise APIError(503, f"the server is busy, try again: {e}", type="server_error", code="overloaded") from None
    rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    if body.stream:
        stream = _stream(served, request, body, seqs, events, rid, chat)
        return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await _whole(served, request, body, seqs, events, rid, chat)


async def _whole(served, request, body, seqs, events, rid, chat) -> JSONResponse:
    done: dict[int, Done] = {}
    try:
        while len(done) < len(seqs):
            try:
                index, ev = await asyncio.wait_for(events.get(), POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise asyncio.CancelledError from None
                continue
            if isinstance(ev, Done):
                done[index] = ev
            elif isinstance(ev, Failed):
                raise APIError(500, ev.message, type="server_error")
    finally:
        for seq in seqs:
            if seq.finish is None:
                served.scheduler.cancel(seq)
    choices = []
    for i, seq in enumerate(seqs):
        c = {"index": i, "finish_reason": done[i].finish, "logprobs": None}
        if chat:  # the whole text decoded at once (the pieces streamed are the same text, in order)
            c["message"] = {"role": "assistant", "content": seq.text}
        else:
            c["text"] = seq.text
        choices.append(c)
    return JSONResponse(
        {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.model,
            "choices": choices,
            "usage": _usage(seqs, done, body.n),
            "system_fingerprint": None,
        }
    )


def _usage(seqs: list[Sequence], done: dict[int, Done], n: int) -> dict:
    prompt = sum(len(s.prompt) for s in seqs[::n])  # a prompt sampled n times counts once, as OpenAI counts it
    completion = sum(d.completion_tokens for d in done.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _stream(served, request, body, seqs, events, rid, chat) -> AsyncIterator[str]:
    """Server-sent events: OpenAI's chunks, then ``data: [DONE]``. A client that leaves cancels this generator
    (Starlette), and its sequences with it."""
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        out = {
            "id": rid,
            "object": kind,
            "created": created,
            "model": body.model,
            "choices": choices,
            "system_fingerprint": None,
        }
        if usage is not None:
            out["usage"] = usage
        return f"data: {json.dumps(out)}\n\n"

    def piece(i: int, text: str | None, finish: str | None) -> dict:
        if chat:
            delta = {} if text is None else {"content": text}
            return {"index": i, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {"index": i, "text": text or "", "finish_reason": finish, "logprobs": None}

    done: dict[int, Done] = {}
    try:
        if chat:
            yield chunk(
                [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}
                    for i in range(len(seqs))
                ]
            )
        while len(done) < len(seqs):
            index, ev = await events.get()
            if isinstance(ev, Delta):
                yield chunk([piece(index, ev.text, None)])
            elif isinstance(ev, Done):
                done[index] = ev
                yield chunk([piece(index, None, ev.finish)])
            elif isinstance(ev, Failed):
                yield f"data: {json.dumps(APIError(500, ev.message, type='server_error').body())}\n\n"
                break
        if body.include_usage() and len(done) == len(seqs):
            yield chunk([], _usage(seqs, done, body.n))
        yield "data: [DONE]\n\n"
    finally:
        for seq in seqs:
            if seq.finish is None:
                served.scheduler.cancel(seq)
