"""The OpenAI-compatible request bodies `kvgraft serve` accepts, checked field by field (no torch, no engine).

Decoding is greedy: what the ledger can re-check. A parameter the server cannot honour exactly (sampling, several
choices, tools, log probabilities, penalties, biases) is refused with the field named, never silently changed; a
field the API does not have is refused too, so a typo does not pass unnoticed. Every refusal is a
:class:`RequestError` that the app renders in OpenAI's error shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..util.hashing import canonical_json, sha256_bytes

MAX_STOP = 4  # OpenAI's own limit on stop sequences
ROLES = ("system", "developer", "user", "assistant")


class RequestError(Exception):
    """A request the server refuses: HTTP ``status``, OpenAI's error ``type``/``code``, the ``param`` at fault."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        type_: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.type = type_
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """OpenAI's error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Request:
    """One checked request: a chat (``messages``) or a completion (``prompt``), greedy, with its limits."""

    endpoint: str  # chat | completion
    model: str
    messages: list[dict[str, str]] = field(default_factory=list)
    prompt: str = ""
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    sha256: str = ""  # SHA-256 of the body's RFC 8785 form: what the ledger line names
    body: dict[str, Any] = field(default_factory=dict)
    cache_salt: str | None = None  # vLLM's field: the prompt cache this request shares (serve.tenants)
    tenant: str | None = None  # the API key's tenant (serve.tenants.tenant_id), set by the app; None without keys

    @property
    def question(self) -> str | None:
        """The last user turn (a chat's question), else None."""
        if self.endpoint == "chat" and self.messages and self.messages[-1]["role"] == "user":
            return self.messages[-1]["content"]
        return None


# Fields each endpoint takes: accepted as they are (honoured exactly), or accepted only at values greedy decoding
# honours (checked below). Anything else is refused by name.
_COMMON = {"model", "max_tokens", "stop", "stream", "stream_options", "temperature", "top_p", "n", "seed", "user",
           "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "cache_salt"}  # fmt: skip
MAX_SALT = 1024  # characters of a cache_salt
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
                   "function_call", "parallel_tool_calls", "response_format"}  # fmt: skip
_COMPLETION = _COMMON | {"prompt", "echo", "best_of", "suffix"}


def parse(raw: bytes, endpoint: str) -> Request:
    """A request body (JSON bytes) for ``endpoint`` (chat | completion), checked; RequestError naming the field."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    known = _CHAT if endpoint == "chat" else _COMPLETION
    for key in body:
        if key not in known:
            raise RequestError(f"unknown field {key!r} (kvgraft serve takes {', '.join(sorted(known))})", key)
    req = Request(endpoint, _model(body))
    if endpoint == "chat":
        req.messages = _messages(body.get("messages"))
    else:
        req.prompt = _prompt(body.get("prompt"))
        for key, off in (("echo", False), ("suffix", None), ("best_of", 1)):
            if body.get(key, off) not in (off, None):
                raise RequestError(f"{key} is not supported (greedy, one completion, no echo)", key)
    _greedy_only(body, endpoint)
    req.max_tokens = _max_tokens(body, endpoint)
    req.stop = _stop(body.get("stop"))
    req.stream = _bool(body, "stream")
    salt = body.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str) or not salt or len(salt) > MAX_SALT:
            raise RequestError(f"cache_salt must be a non-empty string of at most {MAX_SALT} characters", "cache_salt")
        req.cache_salt = salt
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise RequestError("stream_options takes only include_usage", "stream_options")
        if not req.stream:
            raise RequestError("stream_options is only allowed with stream: true", "stream_options")
        req.include_usage = _bool(options, "include_usage", "stream_options.include_usage")
    try:
        req.sha256 = sha256_bytes(canonical_json(body))
    except (TypeError, ValueError) as e:  # a number RFC 8785 cannot write (NaN, a huge integer)
        raise RequestError(f"the request body holds a value that has no canonical JSON form: {e}") from None
    req.body = body
    return req


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model is required: the id `GET /v1/models` lists", "model")
    return model


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (joined); images and other parts are refused."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}[{i}] must be a text part ({{'type': 'text', 'text': ...}})", where)
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where} must be a string or a list of text parts", where)


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where} must be an object with role and content", where)
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise RequestError(f"{where}: field {sorted(extra)[0]!r} is not supported (text messages only)", where)
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        if "content" not in m or m["content"] is None:
            raise RequestError(f"{where}.content is required", f"{where}.content")
        # developer is OpenAI's newer name for system; the chat template knows only system
        out.append({"role": "system" if role == "developer" else role, "content": _text(m["content"], where)})
    if out[-1]["role"] != "user":
        raise RequestError("the last message must be a user turn (the question to answer)", "messages")
    return out


def _prompt(prompt: Any) -> str:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise RequestError("prompt must be one string (one completion a request)", "prompt")
    if not prompt:
        raise RequestError("prompt is empty", "prompt")
    return prompt


def _greedy_only(body: dict, endpoint: str) -> None:
    """Refuse every parameter greedy decoding cannot honour exactly, naming it."""
    temperature = body.get("temperature")
    if temperature is not None and (not _number(temperature) or temperature != 0):
        if not _number(temperature) or temperature < 0 or temperature > 2:
            raise RequestError("temperature must be a number from 0 to 2", "temperature")
        raise RequestError(
            f"temperature {temperature} samples; kvgraft serve decodes greedily (temperature 0), the output the ledger "
            "can re-check",
            "temperature",
        )
    top_p = body.get("top_p")
    if top_p is not None and (not _number(top_p) or top_p != 1):
        raise RequestError("top_p below 1 samples; kvgraft serve decodes greedily (top_p 1)", "top_p")
    n = body.get("n")
    if n is not None and n != 1:
        raise RequestError("n must be 1: greedy decoding has one answer", "n")
    for key in ("presence_penalty", "frequency_penalty"):
        value = body.get(key)
        if value is not None and (not _number(value) or value != 0):
            raise RequestError(f"{key} changes the logits; kvgraft serve computes the model's own (0 only)", key)
    if body.get("logit_bias"):
        raise RequestError("logit_bias changes the logits; kvgraft serve computes the model's own", "logit_bias")
    logprobs = body.get("logprobs")
    if logprobs not in (None, False) and not (endpoint == "completion" and logprobs == 0):
        raise RequestError(
            "logprobs are not returned (the ledger records a hash of the first token's logits)", "logprobs"
        )
    if body.get("top_logprobs") not in (None, 0):
        raise RequestError("top_logprobs are not returned", "top_logprobs")
    for key in ("tools", "functions"):
        if body.get(key):
            raise RequestError(f"{key} are not supported (text completions only)", key)
    for key in ("tool_choice", "function_call"):
        if body.get(key) not in (None, "none"):
            raise RequestError(f"{key} is not supported (text completions only)", key)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise RequestError("response_format: only {'type': 'text'} (no constrained decoding)", "response_format")
    seed = body.get("seed")
    if seed is not None and not _integer(seed):
        raise RequestError("seed must be an integer (greedy decoding does not use it)", "seed")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError("user must be a string", "user")


def _max_tokens(body: dict, endpoint: str) -> int | None:
    names = ("max_completion_tokens", "max_tokens") if endpoint == "chat" else ("max_tokens",)
    given = [(k, body[k]) for k in names if body.get(k) is not None]
    if len(given) > 1 and given[0][1] != given[1][1]:
        raise RequestError("max_tokens and max_completion_tokens differ; give one", "max_completion_tokens")
    if not given:
        return None
    key, value = given[0]
    if not _integer(value) or value < 1:
        raise RequestError(f"{key} must be a positive integer", key)
    return value


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items) or len(items) > MAX_STOP:
        raise RequestError(f"stop must be a non-empty string or a list of at most {MAX_STOP} of them", "stop")
    return list(items)


def _bool(body: dict, key: str, param: str | None = None) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{param or key} must be true or false", param or key)
    return value


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _integer(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
