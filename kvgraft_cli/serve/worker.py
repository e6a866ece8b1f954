"""One engine behind a bounded queue, with continuous batching: the thread between the HTTP app and serve.answer.

Up to ``Server.batch`` requests decode together, one token of each a step (engine.decoding.step). A request joins
at a step boundary: its prompt is computed alone (the library's graft or the prompt cache's prefill,
Server.begin), then its decode steps beside the others'. It leaves when its decode stops (EOS, a stop string,
its budget, or its client gone), and its ledger line is written then (Server.finish). Each step's rows have the bits
each request's decode has alone (the engine's batched step is checked at start; where the check fails the server
decodes one request at a time and says why), so a response does not depend on the traffic around it.

Requests wait in a queue of ``size`` places; past it a request is refused at once (the app answers 429 with
Retry-After) rather than left to time out. The engine runs in this thread alone, and so does the store's SQLite
connection.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..engine.decoding import step
from .answer import Answer, Decoding, Server
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
    answered: Callable[[Any], None] | None = None  # sees the Answer when it is done (serve.metrics), client gone or not

    def send(self, kind: str, value: Any) -> None:
        if kind == "done" and self.answered is not None:
            self.answered(value)
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
        self.steps = 0  # decode steps computed
        self.rows = 0  # requests decoded in them, together (rows / steps: the mean batch)
        self.decoding = 0  # requests decoding now

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
            batch = self.server.batch
            how = "one is computed at a time" if batch == 1 else f"{batch} are decoded at a time"
            raise busy(self.size, how, self.retry_after()) from None

    def retry_after(self) -> int:
        """Seconds until a place is likely free: the recent mean time a request holds the engine over the requests
        decoded at once (at least 1)."""
        recent = self.busy_s[-20:]
        return max(1, round(sum(recent) / len(recent) / self.server.batch)) if recent else 1

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
        active: list[tuple[Task, Decoding, float]] = []
        stopping = False
        try:
            while active or not stopping:
                # Join: as many queued requests as the batch has room for (waiting for one only when none decodes)
                while len(active) < self.server.batch and not stopping:
                    try:
                        job = self._queue.get(timeout=idle) if not active else self._queue.get_nowait()
                    except queue.Empty:
                        if not active:  # a lull: what the last answers recorded is published all the same
                            self.server.upkeep()
                        break
                    if job is None:  # stop(): every job queued before it has joined
                        stopping = True
                        break
                    begun = self._begin(job)
                    if begun is not None:
                        active.append((job, begun, time.perf_counter()))
                self.decoding = len(active)
                if active:
                    active = self._step(active)
                    self.decoding = len(active)
        finally:
            self.server.close()

    def _begin(self, job: Task) -> Decoding | None:
        """A job's prompt computed (Server.begin); None when it is already answered (cancelled while it waited)
        or failed (the app renders the error)."""
        on_ids: Callable[[list[int], str], None] | None = None
        if job.request.stream:  # the text so far, decoded here: the event loop never touches the tokenizer
            decode = self.server.engine.decode_text
            on_ids = lambda ids, prefix: job.send("text", prefix + decode(ids, skip_special=True))  # noqa: E731
        start = time.perf_counter()
        try:
            with self.server.pooled():
                begun = self.server.begin(
                    job.request, on_ids, job.cancel.is_set, queued_s=start - job.queued, record=self.record
                )
        except Exception as e:  # the app renders it (a RequestError as itself, anything else as a 500)
            job.send("error", e)
            return None
        if isinstance(begun, Answer):
            self._done(job, begun, start)
            return None
        return begun

    def _step(self, active: list[tuple[Task, Decoding, float]]) -> list[tuple[Task, Decoding, float]]:
        """One decode step of every active request together; those whose decode stopped are finished and leave."""
        try:
            with self.server.pooled():
                rows = step(self.server.engine, [d.stream for _, d, _ in active], self.server.batch)
        except Exception as e:  # a failed forward fails the requests computed in it (the app answers 500)
            for job, _, _ in active:
                job.send("error", e)
            return []
        self.steps += 1
        self.rows += rows
        keep = []
        for job, d, start in active:
            if not d.stream.done:
                keep.append((job, d, start))
                continue
            try:
                with self.server.pooled():
                    answer = self.server.finish(d)
            except Exception as e:
                job.send("error", e)
                continue
            self._done(job, answer, start)
        return keep

    def _done(self, job: Task, answer: Answer, start: float) -> None:
        self.answered += 1
        job.send("done", answer)
        self.busy_s = self.busy_s[-19:] + [time.perf_counter() - start]
        self.server.upkeep()  # after the answer has gone: off its latency
