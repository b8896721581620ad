"""The requests the server reads (OpenAI's chat and completions bodies) and the errors it answers, in OpenAI's shape:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": "..."}}

Fields OpenAI defines that change nothing here (``user``, ``logit_bias`` empty, penalties at 0...) are accepted
and ignored, as OpenAI-compatible servers do; those that would change the answer and are not supported
(``logprobs``, ``echo``, ``best_of`` > n, tools) are refused with a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from zerofit.errors import ZerofitError

MAX_N = 16  # choices per request
MAX_STOP = 4  # stop strings per request (OpenAI's limit)


class APIError(ZerofitError):
    """An answer other than 200, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    logprobs: Any = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        return stops

    def stops(self) -> tuple[str, ...]:
        return tuple(s for s in (self.stop or []) if s)

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def refuse_unsupported(self, extra: tuple[str, ...] = ()) -> None:
        """A 400 for an option that would change the answer and is not supported."""
        if self.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs are not supported by this server", param="logprobs")
        for name in ("tools", "functions", "response_format", *extra):
            value = (self.model_extra or {}).get(name)
            if value not in (None, False, [], {}) and not (name == "response_format" and value == {"type": "text"}):
                raise APIError(400, f"{name} is not supported by this server", param=name)
        for name in ("presence_penalty", "frequency_penalty"):
            value = (self.model_extra or {}).get(name)
            if value not in (None, 0, 0.0):
                raise APIError(400, f"{name} is not supported by this server (give 0 or leave it out)", param=name)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The content as text (a list of parts: their ``text`` parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, "only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False

    def limit(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """One or several prompts: texts or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat's is the rest of the context


def validation_error(errors: list[dict]) -> APIError:
    """FastAPI's validation errors as one OpenAI 400: the first error's field and message."""
    if not errors:
        return APIError(400, "the request body is not valid")
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if e.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {e.get('msg', '')}", code="invalid_json")
    msg = e.get("msg", "invalid value")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)
