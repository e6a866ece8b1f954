"""One engine, one request at a time, behind a bounded queue: the thread between the HTTP app and serve.answer.

Batch size 1 keeps every response's bits independent of the traffic around it. Requests wait in a queue of
``size`` places; past it a request is refused at once (the app answers 429 with Retry-After) rather than left to
time out. The engine runs in this thread alone, and so does the store's SQLite connection.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .answer import Server
from .protocol import Request, RequestError


@dataclass
class Job:
    """A request in the queue and the events it sends back to the app's event loop: ("text", the text so far) after
    each token while a streaming request decodes, then ("done", Answer) or ("error", exception)."""

    request: Request
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    queued: float = field(default_factory=time.perf_counter)

    def send(self, kind: str, value: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


def busy(size: int, how: str, retry_after: int) -> RequestError:
    """The 429 of a full queue (OpenAI's rate-limit error), with Retry-After in seconds."""
    return RequestError(
        f"the server is busy: {size} requests are waiting ({how})",
        status=429,
        code="rate_limit_exceeded",
        type_="rate_limit_error",
        headers={"Retry-After": str(retry_after)},
    )


class Task(Protocol):
    """What the engine's thread computes: a Job, or a replica's relay of one (serve.replicas)."""

    request: Request
    cancel: threading.Event
    queued: float

    def send(self, kind: str, value: Any) -> None: ...


class Worker:
    """The engine's thread, over a Server whose engine is loaded (its store is opened in this thread). ``record``
    False: answers come back without their ledger line (a replica's: the front records them, serve.replicas)."""

    def __init__(self, server: Server, size: int = 64, record: bool = True):
        self.server = server
        self.size = size
        self.record = record
        self._queue: queue.Queue[Task | None] = queue.Queue(maxsize=size)
        self._thread = threading.Thread(target=self._run, name="kvgraft-engine", daemon=True)
        self._opened = threading.Event()
        self._open_error: BaseException | None = None
        self.busy_s: list[float] = []  # recent requests' engine seconds (Retry-After's estimate)
        self.answered = 0

    def start(self) -> None:
        self._thread.start()
        self._opened.wait()
        if self._open_error is not None:
            raise self._open_error

    def submit(self, job: Task) -> None:
        """Queue a job, or RequestError 429 when the queue is full."""
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise busy(self.size, "one is computed at a time", self.retry_after()) from None

    def retry_after(self) -> int:
        """Seconds until a place is likely free: the recent mean time a request holds the engine (at least 1)."""
        recent = self.busy_s[-20:]
        return max(1, round(sum(recent) / len(recent))) if recent else 1

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def stop(self, timeout: float | None = None) -> None:
        """Finish every queued job, then end the thread (a second call does nothing)."""
        if not self._thread.is_alive():
            return
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self.server.open()
        except BaseException as e:  # reported by start() in the caller's thread
            self._open_error = e
            self._opened.set()
            return
        self._opened.set()
        idle = max(1.0, self.server.options.sync_every)  # how long the queue may stay empty before an upkeep
        try:
            while True:
                try:
                    job = self._queue.get(timeout=idle)
                except queue.Empty:  # a lull: what the last answers recorded is published all the same
                    self.server.upkeep()
                    continue
                if job is None:
                    return
                self._compute(job)
        finally:
            self.server.close()

    def _compute(self, job: Task) -> None:
        start = time.perf_counter()
        on_ids: Callable[[list[int], str], None] | None = None
        if job.request.stream:  # the text so far, decoded here: the event loop never touches the tokenizer
            decode = self.server.engine.decode_text
            on_ids = lambda ids, prefix: job.send("text", prefix + decode(ids, skip_special=True))  # noqa: E731
        try:
            answer = self.server.answer(
                job.request, on_ids, job.cancel.is_set, queued_s=start - job.queued, record=self.record
            )
        except Exception as e:  # the app renders it (a RequestError as itself, anything else as a 500)
            job.send("error", e)
        else:
            self.answered += 1
            job.send("done", answer)
        self.busy_s = self.busy_s[-19:] + [time.perf_counter() - start]
        self.server.upkeep()  # after the answer has gone: off its latency
