"""The OpenAI wire format: request bodies (validated strictly, unknown fields ignored) and errors.

Every error leaves the server as {"error": {"message", "type", "param", "code"}} with its HTTP status.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_STOP = 16          # stop strings per request
MAX_STOP_CHARS = 512   # characters per stop string
MAX_TOP_LOGPROBS = 20
SEED_RANGE = dict(ge=-(2 ** 63), le=2 ** 64 - 1)   # what torch.Generator.manual_seed accepts
MAX_TOKENS_RANGE = dict(ge=1, le=2 ** 31)


@dataclass(frozen=True)
class ServerConfig:
    """Every server setting, built once by `moetier serve` (or a test)."""
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_alias: str | None = None
    queue_size: int = 16                 # requests waiting behind the running one; more -> 429
    session_mem: int = 2 * 1024 ** 3     # bytes of KV cache kept for prefix reuse (at least one session)
    max_sessions: int = 8
    max_body_bytes: int = 16 * 1024 ** 2


class APIError(Exception):
    """An error the client caused (or overload); rendered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error(errors: list[dict]) -> APIError:
    """Pydantic/FastAPI validation errors -> one 400 naming the first bad field."""
    if not errors:
        return APIError(400, "the request body is invalid")
    e = errors[0]
    loc, _ = _split_loc(e.get("loc", ()))
    param = ".".join(loc) or None
    if e.get("type") == "json_invalid":
        detail = (e.get("ctx") or {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON ({detail}); send a JSON object "
                             "with Content-Type: application/json", code="invalid_json")
    if e.get("type") == "missing" and not loc:
        return APIError(400, "the request has no body; send a JSON object with Content-Type: application/json",
                        code="invalid_json")
    if not loc and e.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return APIError(400, "the request body must be a JSON object", code="invalid_json")
    # a union (str | list[str] ...) reports one error per alternative: name the alternatives instead
    same = [_split_loc(x.get("loc", ())) for x in errors]
    tags = [t[0] for l, t in same if l == loc and t]
    if len(tags) > 1:
        expected = " or ".join(dict.fromkeys(map(_json_type, tags)))
        return APIError(400, f"{param}: has the wrong type; expected {expected}", param=param, code="invalid_type")
    msg = e.get("msg", "invalid value")
    return APIError(400, f"{param or 'body'}: {msg}", param=param, code="invalid_value")


_FIELD = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "function-after"}


def _split_loc(loc) -> tuple[list[str], list[str]]:
    """FastAPI's loc -> (field path, union alternative tags): ('body', 'stop', 'list[str]') ->
    (['stop'], ['list[str]'])."""
    path, tags = [], []
    for x in loc:
        if x == "body" and not path:
            continue
        if not tags and (isinstance(x, int) or (_FIELD.fullmatch(x) and x not in _TYPE_TAGS)):
            path.append(str(x))
        else:
            tags.append(str(x))
    return path, tags


def _json_type(tag: str) -> str:
    """Pydantic's type tag -> JSON words: list[str] -> array of string."""
    if tag.startswith("list[") and tag.endswith("]"):
        return "array of " + _json_type(tag[5:-1])
    return {"str": "string", "int": "integer", "float": "number", "bool": "boolean",
            "dict[any,any]": "object"}.get(tag, "object" if tag[:1].isupper() else tag)


class Strict(BaseModel):
    # wrong JSON types are errors (no "1" -> 1 coercion); unknown fields are ignored
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class ContentPart(Strict):
    type: str = Field(max_length=64)
    text: str | None = None


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None
    tool_call_id: str | None = None


class StreamOptions(Strict):
    include_usage: bool = False


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: dict | None = None


class SamplingFields(Strict):
    """Fields shared by /v1/chat/completions and /v1/completions."""
    model: str | None = Field(None, max_length=256, description="the served model's id (GET /v1/models)")
    max_tokens: int | None = Field(None, **MAX_TOKENS_RANGE)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=2 ** 31, description="0 or -1: off (extension)")
    min_p: float | None = Field(None, ge=0, le=1, description="extension")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10, description="extension (HF semantics)")
    seed: int | None = Field(None, **SEED_RANGE)
    stop: str | list[str] | None = Field(None, description=f"up to {MAX_STOP} strings")
    n: int | None = Field(None, ge=1, le=128, description="only 1 is supported")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = Field(None, description="json_object / json_schema: the output is "
                                                   "one JSON object (the schema itself is not enforced)")
    user: str | None = Field(None, max_length=512)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, **MAX_TOKENS_RANGE)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    chat_template_kwargs: dict | None = Field(None, description="extension: extra chat template variables, "
                                                                "e.g. {\"enable_thinking\": false}")
    # function calling is not supported (the reply's tool calls are not parsed): tools are a 400 unless the request
    # says not to call them (tool_choice / function_call "none"), as vLLM and llama-server refuse what they cannot do
    tools: list[dict] | None = Field(None, description="not supported: a 400 unless tool_choice is \"none\"")
    tool_choice: str | dict | None = None
    functions: list[dict] | None = Field(None, description="not supported: a 400 unless function_call is \"none\"")
    function_call: str | dict | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(description="text or token ids (one prompt)")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=128, description="only 1 is supported")


def stop_list(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP:
        raise APIError(400, f"stop: at most {MAX_STOP} stop strings are allowed (got {len(stops)})", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise APIError(400, f"stop: each stop string may have at most {MAX_STOP_CHARS} characters", param="stop")
    return [s for s in stops if s]


def check_common(req: SamplingFields) -> None:
    if req.n not in (None, 1):
        raise APIError(400, f"n: only n=1 is supported (got {req.n}); send separate requests for more choices",
                       param="n", code="unsupported_value")
    if getattr(req, "best_of", None) not in (None, 1):
        raise APIError(400, "best_of: only 1 is supported", param="best_of", code="unsupported_value")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options: only allowed when stream is true", param="stream_options")


def message_text(m: ChatMessage) -> str | None:
    """Content parts -> one string (text parts only; other inputs are refused)."""
    if m.content is None or isinstance(m.content, str):
        return m.content
    out = []
    for i, p in enumerate(m.content):
        if p.type != "text":
            raise APIError(400, f"messages: content part type {p.type!r} is not supported; this model reads text "
                                "parts only", param="messages", code="unsupported_value")
        if p.text is None:
            raise APIError(400, "messages: a text content part needs a 'text' string", param="messages")
        out.append(p.text)
    return "".join(out)
