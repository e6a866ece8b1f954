"""The ASGI app of `kvgraft serve` (Starlette): OpenAI's chat and completion endpoints, models, health.

The app parses (serve.protocol), queues (serve.worker) and renders; the engine thread computes (serve.answer).
Streaming is OpenAI's server-sent events: a first chunk with the role, one chunk per piece of text, a last chunk
with the finish reason (and the ``kvgraft`` object), a usage chunk when ``stream_options.include_usage`` asks,
then ``data: [DONE]``. The last chunk is sent only once the request's ledger line is written. A client that
disconnects cancels its request: the decode stops within a step and the line records ``cancelled``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import traceback
from collections.abc import AsyncIterator
from typing import Any

from .answer import Answer, cut_at_stop
from .metrics import Metrics
from .protocol import Request, RequestError, parse
from .replicas import Replicas
from .tenants import Keys
from .worker import Job, Worker

DEFAULT_MAX_BODY = 1 << 20  # bytes; a prompt longer than any context fits in far less


def create_app(worker: Worker | Replicas, max_body: int = DEFAULT_MAX_BODY, on_shutdown=None, keys: Keys | None = None):
    """The Starlette app over a started worker (one engine in this process, or replicas: serve.replicas).
    ``on_shutdown`` runs after the server stops taking requests. ``keys``: the API keys ``/v1/...`` takes
    (serve.tenants; none: open); ``/health`` and ``/metrics`` are open, as vLLM's are, and say no prompt."""
    from starlette.applications import Starlette
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    server = worker.server
    assert server is not None  # (started)
    created = int(time.time())
    keys = keys or Keys([])
    metrics = Metrics(worker)

    def error(e: RequestError) -> JSONResponse:
        metrics.failed(e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    def tenant(request: HttpRequest) -> str | None:
        """The request's tenant; RequestError 401 (OpenAI's shape) without a key this server takes."""
        try:
            return keys.tenant(request.headers.get("authorization"))
        except PermissionError as e:
            raise RequestError(
                f"{e} (kvgraft serve --api-key)",
                status=401,
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            ) from None

    async def read_body(request: HttpRequest) -> bytes:
        length = request.headers.get("content-length")
        too_big = RequestError(
            f"the request body is over {max_body:,} bytes (kvgraft serve --max-body)", status=413, code="too_large"
        )
        if length is not None and length.isdigit() and int(length) > max_body:
            raise too_big
        body = bytearray()
        async for piece in request.stream():
            body += piece
            if len(body) > max_body:
                raise too_big
        return bytes(body)

    async def health(_: HttpRequest) -> JSONResponse:
        return JSONResponse(
            {
                "status": "ok",
                "model": server.model_id,
                "waiting": worker.waiting,
                "answered": worker.answered,
                "prompt_cache_chunk": server.chunk,
                "prompt_cache_warmed": server.warmed.to_json(),
                "library": server.library,
                "prompt_cache": getattr(getattr(server, "cache", None), "to_json", lambda: None)(),
                "api_keys": len(keys),
                "batch": {
                    "max": getattr(server, "batch", 1),
                    "note": getattr(server, "batch_note", None),
                    "decoding": getattr(worker, "decoding", None),
                    "steps": getattr(worker, "steps", None),
                    "rows": getattr(worker, "rows", None),
                },
                **(
                    {"replicas": list(worker.per_replica), "replicas_retired": list(worker.retired)}
                    if isinstance(worker, Replicas)
                    else {}
                ),
            }
        )

    async def metrics_text(_: HttpRequest) -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=None, headers={"content-type": content_type})

    async def models(request: HttpRequest) -> JSONResponse:
        try:
            tenant(request)
        except RequestError as e:
            return error(e)
        return JSONResponse({"object": "list", "data": [_model_card(server.model_id, created)]})

    async def model(request: HttpRequest) -> JSONResponse:
        try:
            tenant(request)
        except RequestError as refused:
            return error(refused)
        name = request.path_params["model"]
        if name != server.model_id:
            e = RequestError(f"the model {name!r} does not exist here", "model", status=404, code="model_not_found")
            return error(e)
        return JSONResponse(_model_card(server.model_id, created))

    async def complete(request: HttpRequest, endpoint: str):
        try:
            who = tenant(request)  # before the body is read: a stranger's upload is not taken
            req = parse(await read_body(request), endpoint)
            req.tenant = who
            if req.model != server.model_id:
                raise RequestError(
                    f"the model {req.model!r} does not exist here; this server serves {server.model_id!r}",
                    "model",
                    status=404,
                    code="model_not_found",
                )
            job = Job(req, asyncio.get_running_loop(), answered=metrics.answered)
            worker.submit(job)
        except RequestError as e:
            return error(e)
        kind, value = await job.events.get()  # the first event: a refusal is still an HTTP error, not a stream
        if req.stream:
            if kind == "error":
                return error(_as_request_error(value))
            return _EventStream(job, _stream(job, server.model_id, (kind, value), metrics))
        if kind == "error":
            return error(_as_request_error(value))
        return JSONResponse(_response(req, value, server.model_id))

    async def chat(request: HttpRequest):
        return await complete(request, "chat")

    async def completions(request: HttpRequest):
        return await complete(request, "completion")

    async def not_found(request: HttpRequest, exc):
        e = RequestError(f"no route {request.method} {request.url.path}", status=exc.status_code, code="not_found")
        return error(e)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_text, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app):
        yield
        await asyncio.get_running_loop().run_in_executor(None, worker.stop)
        if on_shutdown is not None:
            on_shutdown()

    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found}, lifespan=lifespan)


def _model_card(model_id: str, created: int) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "kvgraft"}


def _as_request_error(e: BaseException) -> RequestError:
    if isinstance(e, RequestError):
        return e
    from ..errors import KvgraftError

    if isinstance(e, KvgraftError):  # a store or ledger that refused: the server's fault, said plainly
        hint = f" ({e.hint})" if e.hint else ""
        return RequestError(f"{e.message}{hint}", status=500, code="server_error", type_="server_error")
    traceback.print_exception(e, file=sys.stderr)
    return RequestError(
        f"internal error: {type(e).__name__}: {e}", status=500, code="server_error", type_="server_error"
    )


def _response_id(req: Request, answer: Answer) -> str:
    prefix = "chatcmpl" if req.endpoint == "chat" else "cmpl"
    return f"{prefix}-{req.sha256[:12]}-{answer.ledger_seq}"


def _response(req: Request, a: Answer, model_id: str) -> dict[str, Any]:
    """The non-streaming response object (chat.completion or text_completion)."""
    reason = "length" if a.finish_reason == "cancelled" else a.finish_reason
    if req.endpoint == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": a.text},
            "finish_reason": reason,
            "logprobs": None,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": a.text, "finish_reason": reason, "logprobs": None}
        obj = "text_completion"
    return {
        "id": _response_id(req, a),
        "object": obj,
        "created": int(time.time()),
        "model": model_id,
        "choices": [choice],
        "usage": a.usage(),
        "kvgraft": a.kvgraft(),
    }


def _chunk(req: Request, cid: str, model_id: str, delta: dict | None, text: str | None, reason: str | None) -> bytes:
    if req.endpoint == "chat":
        choice: dict[str, Any] = {"index": 0, "delta": delta or {}, "finish_reason": reason, "logprobs": None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
        obj = "text_completion"
    return _sse({"id": cid, "object": obj, "created": int(time.time()), "model": model_id, "choices": [choice]})


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _stream(job: Job, model_id: str, first: tuple[str, Any], metrics: Metrics) -> AsyncIterator[bytes]:
    """The events of a streaming request, from its ``first`` (already received: a request refused before any
    computation is answered as an HTTP error instead). Text is held back while it could still be the start of a
    stop string, so the pieces joined are the non-streaming response's text."""
    req = job.request
    cid = f"{'chatcmpl' if req.endpoint == 'chat' else 'cmpl'}-{req.sha256[:12]}"
    hold = max((len(s) for s in req.stop), default=1) - 1
    sent = ""

    def piece(text: str) -> bytes | None:
        nonlocal sent
        if not text.startswith(sent) or len(text) <= len(sent):
            return None
        delta, sent = text[len(sent) :], text
        return _chunk(req, cid, model_id, {"content": delta}, delta, None)

    if req.endpoint == "chat":
        yield _chunk(req, cid, model_id, {"role": "assistant", "content": ""}, None, None)
    event: tuple[str, Any] | None = first
    while True:
        kind, value = event if event is not None else await job.events.get()
        event = None
        if kind == "text":
            text, stopped = cut_at_stop(value, req.stop)
            if not stopped:
                text = text[: len(text) - hold] if hold else text
            text = text.rstrip("\ufffd")  # a character still split across tokens
            out = piece(text)
            if out:
                yield out
            continue
        if kind == "error":
            e = _as_request_error(value)
            metrics.failed(e.status)
            yield _sse(e.body())
            yield b"data: [DONE]\n\n"
            return
        answer: Answer = value
        out = piece(answer.text)
        if out:
            yield out
        reason = "length" if answer.finish_reason == "cancelled" else answer.finish_reason
        cid = _response_id(req, answer)
        last = json.loads(_chunk(req, cid, model_id, {}, "", reason)[6:])
        last["kvgraft"] = answer.kvgraft()
        yield _sse(last)
        if req.include_usage:
            yield _sse(
                {
                    "id": cid,
                    "object": last["object"],
                    "created": last["created"],
                    "model": model_id,
                    "choices": [],
                    "usage": answer.usage(),
                }
            )
        yield b"data: [DONE]\n\n"
        return


class _EventStream:
    """A server-sent events response that cancels its job when the client goes away (an ``http.disconnect``, or a
    send that fails), whichever ASGI version the server speaks."""

    def __init__(self, job: Job, events: AsyncIterator[bytes]):
        self.job = job
        self.events = events

    async def __call__(self, scope, receive, send) -> None:
        job = self.job

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    job.cancel.set()
                    return

        watcher = asyncio.ensure_future(watch())
        finished = False
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"cache-control", b"no-cache"),
                        (b"x-accel-buffering", b"no"),
                    ],
                }
            )
            async for chunk in self.events:
                if job.cancel.is_set():
                    return
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            finished = True
        except OSError:
            pass
        finally:
            watcher.cancel()
            if not finished:
                job.cancel.set()
