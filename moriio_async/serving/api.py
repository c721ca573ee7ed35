"""The OpenAI completions protocol as the proxy speaks it: the request, the answers, the errors.

Only greedy decoding of one prompt is served; a parameter that would change
the output (sampling, several choices, stop strings, logprobs, echo, ...) is
refused with a 400 naming it rather than ignored. Errors have OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import time
from typing import TypeAlias

import msgspec
from fastapi import Response
from pydantic import BaseModel, ConfigDict, ValidationError

from .messages import KvTransfer

__all__ = [
    "ApiError",
    "Choice",
    "Completion",
    "CompletionRequest",
    "ErrorAnswer",
    "ErrorDetail",
    "JsonObject",
    "JsonValue",
    "ModelCard",
    "Usage",
    "chunk",
    "completion",
    "error_response",
    "model_card",
    "parse_request",
]


JsonValue: TypeAlias = "bool | int | float | str | list[JsonValue] | dict[str, JsonValue] | None"
"""Any JSON value, as ``json.loads`` returns it: what a proxy forwards without reading it."""
JsonObject: TypeAlias = "dict[str, JsonValue]"
"""A JSON object: an OpenAI request body, with the fields no one here knows kept as they came."""


class ApiError(Exception):
    """An OpenAI-shaped error answer."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code

    def body(self) -> ErrorAnswer:
        return ErrorAnswer(ErrorDetail(str(self), self.type, self.param, self.code))


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorAnswer(msgspec.Struct):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


def error_response(exc: ApiError) -> Response:
    return Response(msgspec.json.encode(exc.body()), status_code=exc.status, media_type="application/json")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = None


class CompletionRequest(BaseModel):
    """``POST /v1/completions``; unknown fields are ignored, fields that change the output are checked."""

    model_config = ConfigDict(extra="ignore")
    model: str
    prompt: str | list[str]
    max_tokens: int | None = 16
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    best_of: int | None = None
    echo: bool | None = None
    stop: str | list[str] | None = None
    logprobs: int | None = None
    suffix: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None

    def text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ApiError(400, "exactly one prompt per request is supported", param="prompt")
        return self.prompt[0]

    def check_supported(self) -> None:
        unsupported = {
            "temperature": self.temperature not in (None, 0.0),
            "top_p": self.top_p not in (None, 1.0),
            "n": self.n not in (None, 1),
            "best_of": self.best_of not in (None, 1),
            "echo": bool(self.echo),
            "stop": bool(self.stop),
            "logprobs": self.logprobs is not None,
            "suffix": bool(self.suffix),
            "presence_penalty": self.presence_penalty not in (None, 0.0),
            "frequency_penalty": self.frequency_penalty not in (None, 0.0),
            "logit_bias": bool(self.logit_bias),
        }
        for param, bad in unsupported.items():
            if bad:
                raise ApiError(
                    400, f"{param}={getattr(self, param)!r} is not supported: this server decodes greedily", param=param
                )
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ApiError(400, f"max_tokens must be at least 1, not {self.max_tokens}", param="max_tokens")


def parse_request(body: bytes) -> CompletionRequest:
    """Validate a request body; malformed JSON and wrong types are 400s in OpenAI's shape."""
    try:
        req = CompletionRequest.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            raise ApiError(400, f"the request body is not valid JSON: {first['msg']}", code="invalid_json") from None
        where = ".".join(str(p) for p in first["loc"]) or None
        raise ApiError(400, f"{where or 'body'}: {first['msg']}", param=where) from None
    req.check_supported()
    return req


class ModelCard(msgspec.Struct, kw_only=True):
    """One entry of ``/v1/models``."""

    id: str
    object: str = "model"
    created: int
    owned_by: str = "moriio_async"
    max_model_len: int


class Choice(msgspec.Struct, kw_only=True):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt: int, completion: int) -> Usage:
        return cls(prompt, completion, prompt + completion)


class Completion(msgspec.Struct, kw_only=True):
    """A completion (``object`` "text_completion"), whole or one streamed chunk of it: a chunk has no
    ``usage`` (but the last, when asked for) and the chunk that finishes carries ``kv_transfer``."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | msgspec.UnsetType = msgspec.UNSET
    kv_transfer: KvTransfer | msgspec.UnsetType = msgspec.UNSET
    """What moving the KV cost (not in OpenAI's protocol: clients see it as an extra field)."""


def model_card(name: str, max_model_len: int, created: int) -> ModelCard:
    return ModelCard(id=name, created=created, max_model_len=max_model_len)


def chunk(
    cid: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str | None,
    *,
    usage: Usage | msgspec.UnsetType = msgspec.UNSET,
    kv_transfer: KvTransfer | msgspec.UnsetType = msgspec.UNSET,
) -> Completion:
    """One server-sent event of a streamed completion."""
    choices = [Choice(text=text, finish_reason=finish_reason)] if text or finish_reason else []
    return Completion(id=cid, created=created, model=model, choices=choices, usage=usage, kv_transfer=kv_transfer)


def completion(
    cid: str, model: str, text: str, finish_reason: str, usage: Usage, kv_transfer: KvTransfer
) -> Completion:
    return Completion(
        id=cid,
        created=int(time.time()),
        model=model,
        choices=[Choice(text=text, finish_reason=finish_reason)],
        usage=usage,
        kv_transfer=kv_transfer,
    )
