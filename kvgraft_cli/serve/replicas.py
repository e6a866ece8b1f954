"""`kvgraft serve --replicas N`: one endpoint in front of N engines, each in a Ray actor, and one ledger.

Ray Serve would be the obvious front, but its replicas (Ray 2.60) open their inter-deployment gRPC server on every
interface (``[::]``, hard-coded in ``ray/serve/_private/replica.py``), which a server kept on loopback cannot
accept; so the front is kvgraft serve's own app, and the replicas are Ray actors, started the way `deposit --ray`
starts its workers (runs.workers.ray: a local instance on loopback, or a cluster joined by ``--ray-address``).

- **A replica** (:class:`Replica`) loads the engine under the manifest's pins (drift refused, as in a local run),
  opens the store and answers one request at a time in its own engine thread (serve.worker), with its own prompt
  cache, buffer pool and slot. The prompt chunks it deposits go to the shared store, where the other replicas (and
  a restarted server) find them: an s3:// store, or a folder every node mounts.
- **The front** (:class:`Replicas`, the app's worker) parses and queues as a single server does (one bounded queue:
  429 past it), hands each request to the next idle replica, relays its streamed text, and records every answer into
  one ledger (serve.answer.Recorder), in the order they finish, as a single server would: a replica writes no
  ledger line. A client that goes away cancels the replica's decode within a step.
- **Responses do not depend on the replica.** Every replica computes batch 1 under the same pins, and the front
  refuses to start when their engines' ledger facts differ (a cluster whose nodes compute other bits); the prompt
  cache never changes a response (docs/SERVE.md). `kvgraft replay --served` recomputes a replicated server's log
  in one process and compares every hash (tests/test_s3.py).
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InputError, KvgraftError
from ..runs.context import RunContext
from ..runs.workers.local import error_from_record, error_record
from .answer import Answer, Options, Recorder, Server, sync
from .promptcache import Warmed
from .protocol import Request, RequestError
from .worker import Job, busy

WHERE = "serve replica"


@dataclass
class _Relay:
    """A request inside a replica: what serve.worker.Worker computes (as it does a Job), its events kept for the
    front instead of an event loop."""

    request: Request
    rid: str
    events: queue.Queue = field(default_factory=queue.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    queued: float = field(default_factory=time.perf_counter)

    def send(self, kind: str, value: Any) -> None:
        self.events.put((kind, value))


def _error_data(e: BaseException) -> dict[str, Any]:
    """An error as plain data for the front: a RequestError keeps its HTTP status and OpenAI fields."""
    if isinstance(e, RequestError):
        return {
            "request_error": {
                "message": e.message,
                "param": e.param,
                "status": e.status,
                "code": e.code,
                "type_": e.type,
                "headers": e.headers,
            }
        }
    return {"record": error_record(e)}


RESTART_WAIT_S = 300  # how long the front waits for a replica Ray is restarting (its engine loads again)


def _none_serve() -> RequestError:
    return RequestError("no replica serves: every one failed (see /health)", status=503, code="unavailable")


class _ReplicaFailed(KvgraftError):
    """A replica, not the request, failed (it died, or came back without its engine): the front checks it."""


def _error_from(data: dict[str, Any]) -> Exception:
    if "request_error" in data:
        return RequestError(**data["request_error"])
    return error_from_record(data["record"], WHERE)


class Replica:
    """One engine behind the front, in a Ray actor (``ray.remote`` wraps it in :meth:`Replicas.start`; this module
    never imports Ray at its top). A failure to load is kept and reported by :meth:`hello`, never raised (a raised one
    would make Ray restart the actor)."""

    def __init__(self, data: dict[str, Any], options: dict[str, Any]):
        from ..engine.engine import load_engine
        from ..runs.workers.ray import context_from_data
        from .worker import Worker

        self.error: dict | None = None
        self.current: _Relay | None = None
        try:
            ctx = context_from_data(data)
            self.server = Server(ctx, load_engine(ctx.manifest, ctx.allow_drift), Options(**options))
            # one request at a time (the front sends no more); no ledger line (the front writes it)
            self.worker = Worker(self.server, size=1, record=False)
            self.worker.start()  # opens the store in the engine's thread and warms the prompt cache
        except BaseException as e:  # noqa: BLE001  (reported by hello)
            self.error = error_record(e)

    def hello(self) -> dict[str, Any]:
        """What the front needs to know of this engine, or the error that stopped it loading."""
        if self.error:
            return {"error": self.error}
        s = self.server
        return {"facts": s.facts, "model_id": s.model_id, "chunk": s.chunk, "warmed": s.warmed, "library": s.library}

    def answer(self, rid: str, request: Request, cancelled: bool) -> Iterator[tuple[str, Any]]:
        """Compute one request: ("text", text so far) while a stream decodes, then ("done", Answer) with no ledger
        line, or ("error", data). ``cancelled``: the client went away while the request waited in the front."""
        if self.error:  # restarted by Ray and failed to load again: said, never a hang
            yield ("error", {"replica": self.error})
            return
        job = _Relay(request, rid)
        if cancelled:
            job.cancel.set()
        self.current = job
        try:
            self.worker.submit(job)
            while True:
                kind, value = job.events.get()
                if kind == "error":
                    yield ("error", _error_data(value))
                    return
                yield (kind, value)
                if kind == "done":
                    return
        finally:
            if self.current is job:  # (a later request's relay is not this one's to clear)
                self.current = None

    def cancel(self, rid: str) -> None:
        """Stop the decode of request ``rid`` within a step (if it is still the one computing)."""
        job = self.current
        if job is not None and job.rid == rid:
            job.cancel.set()


@dataclass
class Front:
    """What the app and the start line show of the replicas, as they show a single Server."""

    model_id: str
    chunk: int | None
    warmed: Warmed
    library: bool
    requests_log: Path
    replicas: int = 1


class Replicas:
    """The app's worker in front of ``count`` replicas (serve.worker.Worker's interface: start, submit, waiting,
    answered, retry_after, stop). ``count``: None, as many as the cluster's CPUs hold (each: runtime.threads).
    ``address``: None starts a local Ray instance on loopback; else a cluster."""

    def __init__(
        self,
        ctx: RunContext,
        options: Options,
        count: int | None,
        address: str | None = None,
        size: int = 64,
        restarts: int = 3,
    ):
        import importlib.util

        from ..runs.workers.ray import ray_missing

        if importlib.util.find_spec("ray") is None:
            raise ray_missing()
        if count is not None and count < 1:
            raise InputError(f"--replicas must be at least 1, got {count}")
        self.ctx, self.options, self.count, self.address, self.size = ctx, options, count, address, size
        self.restarts = restarts
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=size)
        self._lock = threading.Lock()  # one ledger append at a time (its flock serializes processes, not threads)
        self._threads: list[threading.Thread] = []
        self.actors: list = []
        self.started_ray = False
        self.busy_s: list[float] = []
        self.per_replica: list[int] = []  # requests each replica answered
        self.retired: list[str | None] = []  # why a replica takes no more requests (None: it serves)
        self.server: Front | None = None
        self.recorder: Recorder | None = None

    # -- start and stop ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start or join Ray, start the replicas and wait until each has loaded its engine (or refused to)."""
        from ..runs.workers.ray import context_data, fit_workers, init_ray, worker_env
        from .answer import default_requests_log

        self.started_ray = init_ray(self.address)
        import ray

        runtime = self.ctx.manifest.runtime
        n, per_replica = fit_workers(runtime, self.count, "--replicas", "replica")
        # Restarted when it dies (the request it held fails; the next one finds the engine loaded again), up to
        # --replica-restarts times, then retired; a request is never retried by Ray: the front has already relayed
        # part of it.
        actor = ray.remote(max_restarts=self.restarts, max_task_retries=0, max_concurrency=2, **per_replica)(Replica)
        data, options = context_data(self.ctx), asdict(self.options)
        env = worker_env(runtime)
        self.actors = [actor.options(runtime_env={"env_vars": env}).remote(data, options) for _ in range(n)]
        hellos = self._get([a.hello.remote() for a in self.actors])
        for h in hellos:
            if "error" in h:
                raise error_from_record(h["error"], WHERE)
        first = hellos[0]
        for i, h in enumerate(hellos[1:], 2):
            if h["facts"] != first["facts"]:
                differ = sorted(
                    k for k in set(h["facts"]) | set(first["facts"]) if h["facts"].get(k) != first["facts"].get(k)
                )
                raise InputError(
                    f"replica {i} computes under other facts than replica 1 ({', '.join(differ)}): its responses "
                    "could differ in bits",
                    "run the replicas on nodes of one kind (CPU family, versions), or serve without --replicas",
                )
        log = self.options.requests_log or default_requests_log(self.ctx.ledger)
        warmed = Warmed(
            sum(h["warmed"].chunks for h in hellos),
            sum(h["warmed"].bytes for h in hellos),
            sum(h["warmed"].refused for h in hellos),
            max(h["warmed"].seconds for h in hellos),
        )
        self.server = Front(first["model_id"], first["chunk"], warmed, any(h["library"] for h in hellos), log, n)
        self.recorder = Recorder(self.ctx, first["facts"], self.options, first["chunk"], log)
        self.per_replica, self.retired = [0] * n, [None] * n
        opened: list[BaseException | None] = []
        for i, a in enumerate(self.actors):
            ready = threading.Event()
            t = threading.Thread(
                target=self._run, args=(i, a, ready, opened), name=f"kvgraft-replica-{i + 1}", daemon=True
            )
            t.start()
            ready.wait()
            self._threads.append(t)
        failed = [e for e in opened if e is not None]
        if failed:  # a store this front cannot open: refused at start, not a queue nobody serves
            self.stop(timeout=10)
            raise failed[0]

    def stop(self, timeout: float | None = None) -> None:
        """Finish every queued job, then end the front's threads, the replicas and a Ray instance it started."""
        if self._threads:
            for _ in self._threads:
                self._queue.put(None)
            deadline = None if timeout is None else time.monotonic() + timeout
            for t in self._threads:
                t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            self._threads = []
        self.close()

    def close(self) -> None:
        """Kill the replicas; shut down a Ray instance this front started."""
        from ..runs.workers.ray import stop_actors

        stop_actors(self.actors, self.started_ray)
        self.actors, self.started_ray = [], False

    # -- the queue ----------------------------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue a job; RequestError 429 when the queue is full, 503 when no replica serves any more."""
        if not self.serving:
            raise _none_serve()
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise busy(self.size, f"{self.serving} replicas compute one each at a time", self.retry_after()) from None

    def retry_after(self) -> int:
        """Seconds until a place is likely free: the recent mean time a request holds a replica, over their count."""
        recent = self.busy_s[-20:]
        return max(1, round(sum(recent) / len(recent) / max(1, self.serving))) if recent else 1

    @property
    def serving(self) -> int:
        """Replicas not retired."""
        return sum(r is None for r in self.retired)

    @property
    def answered(self) -> int:
        return sum(self.per_replica)

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def _run(self, index: int, actor, ready: threading.Event, opened: list) -> None:
        """A replica's thread in the front: its next job, relayed, then recorded (its store connection is its own).
        It ends at the stop marker, or when its replica is retired (:meth:`_check`)."""
        try:
            store = self.ctx.open_store()
        except BaseException as e:  # reported by start() in the caller's thread
            opened.append(e)
            ready.set()
            return
        opened.append(None)
        ready.set()
        idle = max(1.0, self.options.sync_every)
        try:
            while True:
                try:
                    job = self._queue.get(timeout=idle)
                except queue.Empty:  # a lull: what this thread's store recorded is published all the same
                    sync(store.publish_due, self.options.sync_every, "publish the prompt cache's index rows")
                    continue
                if job is None:
                    return
                if not self._compute(index, actor, store, job):
                    return
        finally:
            store.close()
            if self.retired[index] is not None:
                self._fail_waiting_if_none_serve()

    def _compute(self, index: int, actor, store, job: Job) -> bool:
        """Relay and record one job; False when the replica is retired after it."""
        start = time.perf_counter()
        rid = uuid.uuid4().hex
        serves = True
        try:
            answer: Answer | None = None
            cancel_sent = False
            for ref in actor.answer.remote(rid, job.request, job.cancel.is_set()):
                kind, value = self._get(ref)
                if kind == "text":
                    job.send("text", value)
                elif kind == "done":
                    answer = value
                elif "replica" in value:  # the replica has no engine (a reload after a restart failed)
                    raise _ReplicaFailed(error_from_record(value["replica"], WHERE).message)
                else:
                    raise _error_from(value)
                if job.cancel.is_set() and not cancel_sent:
                    actor.cancel.remote(rid)
                    cancel_sent = True
            if answer is None:
                raise KvgraftError(f"{WHERE} {index + 1} ended a request without an answer")
            assert self.recorder is not None
            with self._lock:
                answer = self.recorder.record(store, job.request, answer, start - job.queued, start)
        except Exception as e:  # the app renders it (a RequestError as itself, anything else as a 500)
            job.send("error", e)
            if isinstance(e, _ReplicaFailed):
                serves = self._check(index, actor)
        else:
            with self._lock:
                self.per_replica[index] += 1
            job.send("done", answer)
        with self._lock:
            self.busy_s = self.busy_s[-19:] + [time.perf_counter() - start]
        # after the answer has gone: the rows this thread's store recorded (replicas' deposits too), published
        sync(store.publish_due, self.options.sync_every, "publish the prompt cache's index rows")
        return serves

    def _check(self, index: int, actor) -> bool:
        """After a replica failed a request: whether it serves again (Ray restarted it, its engine loaded, under the
        same facts as the others). Otherwise it is retired: /health says why and its thread takes no more jobs."""
        why = None
        try:
            hello = self._hello(actor)
        except KvgraftError as e:
            why = e.message
        else:
            if "error" in hello:
                why = str(hello["error"].get("message"))
            elif self.recorder is None or hello["facts"] != self.recorder.facts:
                why = "restarted under other facts than the other replicas (its bits could differ)"
        if why is not None:
            self.retired[index] = why
            return False
        return True

    def _hello(self, actor) -> dict[str, Any]:
        """The replica's hello, waiting while Ray restarts it: a call made just after a replica died is answered
        "temporarily unavailable" (Ray's ActorUnavailableError) until the new process has loaded its engine, and
        one made after its last restart "died" (ActorDiedError), which retires it."""
        import ray
        from ray.exceptions import ActorUnavailableError

        deadline = time.monotonic() + RESTART_WAIT_S
        while True:
            ref = actor.hello.remote()
            try:
                return ray.get(ref)
            except ActorUnavailableError:
                if time.monotonic() >= deadline:
                    raise _ReplicaFailed(
                        f"{WHERE} did not come back within {RESTART_WAIT_S} s of dying",
                        "re-run with KVGRAFT_DEBUG=1 to see the replicas' logs",
                    ) from None
                time.sleep(0.5)
            except Exception:  # noqa: BLE001  (Ray's other failures, as one line)
                return self._get(ref)

    def _fail_waiting_if_none_serve(self) -> None:
        """When the last replica is retired, refuse what waits (a 503 each) instead of leaving it queued; submit
        refuses what comes after."""
        if self.serving:
            return
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is None:
                continue
            job.send("error", _none_serve())

    def _get(self, refs):
        from ..runs.workers.ray import ray_get

        died = _ReplicaFailed(
            f"{WHERE} died; Ray restarts it up to its limit",
            "re-run with KVGRAFT_DEBUG=1 to see the replicas' logs; check the nodes' memory",
        )
        return ray_get(refs, WHERE, died)
