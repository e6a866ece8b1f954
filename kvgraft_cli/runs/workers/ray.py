"""Run a job's problems in shards on Ray workers: a local Ray instance, or a cluster the driver joins.

Each worker is a Ray actor holding one engine, loaded once: it starts with the manifest's kernel-flag environment
(``runtime_env`` env vars, so torch is imported under the pinned flags) and loads the engine with the same checks
as a local run (model hash, versions, flags; drift refused unless ``--allow-drift``). A shard is a run of
consecutive items; the worker runs a job (:data:`JOBS`) on each item and returns structured records, errors
included (``{"ok": value}`` or ``{"error": error_record}``, stopping at the first error), which the driver turns
back into the same :class:`KvgraftError` class (runs.workers.local's error_record / error_from_record).

Workers write only content-addressed bytes to the shared store (objects; chain links when solving); the driver,
alone, indexes what was deposited and appends the ledger, in input order (:meth:`RayPool.map_ordered` yields the
results in input order as the shards finish), so the ledger a sharded run writes is the one a single-process run
writes, whatever the worker count. A worker that dies is restarted by Ray and its shard run again
(``max_restarts`` / ``max_task_retries``): the driver records each item once, whichever attempt produced it.

The store must be one every worker reaches: an s3:// store, or a filesystem path mounted at the same place on
every node (a local Ray instance shares this machine's). kvgraft, the engine extra and the model must be installed
on every node. Ray is an optional extra (``pip install 'kvgraft[ray]'``); only this module imports it, inside its
functions.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import traceback
from collections import deque
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import InputError, KvgraftError
from .local import error_from_record, error_record

if TYPE_CHECKING:
    from ...config.sections import RuntimeSection

# Jobs a worker may run: name -> "module:function". The function takes the worker (``.ctx``, ``.engine``,
# ``.store``, ``.facts``) and one item, with the call's arguments as keywords, and returns plain (picklable) data.
JOBS = {
    "deposit-prefix": "kvgraft_cli.runs.deposit:ray_prefix_job",
    "deposit": "kvgraft_cli.runs.deposit:ray_deposit_job",
    "solve-query": "kvgraft_cli.library.solve:ray_query_job",
    "solve": "kvgraft_cli.library.solve:ray_solve_job",
}

# How many times Ray restarts a dead worker and re-runs its shard before the run fails.
MAX_RETRIES = 3

# Test hook (tests/test_ray.py): when set to a path, the first worker to finish a problem of a ``deposit`` shard
# (its object written) creates that file and exits the process at once (os._exit(1)), before returning the shard,
# as a crash would; the file makes it happen once. Forwarded to the workers by the driver. Never set it otherwise.
EXIT_ONCE_ENV = "KVGRAFT_TEST_RAY_EXIT_ONCE"

WHERE = "Ray worker"
# Ray's switch for multi-node clusters (named for Windows and macOS, where it is off by default): "0" on a local
# instance makes Ray take 127.0.0.1 as the node address and bind its servers there.
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK = "127.0.0.1"


def ray_missing() -> InputError:
    return InputError("--ray needs Ray, which is not installed here", "pip install 'kvgraft[ray]'")


class RayPool:
    """Ray workers for one RunContext (``with RayPool(ctx) as pool``). Nothing starts until :meth:`start` (the
    library calls it once its input is checked); closing kills the workers and shuts down a Ray instance this
    pool started (a cluster joined by address is only disconnected from).

    ``address``: None starts a local Ray instance; else a cluster address (``auto``, ``HOST:PORT``,
    ``ray://HOST:10001``). ``workers``: how many engines (default: as many as the cluster's CPUs hold, at least 1;
    on CUDA, its GPUs). ``shard_size``: items per task (default: about two shards per worker)."""

    def __init__(self, ctx, address: str | None = None, workers: int | None = None, shard_size: int | None = None):
        try:
            found = importlib.util.find_spec("ray") is not None
        except (ImportError, ValueError):  # a broken or blocked install reads as none
            found = False
        if not found:
            raise ray_missing()  # refused before any work
        if workers is not None and workers < 1:
            raise InputError(f"--workers must be at least 1, got {workers}")
        self.ctx = ctx
        self.address = address
        self.workers = workers
        self.shard_size = shard_size
        self.actors: list = []
        self.facts: dict = {}
        self.max_positions: int | None = None
        self.started_ray = False
        self.wall_s = 0.0

    def __enter__(self) -> RayPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- start and stop ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Join or start Ray, start the workers and wait until each has loaded its engine (or refused to)."""
        if self.actors:
            return
        self.started_ray = init_ray(self.address) or self.started_ray
        import ray

        runtime = self.ctx.manifest.runtime
        n, per_worker = fit_workers(runtime, self.workers)
        env = worker_env(runtime)
        actor = ray.remote(max_restarts=MAX_RETRIES, max_task_retries=MAX_RETRIES, **per_worker)(Worker)
        data = context_data(self.ctx)
        self.actors = [actor.options(runtime_env={"env_vars": env}).remote(data) for _ in range(n)]
        hellos = self._get([a.hello.remote() for a in self.actors])
        for h in hellos:
            if "error" in h:
                raise error_from_record(h["error"], WHERE)
        self.facts, self.max_positions = hellos[0]["facts"], hellos[0]["max_positions"]

    def close(self) -> None:
        """Kill the workers; shut down a Ray instance this pool started (a joined cluster: disconnect)."""
        stop_actors(self.actors, self.started_ray)
        self.actors, self.started_ray = [], False

    # -- running shards ----------------------------------------------------------------------------------------------
    def map_all(self, job: str, items: list, args: dict[str, Any], codec: str | None = None) -> list:
        """Every item's result, in input order (the first error in input order is raised)."""
        return list(self.map_ordered(job, items, args, codec))

    def map_ordered(self, job: str, items: list, args: dict[str, Any], codec: str | None = None) -> Iterator:
        """Run ``job`` on every item in shards, each shard on the next idle worker; yield the results in input
        order as soon as every earlier one is in, raising the first error in input order as its KvgraftError.
        ``codec``: the workers open the store (writing new objects with it); None: they do not open it."""
        import ray

        if job not in JOBS:
            raise ValueError(f"unknown worker job {job!r}")
        self.start()
        n = len(items)
        size = self.shard_size or max(1, -(-n // (2 * len(self.actors))))
        queue = deque((i, items[i : i + size]) for i in range(0, n, size))
        idle = list(self.actors)
        pending: dict = {}  # task -> (first item's index, item count, worker)
        done: dict[int, list] = {}  # first item's index -> the shard's records, until yielded
        upto = 0
        while upto < n:
            while idle and queue:
                a = idle.pop(0)
                first, shard = queue.popleft()
                pending[a.run.remote(job, shard, args, codec)] = (first, len(shard), a)
            ready, _ = ray.wait(list(pending), num_returns=1)
            for task in ready:
                first, count, a = pending.pop(task)
                records = self._get(task)
                errors = [r for r in records if "error" in r]
                if len(records) != count and not errors:
                    raise KvgraftError(f"{WHERE}: a shard of {count} items came back with {len(records)} results")
                done[first] = records
                idle.append(a)
            while upto in done:  # the next run of results in input order
                for rec in done.pop(upto):
                    if "error" in rec:
                        raise error_from_record(rec["error"], WHERE)
                    yield rec["ok"]
                    upto += 1

    def _get(self, tasks):
        return ray_get(
            tasks,
            WHERE,
            KvgraftError(
                f"{WHERE} died and was restarted {MAX_RETRIES} times without finishing its shard",
                "re-run with KVGRAFT_DEBUG=1 to see the workers' logs; check the nodes' memory",
            ),
        )


def ray_get(refs, where: str, died: KvgraftError):
    """``ray.get(refs)``, Ray's failures as one error line: ``died`` when the actor died, else "Ray failed"."""
    import ray
    from ray.exceptions import RayActorError, RayError

    try:
        return ray.get(refs)
    except RayActorError:
        raise died from None
    except RayError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise KvgraftError(
            f"{where}: Ray failed: {type(e).__name__}: {first[:300]}", "re-run with KVGRAFT_DEBUG=1 to see its logs"
        ) from None


def stop_actors(actors: list, started_ray: bool) -> None:
    """Kill ``actors`` (never restarted); shut down Ray when this process started or joined it (``started_ray``)."""
    if not actors and not started_ray:
        return
    import ray

    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # noqa: BLE001  (already gone)
            pass
    if started_ray:
        ray.shutdown()


def worker_env(runtime: RuntimeSection) -> dict[str, str]:
    """The environment a worker process starts with: the manifest's kernel flags (set before it imports torch; a
    null pin, "must be unset", cannot be expressed there: the engine's pin_environment unsets it before torch
    loads), and this process's debug and test switches."""
    env = {k: v for k, v in runtime.env.items() if v is not None}
    for name in (EXIT_ONCE_ENV, "KVGRAFT_DEBUG"):
        if os.environ.get(name):
            env[name] = os.environ[name]
    return env


def fit_workers(
    runtime: RuntimeSection, wanted: int | None, flag: str = "--workers", noun: str = "worker"
) -> tuple[int, dict[str, int]]:
    """How many engines the connected Ray cluster holds for a manifest's ``runtime`` (each: its threads' CPUs, or one
    GPU), and the resources each asks for: ``wanted`` (None: as many as fit), InputError naming ``flag`` past that."""
    import ray

    gpu = runtime.device == "cuda"
    per_worker = {"num_gpus": 1, "num_cpus": 1} if gpu else {"num_cpus": runtime.threads}
    total = ray.cluster_resources()
    unit, need = ("GPU", 1) if gpu else ("CPU", per_worker["num_cpus"])
    fits = int(total.get(unit, 0) // need)
    n = wanted if wanted is not None else max(1, fits)
    if n > fits:
        raise InputError(
            f"{n} {noun}{'s' if n != 1 else ''} need {n * need} {unit}"
            f"{'s' if n * need != 1 else ''} (each: {need}, runtime.threads), the Ray cluster has "
            f"{total.get(unit, 0):g}",
            f"pass {flag} {max(1, fits)} or fewer, or add nodes",
        )
    return n, per_worker


def init_ray(address: str | None) -> bool:
    """Join the Ray cluster at ``address``, or start a local instance on loopback (None), unless this process is
    already connected; returns whether it started or joined one (the caller shuts it down when done)."""
    if not address:
        # A local instance is this machine's alone: Ray's single-node mode keeps the node address on loopback
        # (127.0.0.1), so GCS, raylet, agents and workers listen there and not on every interface, which is what
        # Ray does by default on Linux (read when ray is imported, so set before the import below).
        os.environ.setdefault(LOCAL_ONLY_ENV, "0")
    try:
        import ray
    except ImportError:
        raise ray_missing() from None
    debug = os.environ.get("KVGRAFT_DEBUG") == "1"
    if not ray.is_initialized():
        if address:
            check_reachable(address)
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage-stats notice on stderr
        _driver_output_to_stderr(debug)
        try:
            # "local": always a new instance; with no address ray.init would join whatever cluster the last
            # `ray start` on this machine recorded in /tmp/ray/ray_current_cluster (or RAY_ADDRESS).
            local = {"_node_ip_address": LOOPBACK} if not address else {}
            ray.init(
                address=address or "local",
                **local,
                include_dashboard=False,
                logging_level=logging.ERROR,
                log_to_driver=debug,
                configure_logging=True,
            )
        except Exception as e:  # noqa: BLE001  (ConnectionError, ValueError, RuntimeError: Ray's own)
            raise InputError(
                f"cannot {'join the Ray cluster at ' + address if address else 'start a local Ray instance'}: "
                f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
                "check the address (`ray status` on the cluster); a cluster with token "
                "authentication (what `ray start --head` sets up) needs RAY_AUTH_MODE=token here, "
                "with its token in ~/.ray/auth_token or RAY_AUTH_TOKEN; or run without --ray-address "
                "for a local instance",
            ) from None
        return True
    return False


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Refuse, in seconds, a cluster address where nothing listens: ray.init would retry for minutes, printing its
    own C++ warnings. Only HOST:PORT forms (with or without ray://) are probed; "auto" and the like go to Ray."""
    import socket

    hostport = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise InputError(
            f"cannot join the Ray cluster at {address}: nothing answers there "
            f"({os.strerror(e.errno) if e.errno else type(e).__name__})",
            "check the address (`ray status` on the cluster's head node prints it), or run without "
            "--ray-address for a local instance",
        ) from None


def _driver_output_to_stderr(debug: bool) -> None:
    """Ray prints its workers' output and the raylet's notices ("a worker died ...") on the driver's *stdout*, the
    CLI's --json channel, and has no setting to stop it: route them to stderr with KVGRAFT_DEBUG=1, else drop them
    (a run reports its own failures, once). Patches ray._private.worker.print_to_stdstream, where it exists, before
    ray.init binds it."""
    try:
        from ray._private import worker
    except ImportError:
        return
    original = getattr(worker, "print_to_stdstream", None)
    if original is None or getattr(original, "kvgraft", False):
        return

    def to_stderr(data, ignore_prefix):
        if debug:
            original({**data, "is_err": True}, ignore_prefix)

    to_stderr.kvgraft = True  # type: ignore[attr-defined]  # a marker on the function (mypy models none), read above
    worker.print_to_stdstream = to_stderr


def context_data(ctx) -> dict[str, Any]:
    """A RunContext as plain data for the workers: the manifest's fields (its data as overridden here) and the
    context's other fields, paths made absolute (a worker's working folder is not the driver's)."""
    m = ctx.manifest
    manifest = {f.name: getattr(m, f.name) for f in fields(m) if f.init}  # (the typed sections are made again there)
    manifest["base_dir"] = Path(manifest["base_dir"]).absolute()
    rest = {f.name: getattr(ctx, f.name) for f in fields(ctx) if f.name != "manifest"}
    rest = {k: v.absolute() if isinstance(v, Path) else v for k, v in rest.items()}
    return {"manifest": manifest, "context": rest}


def context_from_data(data: dict[str, Any]):
    from ...config.manifest import Manifest
    from ..context import RunContext

    return RunContext(Manifest(**data["manifest"]), **data["context"])


class Worker:
    """One engine in a Ray actor (wrapped by ``ray.remote`` in :meth:`RayPool.start`, so this module never imports
    Ray at its top). Loading the engine applies the manifest's pins and refuses drift; a failure is kept and
    returned as an error record by every call, never raised (a raised one would make Ray restart the actor)."""

    def __init__(self, data: dict[str, Any]):
        self.ctx = context_from_data(data)
        self.engine = None
        self.store = None
        self.facts: dict = {}
        self.error: dict | None = None
        try:
            from ...engine.engine import load_engine
            from ..context import engine_facts

            self.engine = load_engine(self.ctx.manifest, self.ctx.allow_drift)
            self.facts = engine_facts(self.engine)
        except Exception as e:  # noqa: BLE001  (every outcome is reported as a record)
            self.error = _record(e)

    def hello(self) -> dict[str, Any]:
        """The engine's ledger facts and position limit, or the error that stopped it loading."""
        if self.error:
            return {"error": self.error}
        assert self.engine is not None  # (loaded: no error was kept)
        return {"facts": self.facts, "max_positions": self.engine.max_positions}

    def run(self, job: str, items: list, args: dict[str, Any], codec: str | None) -> list[dict[str, Any]]:
        """Run ``job`` on each item of a shard: one record per item, stopping after the first error."""
        if self.error:
            return [{"error": self.error}]
        out: list[dict[str, Any]] = []
        try:
            module, _, name = JOBS[job].partition(":")
            fn = getattr(importlib.import_module(module), name)
            self.store = self.ctx.open_store(codec=codec) if codec is not None else None
        except Exception as e:  # noqa: BLE001
            return [{"error": _record(e)}]
        try:
            for item in items:
                try:
                    out.append({"ok": fn(self, item, **args)})
                except Exception as e:  # noqa: BLE001
                    out.append({"error": _record(e)})
                    break
                if job == "deposit":
                    _exit_once_for_tests()
        finally:
            if self.store is not None:
                self.store.close()
                self.store = None
        return out


def _record(e: Exception) -> dict[str, Any]:
    if os.environ.get("KVGRAFT_DEBUG") == "1" or not isinstance(e, KvgraftError):
        traceback.print_exc()  # to the worker's log (shown on the driver with KVGRAFT_DEBUG=1)
    return error_record(e)


def _exit_once_for_tests() -> None:
    """The EXIT_ONCE_ENV hook: die like a crashed worker, once per run (the first to create the file)."""
    path = os.environ.get(EXIT_ONCE_ENV)
    if not path:
        return
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.close(fd)
    os._exit(1)
