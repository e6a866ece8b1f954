"""`kvgraft deposit/solve --ray`: sharded runs on a local Ray instance record exactly what one process records.

Each Ray run starts a local instance (~3 s) and its workers (torch + the tiny embedded model, ~5 s each), so the
runs are few and shared: one single-process reference and one 2-worker Ray run of deposit and of solve --compare,
compared field by field; then a run whose worker dies mid-shard, and refusals (drift in a worker, --deposit-verified,
Ray not installed). Every test runs the CLI in a fresh process, as a user would; no Ray instance outlives a run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import EXAMPLES, MATH500, run_cli
from loopback import assert_loopback_only, listeners, watch, with_descendants

from kvgraft_cli.config.profiles import environ_without_pins

pytest.importorskip("ray")
# Run by one xdist worker, together with the other Ray/S3 tests: `ray stop` ends every Ray process on the machine,
# and one SeaweedFS server serves them all.
pytestmark = pytest.mark.xdist_group("ray-s3")

from kvgraft_cli.eval import answers  # noqa: E402
from kvgraft_cli.runs.workers.ray import EXIT_ONCE_ENV, LOCAL_ONLY_ENV  # noqa: E402

LEDGER = "kvgraft-ledger.jsonl"
STORE = "kvgraft-store"
# What differs between two runs of the same work: when each line was written, and so each line's hash chain.
VOLATILE = ("time", "prev")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def entries(d: Path) -> list[dict]:
    return [json.loads(line) for line in (d / LEDGER).read_text().splitlines()]


def stable(e: dict) -> dict:
    e = {k: v for k, v in e.items() if k not in VOLATILE}
    if e["kind"] == "solve":  # costs and the links a run happened to compute first depend on the run, not the result
        e["outputs"] = {k: v for k, v in e["outputs"].items() if k != "costs"}
        e["inputs"]["library"] = {k: v for k, v in e["inputs"]["library"].items() if k != "new_links"}
    if e["kind"] == "solve-outputs":
        e["outputs"] = {k: v for k, v in e["outputs"].items() if k != "totals"}
    return e


def objects(d: Path) -> dict[str, str]:
    """Every object file in the store: name -> SHA-256 of its bytes."""
    return {p.name: sha256(p) for p in sorted((d / STORE / "objects").rglob("*.kvg"))}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    """(problems to deposit, problems to solve): the examples, three short MATH-500 problems (reference answer:
    the solution's boxed answer) and a repeat of the first problem under another id, whose prefix is the same (the
    second record of one artifact); queries: exact hits, new problems (related hits: chains the workers build)."""
    d = tmp_path_factory.mktemp("inputs")
    rows = [json.loads(line) for line in EXAMPLES.read_text().splitlines()]
    math = [json.loads(line) for line in MATH500.read_text().splitlines()]
    short = sorted((r for r in math if answers.extract(r["answer"]) is not None), key=lambda r: len(r["answer"]))[:3]
    rows += [
        {"id": f"math-{i}", "problem": r["question"], "solution": r["answer"], "answer": answers.extract(r["answer"])}
        for i, r in enumerate(short)
    ]
    rows.append({**rows[0], "id": rows[0]["id"] + "-again"})
    queries = [{"id": r["id"], "problem": r["problem"], "answer": r["answer"]} for r in rows[:3] + rows[-3:-1]]
    queries += [
        {"id": "new-1", "problem": "What is $17 + 26$?", "answer": "43"},
        {"id": "new-2", "problem": "Simplify $\\frac{9}{12}$.", "answer": "\\frac{3}{4}"},
        {"id": "new-3", "problem": "Solve $2x + 5 = 21$ for $x$.", "answer": "8"},
    ]
    return write_jsonl(d / "problems.jsonl", rows), write_jsonl(d / "queries.jsonl", queries)


def deposit_and_solve(d: Path, problems: Path, queries: Path, *ray: str, env: dict | None = None) -> dict:
    d.mkdir()
    dep = run_cli("deposit", str(problems), "--json", *ray, cwd=d, env=env, check_rc=0)
    sol = run_cli(
        "solve", str(queries), "--compare", "--k", "2", "-o", "out.jsonl", "--json", *ray, cwd=d, env=env, check_rc=0
    )
    assert "Traceback" not in dep.stderr + sol.stderr
    return {"deposit": json.loads(dep.stdout), "solve": json.loads(sol.stdout)}


@pytest.fixture(scope="module")
def single(tmp_path_factory, inputs) -> tuple[Path, dict]:
    d = tmp_path_factory.mktemp("runs") / "single"
    return d, deposit_and_solve(d, *inputs)


@dataclass(frozen=True)
class Cluster:
    """A cluster the tests started with `ray start --head`, on loopback, in a Ray temp folder of its own."""

    address: str
    temp_dir: Path
    token: str

    def env(self) -> dict[str, str]:
        """What a client on this machine needs to join it: token authentication with the cluster's own token (no
        ~/.ray/auth_token is read or written), and Ray's single-node mode, without which Ray rewrites the address
        127.0.0.1 into this machine's network address, where the cluster does not listen."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token, LOCAL_ONLY_ENV: "0"}

    def processes(self) -> list[psutil.Process]:
        """The cluster's processes (each names the temp folder on its command line) and the workers they started."""
        mine = []
        for p in psutil.process_iter(["cmdline"]):
            if any(str(self.temp_dir) in arg for arg in p.info["cmdline"] or ()):
                mine.append(p.pid)
        return with_descendants(mine)


def _ray(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**environ_without_pins(), "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
    return subprocess.run(
        [str(Path(sys.executable).parent / "ray"), *args], capture_output=True, text=True, env=env, timeout=timeout
    )


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    """A Ray cluster someone else started (`ray start --head`, as on a head node), for the runs to join with
    --ray-address; its processes ended at the end of the module (only its own: `ray stop` would end every Ray
    process on the machine). (A local instance that kvgraft starts itself is exercised by the drift test here and
    by tests/test_s3.py's sharded deposit into S3.)"""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # A short folder of its own (Ray's unix sockets live under it; their paths are limited to 107 bytes): its
    # ray_current_cluster file is not /tmp/ray's, so no ray.init() elsewhere on the machine discovers this cluster.
    temp = Path(tempfile.mkdtemp(prefix="kvg-ray-", dir="/tmp"))
    c = Cluster(f"127.0.0.1:{port}", temp, secrets.token_hex(16))
    try:
        started = _ray(
            "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
            "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}",
            env=c.env(),
        )  # fmt: skip
        assert started.returncode == 0, started.stdout + started.stderr
        yield c
    finally:
        procs = c.processes()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(procs, timeout=3)  # an agent can outlast 10 s of SIGTERM; its folder is ours
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=10)
        shutil.rmtree(temp, ignore_errors=True)


def test_the_cluster_listens_on_loopback_only(cluster):
    """Every server of the `ray start` cluster (GCS, raylet, agents, workers) listens on 127.0.0.1 only."""
    assert_loopback_only(listeners(cluster.processes()), f"the Ray cluster at {cluster.address}")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, inputs, cluster) -> tuple[Path, dict]:
    """The Ray run, 2 workers on a running cluster (joined with --ray-address); one of them dies once mid-shard
    while depositing (the EXIT_ONCE_ENV hook: a second run just for that would double this file's time), so every
    check of it holds across a retried shard."""
    runs = tmp_path_factory.mktemp("runs")
    d = runs / "ray"
    # `ray start --head` turns on token authentication; a client joins with RAY_AUTH_MODE=token and the token, as
    # docs/STORE.md says (here the cluster's own, in RAY_AUTH_TOKEN).
    result = deposit_and_solve(
        d,
        *inputs,
        "--ray-address",
        cluster.address,
        "--workers",
        "2",
        env={EXIT_ONCE_ENV: str(runs / "died"), **cluster.env()},
    )
    return d, result


def test_a_joined_cluster_is_left_running(sharded, cluster):
    """kvgraft stops only a Ray instance it started: the cluster it joined is still up after deposit and solve."""
    status = _ray("status", f"--address={cluster.address}", timeout=60, env=cluster.env())
    assert status.returncode == 0, status.stdout + status.stderr


def test_sharded_deposit_records_what_one_process_records(single, sharded):
    (d1, r1), (d2, r2) = single, sharded
    res1, res2 = r1["deposit"]["results"], r2["deposit"]["results"]
    assert [r["status"] for r in res1].count("existing") == 1  # the repeated prefix, recorded as already stored
    keys = ("id", "line", "status", "artifact", "logits_sha256", "num_tokens", "file_bytes")
    assert [{k: r[k] for k in keys} for r in res2] == [{k: r[k] for k in keys} for r in res1]
    assert objects(d2) == objects(d1) and len(objects(d1)) >= 11
    deposits1 = [stable(e) for e in entries(d1) if e["kind"] == "deposit"]
    deposits2 = [stable(e) for e in entries(d2) if e["kind"] == "deposit"]
    assert deposits2 == deposits1  # every field, in input order: artifacts, logits, payload bytes, statuses
    run_cli("verify", "--require-files", cwd=d2, check_rc=0)


def test_sharded_solve_writes_the_same_outputs(single, sharded):
    (d1, r1), (d2, r2) = single, sharded
    for mode in ("library", "baseline"):
        out1, out2 = d1 / f"out.{mode}.jsonl", d2 / f"out.{mode}.jsonl"
        assert (
            sha256(out2) == sha256(out1) == r1["solve"][mode]["outputs_sha256"] == r2["solve"][mode]["outputs_sha256"]
        )
    hits = [r["hit"] for r in r1["solve"]["library"]["records"]]
    assert "exact" in hits and "related" in hits  # both paths ran in the workers (related: chains of 2)
    solves1 = [stable(e) for e in entries(d1) if e["kind"] != "deposit"]
    solves2 = [stable(e) for e in entries(d2) if e["kind"] != "deposit"]
    assert [e["outputs"]["output"] for e in solves2 if e["kind"] == "solve"] == [
        e["outputs"]["output"] for e in solves1 if e["kind"] == "solve"
    ]
    assert solves2 == solves1  # the rest of each entry too, in input order (costs aside)
    run_cli("verify", "--require-files", cwd=d2, check_rc=0)


def test_a_worker_that_dies_is_retried_and_recorded_once(single, sharded):
    (_, r1), (d2, r2) = single, sharded
    assert (d2.parent / "died").exists()  # a worker did exit mid-shard, after writing an object
    ids = [e["inputs"]["record"]["id"] for e in entries(d2) if e["kind"] == "deposit"]
    assert ids == [r["id"] for r in r1["deposit"]["results"] if r["status"] != "skipped"]  # once each, in order
    assert r2["deposit"]["totals"] == r1["deposit"]["totals"]
    assert [e["seq"] for e in entries(d2)] == list(range(len(entries(d2))))


def one_error_line(p: subprocess.CompletedProcess, rc: int = 2) -> str:
    assert p.returncode == rc, f"rc={p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip("\n").splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), p.stderr
    return lines[0]


def test_drift_is_refused_in_the_worker(tmp_path):
    from kvgraft_cli.config.manifest import load_manifest

    data = json.loads(json.dumps(load_manifest(None).data))
    data["runtime"]["versions"]["torch"] = "0.0.0"
    (tmp_path / "drift.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    # Run as run_cli does, watching what the local Ray instance it starts listens on while it runs.
    env = environ_without_pins()
    env.pop("KVGRAFT_DEBUG", None)
    args = ["deposit", str(EXAMPLES), "--limit", "2", "--manifest", "drift.yaml", "--ray", "--workers", "1"]
    with open(tmp_path / "out", "w+") as out, open(tmp_path / "err", "w+") as errf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvgraft_cli", *args], cwd=tmp_path, env=env, stdout=out, stderr=errf, text=True
        )
        seen = watch(proc.pid, lambda: proc.poll() is not None)
        proc.wait(timeout=600)
        out.seek(0), errf.seek(0)
        p = subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), errf.read())
    err = one_error_line(p)
    # kvgraft's own local instance (GCS, raylet, agents, the worker) listened on loopback only.
    assert "gcs_server" in {x.name for x in seen}, seen
    assert_loopback_only(seen, "kvgraft's local Ray instance")
    assert err.startswith("Error: Ray worker: effective environment differs") and "runtime.versions.torch" in err
    assert "--allow-drift" in err
    assert not (tmp_path / LEDGER).exists() and not (tmp_path / STORE).exists()


def test_deposit_verified_is_refused_on_ray(tmp_path):
    p = run_cli("solve", str(EXAMPLES), "--no-library", "--deposit-verified", "--ray", cwd=tmp_path)
    err = one_error_line(p)
    assert "--deposit-verified cannot run on Ray workers" in err and "without --ray" in err
    assert list(tmp_path.iterdir()) == []
    q = run_cli("deposit", str(EXAMPLES), "--workers", "2", cwd=tmp_path)
    assert "--workers is for Ray runs" in one_error_line(q)


# Ray blocked (as if not installed); at exit, say whether anything imported it.
BLOCK_RAY = """
import atexit, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ModuleNotFoundError(name + " is blocked in this test")
sys.meta_path.insert(0, Block())
atexit.register(lambda: print("RAY-IMPORTED" if any(m == "ray" or m.startswith("ray.") for m in sys.modules)
                              else "NO-RAY", file=sys.stderr))
sys.argv = ["kvgraft"] + sys.argv[1:]
from kvgraft_cli.cli.app import main
main()
"""


def test_the_core_never_imports_ray(tmp_path):
    def run(*args):
        return subprocess.run(
            [sys.executable, "-c", BLOCK_RAY, *args], cwd=tmp_path, capture_output=True, text=True, timeout=300
        )

    p = run("deposit", str(EXAMPLES), "--limit", "2")
    assert p.returncode == 0, p.stderr
    assert p.stderr.strip().splitlines()[-1] == "NO-RAY"
    r = run("deposit", str(EXAMPLES), "--ray")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert (
        r.stderr.splitlines()[0]
        == "Error: --ray needs Ray, which is not installed here. Hint: pip install 'kvgraft[ray]'."
    )


def test_an_address_where_nothing_listens_is_one_error_in_seconds(tmp_path):
    """ray.init would retry for minutes printing Ray's own warnings; kvgraft probes a HOST:PORT address first."""
    import socket

    with socket.socket() as s:  # a free loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = run_cli(
        "deposit",
        str(EXAMPLES),
        "--ray-address",
        f"127.0.0.1:{port}",
        "--store",
        str(tmp_path / "st"),
        "--ledger",
        str(tmp_path / "l.jsonl"),
        cwd=tmp_path,
        check_rc=2,
    )
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: cannot join the Ray cluster at 127.0.0.1:{port}"), p.stderr
    assert not (tmp_path / "st").exists() and not (tmp_path / "l.jsonl").exists()
