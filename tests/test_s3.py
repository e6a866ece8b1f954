"""The remote store on S3, against a real server (SeaweedFS on loopback, tests/seaweed.py; no mocks of S3):
deposit to s3:// and graft back from a fresh cache byte for byte, push and pull, concurrent writers' index batches,
a tampered remote object refused and never cached, one clear error line for every S3 failure, and credentials
never in any output or ledger."""

from __future__ import annotations

import hashlib
import json
import secrets
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from conftest import EXAMPLES, run_cli
from loopback import assert_loopback_only, listeners, with_descendants
from seaweed import s3_server  # noqa: F401  (the session fixture)

pytest.importorskip("boto3")
# Run by one xdist worker, together with the other Ray/S3 tests: `ray stop` ends every Ray process on the machine,
# and one SeaweedFS server serves them all.
pytestmark = pytest.mark.xdist_group("ray-s3")


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture
def aws(s3_server, monkeypatch, tmp_path):  # noqa: F811
    """This process's AWS environment pointed at the test server; a fresh kvgraft cache folder."""
    for k, v in s3_server.env(XDG_CACHE_HOME=str(tmp_path / "xdg")).items():
        monkeypatch.setenv(k, v)
    return s3_server


def new_url(server, name: str) -> str:
    return f"s3://{server.bucket}/{name}-{secrets.token_hex(4)}"


def remote_sha256(server, url: str, rel: str) -> str:
    """SHA-256 of a remote object's bytes, read straight from the server (not through kvgraft)."""
    bucket, _, prefix = url[len("s3://") :].partition("/")
    body = server.client().get_object(Bucket=bucket, Key=f"{prefix}/{rel}")["Body"].read()
    return hashlib.sha256(body).hexdigest()


def no_credentials_in(server, *texts: str) -> None:
    for text in texts:
        assert server.secret_key not in text and server.access_key not in text


def cli(server, tmp_path: Path, cache: str, *args: str) -> subprocess.CompletedProcess:
    """The CLI in a fresh process with the server's AWS environment and its own cache folder."""
    return run_cli(*args, cwd=tmp_path, env=server.env(XDG_CACHE_HOME=str(tmp_path / cache)))


def object_rel(sha: str) -> str:
    return f"objects/{sha[:2]}/{sha}.kvg"


def test_deposit_to_s3_then_graft_from_a_fresh_cache(aws, engine, tmp_path):
    from kvgraft_cli.runs.context import RunContext
    from kvgraft_cli.runs.deposit import deposit

    url = new_url(aws, "deposit")
    ctx = RunContext.make(engine.manifest, url, tmp_path / "ledger.jsonl")
    assert ctx.remote == url and ctx.store.is_dir() is False  # the cache folder appears on first open
    report = deposit(ctx, EXAMPLES, engine=engine, limit=2)
    shas = [r.artifact for r in report.results if r.status == "deposited"]
    assert len(shas) == 2
    for sha in shas:  # the remote object is the very bytes of the local object file
        assert remote_sha256(aws, url, object_rel(sha)) == sha256_file(ctx.store / object_rel(sha))
    ledger_text = (tmp_path / "ledger.jsonl").read_text()
    paths = [json.loads(line)["outputs"]["artifact"]["path"] for line in ledger_text.splitlines()]
    assert paths == [f"{url}/{object_rel(sha)}" for sha in shas]

    # Another machine: a fresh cache folder lists the store and grafts the artifact, fetched and re-hashed.
    listed = cli(aws, tmp_path, "fresh", "store", "list", "--store", url, "--json")
    assert listed.returncode == 0, listed.stderr
    assert sorted(e["artifact"] for e in json.loads(listed.stdout)["entries"]) == sorted(shas)
    grafted = cli(aws, tmp_path, "fresh2", "graft", shas[1], "--store", url, "-n", "2")
    assert grafted.returncode == 0, grafted.stderr
    cached = list((tmp_path / "fresh2").rglob(f"{shas[1]}.kvg"))
    assert len(cached) == 1 and sha256_file(cached[0]) == remote_sha256(aws, url, object_rel(shas[1]))

    # verify is offline: a remote object is a warning ("not checked: remote"), not a failure.
    verified = run_cli("verify", str(tmp_path / "ledger.jsonl"), cwd=tmp_path)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "not checked: remote" in verified.stdout
    no_credentials_in(aws, ledger_text, listed.stdout, listed.stderr, grafted.stdout, grafted.stderr, verified.stdout)


def test_push_then_pull_into_a_fresh_store(aws, deposited, tmp_path):
    c, _ = deposited
    url = new_url(aws, "push")
    pushed = cli(aws, tmp_path, "c1", "store", "push", url, "--store", str(c.store), "--json")
    assert pushed.returncode == 0, pushed.stderr
    first = json.loads(pushed.stdout)
    objects = sorted(p for p in (c.store / "objects").rglob("*.kvg"))
    assert first["copied"] == len(objects) > 0 and first["skipped"] == 0 and first["index_rows"] > 0
    again = json.loads(cli(aws, tmp_path, "c2", "store", "push", url, "--store", str(c.store), "--json").stdout)
    assert (again["copied"], again["skipped"], again["index_rows"], again["bytes"]) == (0, len(objects), 0, 0)
    for p in objects:  # what arrived is byte-identical
        assert remote_sha256(aws, url, p.relative_to(c.store).as_posix()) == sha256_file(p)

    pulled = cli(aws, tmp_path, "c3", "store", "pull", url, "--store", str(tmp_path / "pulled"), "--json")
    assert pulled.returncode == 0, pulled.stderr
    assert json.loads(pulled.stdout)["copied"] == len(objects)
    for p in objects:
        twin = tmp_path / "pulled" / p.relative_to(c.store)
        assert sha256_file(twin) == sha256_file(p)
    assert json.loads(
        cli(aws, tmp_path, "c3", "store", "pull", url, "--store", str(tmp_path / "pulled"), "--json").stdout
    )["skipped"] == len(objects)
    listing = [
        json.loads(run_cli("store", "list", "--store", str(s), "--json", cwd=tmp_path).stdout)
        for s in (c.store, tmp_path / "pulled")
    ]
    key = lambda e: e["key"]  # noqa: E731
    assert sorted(listing[0]["entries"], key=key) == sorted(listing[1]["entries"], key=key)
    assert listing[0]["stats"]["library_entries"] == listing[1]["stats"]["library_entries"] > 0
    no_credentials_in(aws, pushed.stdout, pushed.stderr, pulled.stdout, pulled.stderr)


def test_two_writers_index_batches_are_both_seen(aws, deposited, tmp_path):
    from kvgraft_cli.store.local import Store
    from kvgraft_cli.store.remote import INDEX, RemoteStore, export_rows

    c, _ = deposited
    url = new_url(aws, "writers")
    with Store(c.store, create=False) as local:
        shas = [e.artifact for e in local.entries()][:3]
        rows = {sha: export_rows(local, [sha]) for sha in shas}
        files = {sha: local.object_path(sha) for sha in shas}
    # Both writers open before either writes: neither has seen the other's batch.
    with RemoteStore(url, cache=tmp_path / "a") as a, RemoteStore(url, cache=tmp_path / "b") as b:
        for w, sha in ((a, shas[0]), (b, shas[1])):
            w.upload(sha, source=files[sha])
            w.publish(rows[sha])
        assert a.refresh() == 1 and {e.artifact for e in a.entries()} >= set(shas[:2])
    with RemoteStore(url, cache=tmp_path / "reader", create=False) as reader:
        assert {e.artifact for e in reader.entries()} >= set(shas[:2])
        newest = max(r[0] for r in reader._db.execute("SELECT name FROM remote_batches"))
        # A batch that lands late, named (by a slower writer or a skewed clock) before the newest one merged.
        t = datetime.strptime(newest.split("-")[0], "%Y%m%dT%H%M%S.%fZ") - timedelta(minutes=10)
        reader.upload(shas[2], source=files[shas[2]])
        late = t.replace(tzinfo=UTC).strftime("%Y%m%dT%H%M%S.%fZ") + "-late.jsonl"
        reader.remote.put_bytes(INDEX + late, b"".join(json.dumps(r).encode() + b"\n" for r in rows[shas[2]]))
    with RemoteStore(url, cache=tmp_path / "reader", create=False) as reader:
        assert shas[2] in {e.artifact for e in reader.entries()}


def test_tampered_remote_object_is_refused_and_not_cached(aws, deposited, tmp_path):
    from kvgraft_cli.errors import IntegrityError
    from kvgraft_cli.store import sync
    from kvgraft_cli.store.local import VERIFIED, Store
    from kvgraft_cli.store.remote import RemoteStore

    c, _ = deposited
    url = new_url(aws, "tamper")
    with Store(c.store, create=False) as local, RemoteStore(url, cache=tmp_path / "w") as remote:
        sync.push(local, remote)
        sha = local.entries()[0].artifact
    bucket, _, prefix = url[len("s3://") :].partition("/")
    client = aws.client()
    body = bytearray(client.get_object(Bucket=bucket, Key=f"{prefix}/{object_rel(sha)}")["Body"].read())
    body[len(body) // 2] ^= 0x01  # one bit, in the tensor data
    client.put_object(Bucket=bucket, Key=f"{prefix}/{object_rel(sha)}", Body=bytes(body))

    # As a fresh process would: nothing verified in memory (another test may have loaded this artifact, and a
    # verified in-memory copy is rightly served without reading any store).
    VERIFIED.clear()
    with RemoteStore(url, cache=tmp_path / "fresh", create=False) as fresh:
        with pytest.raises(IntegrityError):
            fresh.load(sha)
        assert not fresh.object_path(sha).exists()
        assert not list((tmp_path / "fresh" / "objects").rglob("*.tmp"))
        with Store(tmp_path / "pulled") as target, pytest.raises(IntegrityError):
            sync.pull(fresh, target)
        assert not (tmp_path / "pulled" / object_rel(sha)).exists()
        assert not list((tmp_path / "pulled" / "objects").rglob("*.tmp"))
    # The torch-free reader (inspect --hash) refuses it too: exit 1, one line naming the remote object.
    p = cli(aws, tmp_path, "fresh3", "inspect", sha, "--store", url, "--hash")
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stderr.count("Error:") == 1 and url in p.stderr and "Traceback" not in p.stderr
    assert not list((tmp_path / "fresh3").rglob(f"{sha}.kvg"))


def test_s3_failures_are_one_error_line(aws, tmp_path):
    url = new_url(aws, "errors")
    wrong_secret = aws.env(XDG_CACHE_HOME=str(tmp_path / "x"), AWS_SECRET_ACCESS_KEY="0" * 40)
    down = aws.env(XDG_CACHE_HOME=str(tmp_path / "x"), AWS_ENDPOINT_URL=f"http://127.0.0.1:{_closed_port()}")
    cases = [
        (wrong_secret, url, "access denied"),
        (aws.env(XDG_CACHE_HOME=str(tmp_path / "x"), AWS_ACCESS_KEY_ID="NOSUCHKEY"), url, "access denied"),
        (
            aws.env(XDG_CACHE_HOME=str(tmp_path / "x")),
            f"s3://no-such-bucket-{secrets.token_hex(3)}/p",
            "bucket does not exist",
        ),
        (down, url, "cannot reach the endpoint"),
    ]
    for env, where, why in cases:
        p = run_cli("store", "list", "--store", where, cwd=tmp_path, env=env)
        assert p.returncode == 2, p.stdout + p.stderr  # StoreError: an InputError
        assert p.stderr.count("Error:") == 1 and "Traceback" not in p.stderr, p.stderr
        assert where in p.stderr and why in p.stderr, p.stderr
        no_credentials_in(aws, p.stdout, p.stderr)
        assert "0" * 40 not in p.stderr


def test_without_boto3_a_remote_store_is_one_input_error(tmp_path):
    block = (
        "import sys\nclass B:\n    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('boto3', 'botocore'):\n            raise ImportError(name)\n"
        "sys.meta_path.insert(0, B())\nsys.argv = ['kvgraft'] + sys.argv[1:]\n"
        "from kvgraft_cli.cli.app import main\nmain()\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", block, "store", "list", "--store", "s3://bucket/prefix"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and p.stderr.count("Error:") == 1, p.stderr
    assert "pip install 'kvgraft[s3]'" in p.stderr


def test_manifest_store_may_be_an_s3_url(engine, tmp_path):
    from kvgraft_cli.config.manifest import with_overrides
    from kvgraft_cli.runs.context import RunContext

    m = with_overrides(engine.manifest, {"paths.store": "s3://bucket/some/prefix/"})
    ctx = RunContext.make(m, None, tmp_path / "l.jsonl")
    assert ctx.remote == "s3://bucket/some/prefix" and ctx.store_name == ctx.remote
    assert ctx.rel(ctx.store / "objects" / "ab" / "x.kvg") == "s3://bucket/some/prefix/objects/ab/x.kvg"
    assert ctx.rel(ctx.store / "scores.jsonl") != "s3://bucket/some/prefix/scores.jsonl"  # only objects are remote


def _closed_port() -> int:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_ray_sharded_deposit_into_s3_records_what_one_process_records(aws, deposited, tmp_path):
    """Ray workers write their objects straight to the remote store; the driver (another cache folder, as on another
    machine) indexes and records them: the same artifacts as the single-process deposit of the same file, and the
    remote objects are byte-identical to that deposit's object files."""
    pytest.importorskip("ray")
    c, report = deposited
    url = new_url(aws, "ray")
    p = cli(
        aws,
        tmp_path,
        "driver",
        "deposit",
        str(EXAMPLES),
        "--store",
        url,
        "--ledger",
        str(tmp_path / "l.jsonl"),
        "--ray",
        "--workers",
        "2",
        "--json",
    )
    assert p.returncode == 0, p.stdout + p.stderr
    sharded = [(r["id"], r["status"], r["artifact"]) for r in json.loads(p.stdout)["results"]]
    local = [(r.id, r.status, r.artifact) for r in report.results]
    assert sharded == local
    for _, status, sha in local:
        if status == "deposited":
            assert remote_sha256(aws, url, object_rel(sha)) == sha256_file(c.store / object_rel(sha))
    no_credentials_in(aws, p.stdout, p.stderr, (tmp_path / "l.jsonl").read_text())


# -- the review's findings: a bucket writer cannot redirect, hide or break what readers see ----------------------


def push_all(c, url: str, cache: Path) -> None:
    """The deposited session store, pushed to ``url`` (its objects and one honest index batch)."""
    from kvgraft_cli.store import sync
    from kvgraft_cli.store.local import Store
    from kvgraft_cli.store.remote import RemoteStore

    with Store(c.store, create=False) as local, RemoteStore(url, cache=cache) as remote:
        sync.push(local, remote)


def batch_name(tag: str, ahead: timedelta = timedelta(0)) -> str:
    """An index batch name as a writer whose clock reads now + ``ahead`` would choose it."""
    return (datetime.now(UTC) + ahead).strftime("%Y%m%dT%H%M%S.%fZ") + f"-{tag}.jsonl"


def put_batch(server, url: str, name: str, body: bytes | list[dict]) -> None:
    """Write an index batch straight to the bucket, as any writer of the bucket (not kvgraft) could."""
    if isinstance(body, list):
        body = b"".join(json.dumps(r).encode() + b"\n" for r in body)
    bucket, _, prefix = url[len("s3://") :].partition("/")
    server.client().put_object(Bucket=bucket, Key=f"{prefix}/index/{name}", Body=body)


def test_a_batch_cannot_redirect_a_key_or_rewrite_a_row_already_merged(aws, deposited, tmp_path):
    """A later batch naming an existing prefix key with another artifact (or restating an artifact or library row
    differently) is skipped and counted; the first row stands, so `sum-1` still names sum-1's artifact."""
    from kvgraft_cli.store.local import Store
    from kvgraft_cli.store.remote import RemoteStore, export_rows

    c, _ = deposited
    url = new_url(aws, "liar")
    push_all(c, url, tmp_path / "w")
    with Store(c.store, create=False) as local:
        by_id = {e.problem_id: e for e in local.entries()}
        honest, other = by_id["sum-1"], by_id["gcd-1"]
        rows = export_rows(local, [honest.artifact, other.artifact])
    entry = next(r for r in rows if r["t"] == "entry" and r["key"] == honest.key)
    art = next(r for r in rows if r["t"] == "artifact" and r["sha256"] == other.artifact)
    lib = next(r for r in rows if r["t"] == "library" and r["artifact"] == honest.artifact)
    lies = [
        {**entry},  # an honest restatement: identical, no conflict
        {**entry, "artifact": other.artifact},  # sum-1's prefix -> gcd-1's artifact
        {**art, "num_tokens": art["num_tokens"] + 1, "manifest_sha256": "0" * 64},
        {**lib, "solution": "The answer is 41."},
    ]
    put_batch(aws, url, batch_name("liar"), lies)

    with RemoteStore(url, cache=tmp_path / "fresh", create=False) as fresh:
        assert fresh.resolve("sum-1", c.manifest.compute_sha256) == honest.artifact
        assert fresh.lookup_key(honest.key).artifact == honest.artifact
        a = fresh._db.execute(
            "SELECT num_tokens, manifest_sha256 FROM artifacts WHERE sha256 = ?", (other.artifact,)
        ).fetchone()
        assert a == (art["num_tokens"], art["manifest_sha256"])
        (solution,) = fresh._db.execute(
            "SELECT solution FROM library WHERE artifact = ?", (honest.artifact,)
        ).fetchone()
        assert solution == lib["solution"]
        assert [(x["batch"].endswith("-liar.jsonl"), x["rows"]) for x in fresh.conflicts] == [(True, 3)]

    # As `kvgraft graft sum-1 --store URL` would pick it: the CLI resolves sum-1 to its own artifact, and says
    # (once, on stderr) that a batch's rows were refused; --json carries the count.
    p = cli(aws, tmp_path, "fresh2", "inspect", "sum-1", "--store", url, "--hash", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["sha256"] == honest.artifact
    s = cli(aws, tmp_path, "fresh2", "store", "stats", "--store", url, "--json")
    assert s.returncode == 0, s.stderr
    assert [x["rows"] for x in json.loads(s.stdout)["conflicting_rows"]] == [3]
    assert s.stderr.count("warning:") == 1 and "-liar.jsonl" in s.stderr, s.stderr


def test_a_future_dated_batch_hides_no_later_batch(aws, deposited, tmp_path):
    """A batch named hours ahead (a writer with a fast clock) must not blind a reader to the batches written after."""
    from kvgraft_cli.store.local import Store
    from kvgraft_cli.store.remote import RemoteStore, export_rows

    c, _ = deposited
    url = new_url(aws, "clock")
    with Store(c.store, create=False) as local:
        a, b = [e.artifact for e in local.entries()][:2]
        rows = {sha: export_rows(local, [sha]) for sha in (a, b)}
        files = {sha: local.object_path(sha) for sha in (a, b)}
    with RemoteStore(url, cache=tmp_path / "w") as w:
        for sha in (a, b):
            w.upload(sha, source=files[sha])
    put_batch(aws, url, batch_name("fastclock", timedelta(hours=4)), rows[a])
    with RemoteStore(url, cache=tmp_path / "reader", create=False) as reader:
        assert {e.artifact for e in reader.entries()} == {a}
    with RemoteStore(url, cache=tmp_path / "w") as w:  # an honest writer, now
        w.publish(rows[b])
    with RemoteStore(url, cache=tmp_path / "reader", create=False) as reader:
        assert {e.artifact for e in reader.entries()} == {a, b}


def test_a_malformed_batch_is_skipped_reported_and_read_once_fixed(aws, deposited, tmp_path):
    """A malformed batch (or one with a row type this kvgraft does not know) is skipped, not marked merged, and
    reported by `store stats` / `store list` (one warning line each; --json lists it); every command still works,
    and once the batch is readable a later open merges it."""
    from kvgraft_cli.store.local import Store
    from kvgraft_cli.store.remote import RemoteStore, export_rows

    c, _ = deposited
    url = new_url(aws, "malformed")
    push_all(c, url, tmp_path / "w")
    bad, newer = batch_name("bad"), batch_name("newer")
    put_batch(aws, url, bad, b'{"t":"nope"}\n')
    with Store(c.store, create=False) as local:
        n = len(local.entries())
        good = export_rows(local, [local.entries()[0].artifact])
    put_batch(aws, url, newer, good + [{"t": "signature", "by": "a newer kvgraft"}])

    with RemoteStore(url, cache=tmp_path / "r", create=False) as r:
        assert len(r.entries()) == n
        skipped = {x["batch"]: x["reason"] for x in r.skipped_batches}
        assert set(skipped) == {f"{url}/index/{bad}", f"{url}/index/{newer}"}, skipped
        assert "nope" in skipped[f"{url}/index/{bad}"] and "signature" in skipped[f"{url}/index/{newer}"]
        merged = {x[0] for x in r._db.execute("SELECT name FROM remote_batches")}
        assert bad not in merged and newer not in merged

    for args in (("store", "stats"), ("store", "list")):
        p = cli(aws, tmp_path, "r2", *args, "--store", url)
        assert p.returncode == 0, p.stderr
        warnings = [line for line in p.stderr.splitlines() if line.startswith("warning:")]
        assert len(warnings) == 2 and "Error" not in p.stderr, p.stderr
        assert any(bad in w for w in warnings) and any(newer in w for w in warnings)
        j = cli(aws, tmp_path, "r2", *args, "--store", url, "--json")
        assert j.returncode == 0, j.stderr
        data = json.loads(j.stdout)
        assert sorted(x["batch"] for x in data["skipped_batches"]) == sorted(f"{url}/index/{x}" for x in (bad, newer))
    g = cli(aws, tmp_path, "r3", "inspect", "sum-1", "--store", url, "--json")
    assert g.returncode == 0, g.stderr

    put_batch(aws, url, bad, good)  # repaired (as a later kvgraft would read it): merged on the next open
    with RemoteStore(url, cache=tmp_path / "r", create=False) as r:
        assert [x["batch"] for x in r.skipped_batches] == [f"{url}/index/{newer}"]
        assert bad in {x[0] for x in r._db.execute("SELECT name FROM remote_batches")}


def endpoint_failures(server, tmp_path: Path, url: str, endpoint: str) -> list[subprocess.CompletedProcess]:
    """`store stats` and `store list` on ``url`` through ``endpoint``, each checked to be one Error line, exit 2."""
    runs = []
    for args in (("store", "stats"), ("store", "list")):
        p = run_cli(
            *args,
            "--store",
            url,
            cwd=tmp_path,
            env=server.env(XDG_CACHE_HOME=str(tmp_path / "x"), AWS_ENDPOINT_URL=endpoint),
        )
        assert p.returncode == 2, p.stdout + p.stderr
        assert p.stderr.count("Error:") == 1 and "Traceback" not in p.stderr, p.stderr
        assert "internal error" not in p.stderr and url in p.stderr, p.stderr
        no_credentials_in(server, p.stdout, p.stderr)
        runs.append(p)
    return runs


def test_an_invalid_endpoint_is_one_error_line_naming_the_url(aws, tmp_path):
    url = new_url(aws, "endpoint")
    for endpoint in ("not a url", "http://", "http://user:hunter2@[bad"):
        for p in endpoint_failures(aws, tmp_path, url, endpoint):
            assert "not a usable endpoint URL" in p.stderr and "hunter2" not in p.stdout + p.stderr, p.stderr


def test_a_password_in_the_endpoint_is_never_printed(aws, tmp_path):
    url = new_url(aws, "endpoint")
    port = _closed_port()
    for p in endpoint_failures(aws, tmp_path, url, f"http://user:hunter2@127.0.0.1:{port}"):
        assert f"cannot reach the endpoint http://127.0.0.1:{port}" in p.stderr, p.stderr
        assert "hunter2" not in p.stdout + p.stderr and "user:" not in p.stderr, p.stderr


def test_a_failed_open_leaves_no_cache_folder(aws, tmp_path):
    from kvgraft_cli.errors import InputError, StoreError
    from kvgraft_cli.store.remote import RemoteStore

    with pytest.raises(InputError, match="no store at"):
        RemoteStore(new_url(aws, "empty"), create=False, cache=tmp_path / "c1")
    assert not (tmp_path / "c1").exists()
    with pytest.raises(StoreError, match="bucket does not exist"):
        RemoteStore(f"s3://no-such-bucket-{secrets.token_hex(3)}/p", cache=tmp_path / "c2")
    assert not (tmp_path / "c2").exists()
    # The CLI, with the default cache location: nothing left under it either, however often it fails.
    for where in (new_url(aws, "empty"), f"s3://no-such-bucket-{secrets.token_hex(3)}/p"):
        for _ in range(2):
            p = cli(aws, tmp_path, "xdg", "store", "list", "--store", where)
            assert p.returncode == 2, p.stderr
    remote = tmp_path / "xdg" / "kvgraft" / "remote"
    assert not remote.exists() or not list(remote.iterdir())
    # An existing cache folder (a store opened before) stays.
    url = new_url(aws, "kept")
    with RemoteStore(url, cache=tmp_path / "c3") as s:
        s.publish([])  # nothing: no batch, so the prefix still holds no store
    with pytest.raises(InputError):
        RemoteStore(url, create=False, cache=tmp_path / "c3")
    assert (tmp_path / "c3" / "index.sqlite").is_file()


def test_the_server_listens_on_loopback_only(aws):
    """Every port SeaweedFS opens (master, volume, filer, S3, and their gRPC ports) is on 127.0.0.1."""
    found = listeners(with_descendants([aws.pid]))
    assert len({x.port for x in found}) >= 8, found  # the eight ports start_server gives it, at least
    assert_loopback_only(found, "SeaweedFS")


def test_two_servers_share_the_prompt_cache_through_the_bucket(s3_server, tmp_path):  # noqa: F811
    """`kvgraft serve --store s3://...`: what one server deposits as prompt chunks, another (its own local cache,
    another folder) restores from the bucket, re-hashed, with the same first-token logits and generated ids, while
    the first still runs: it publishes its index rows after the answer (--sync-every 0), not only when it stops."""
    import yaml
    from conftest import REPO
    from serving import start

    manifest = yaml.safe_load((REPO / "kvgraft_cli" / "data" / "default.yaml").read_text())
    manifest["prefill"] = {"schedule": "chunked", "chunk_size": 16}
    url = new_url(s3_server, "serve")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    body = {"model": manifest["name"], "prompt": "Problem: one plus one and two times five " * 6, "max_tokens": 6}
    got, servers = [], []
    try:
        for name in ("a", "b"):
            folder = tmp_path / name
            folder.mkdir()
            (folder / "serve.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
            env = s3_server.env(XDG_CACHE_HOME=str(folder / "xdg"))
            servers.append(start(folder, "-m", "serve.yaml", "--store", url, "--sync-every", "0", env=env))
            status, data = servers[-1].post("/v1/completions", body)
            assert status == 200, data
            got.append(data["kvgraft"])
            deadline = time.monotonic() + 60  # the batch goes up after the answer has left: wait for it, not a time
            while time.monotonic() < deadline:
                listed = s3_server.client().list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/index/")
                if listed.get("KeyCount", 0):
                    break
                time.sleep(0.1)
    finally:
        for s in servers:
            assert s.stop() == 0
    assert got[0]["cached_tokens"] == 0 and len(got[0]["prompt_cache"]["deposited"]) == 15
    assert got[1]["cached_tokens"] == 240 and got[1]["prompt_cache"]["chunks"] == got[0]["prompt_cache"]["deposited"]
    assert [g["first_logits_sha256"] for g in got] == [got[0]["first_logits_sha256"]] * 2
    assert [g["generated_ids_sha256"] for g in got] == [got[0]["generated_ids_sha256"]] * 2


def test_replicas_behind_one_endpoint_share_the_bucket_and_write_one_ledger(s3_server, tmp_path):  # noqa: F811
    """`kvgraft serve --replicas 2 --store s3://...`: two engines in Ray actors (a local instance, on loopback like
    the endpoint) behind one address, talked to by the openai client (streaming) and plain HTTP, 4 at a time: every
    request answered, both replicas used, the prompt chunks one deposited restored by whichever answers next from
    the bucket; a replica killed comes back (Ray restarts it) and serves again; a client that disconnects mid-stream
    cancels its decode; one ledger line per answered request in the front's
    one ledger, `verify` passing, and `replay --served` computing every request again in one process, the cache off,
    with every hash equal. SIGTERM drains and ends the replicas."""
    from concurrent.futures import ThreadPoolExecutor

    import openai
    import yaml
    from conftest import REPO
    from serving import ledger_lines, start

    manifest = yaml.safe_load((REPO / "kvgraft_cli" / "data" / "default.yaml").read_text())
    manifest["prefill"] = {"schedule": "chunked", "chunk_size": 16}
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    env = s3_server.env(XDG_CACHE_HOME=str(tmp_path / "xdg"))
    url = new_url(s3_server, "replicas")
    s = start(tmp_path, "-m", "serve.yaml", "--store", url, "--replicas", "2", "--replica-restarts", "1", env=env)
    model, shared = manifest["name"], "Problem: one plus one and two times five " * 5
    try:
        assert s.said("; 2 replicas (Ray))"), s.stderr  # the start line says so
        assert_loopback_only(listeners(with_descendants([s.proc.pid])), "kvgraft serve --replicas 2 and its Ray")
        status, first = s.post("/v1/completions", {"model": model, "prompt": shared + "first", "max_tokens": 4})
        assert (
            status == 200 and first["kvgraft"]["cached_tokens"] == 0 and first["kvgraft"]["prompt_cache"]["deposited"]
        )
        client = openai.OpenAI(base_url=s.base, api_key="unused", max_retries=0)

        def ask(i: int) -> dict:
            prompt = shared + f"variant {i}"
            if i % 2:  # streamed: the text comes in pieces, the kvgraft object with the last chunk
                pieces = list(client.completions.create(model=model, prompt=prompt, max_tokens=5, stream=True))
                return pieces[-1].model_extra["kvgraft"]
            status, data = s.post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 5})
            assert status == 200, data
            return data["kvgraft"]

        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, range(8)))
        assert all(a["cached_tokens"] >= 160 for a in answers)  # the shared chunks, from memory or the bucket
        _, _, body = s.request("GET", "/health")
        per_replica = json.loads(body)["replicas"]
        assert sum(per_replica) == 9 and min(per_replica) > 0, per_replica
        # a replica killed: Ray restarts it, its engine loads again, and both serve (at most the one request it
        # was sent while dead fails, with a 500 and no ledger line)
        (victim,) = [p for p in with_descendants([s.proc.pid]) if "ray::Replica" in " ".join(p.cmdline())][:1]
        victim.kill()
        statuses = [s.post("/v1/completions", {"model": model, "prompt": shared + f"again {i}", "max_tokens": 3})[0]
                    for i in range(6)]  # fmt: skip
        assert statuses.count(200) >= 5 and set(statuses) <= {200, 500}, statuses
        _, _, body = s.request("GET", "/health")
        assert json.loads(body)["replicas_retired"] == [None, None]
        answered = sum(json.loads(body)["replicas"])
        # a client that goes away mid-stream: the front cancels the replica's decode within a step. The prompt is the
        # one found that the tiny model decodes longest before its end of text (772 tokens, 1.8 s alone on the Zen 4
        # EPYC; "Count to a thousand." ends at 307 and once finished before the front saw the client leave)
        stream = client.completions.create(model=model, prompt="1 2 3 4 5 6 7 8 9 10", max_tokens=20000, stream=True)
        next(iter(stream))
        stream.close()
        deadline = time.monotonic() + 60
        while len(ledger_lines(tmp_path / "kvgraft-ledger.jsonl")) < answered + 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        # out of restarts (--replica-restarts 1; the replica killed above used its one): both killed again, 4 clients
        # at a time (so each replica's thread takes a request), the one without a restart left is retired, /health
        # says why, and the other comes back and serves; killed once more, it is retired too: a 503, nothing queued
        replicas = lambda: [p for p in with_descendants([s.proc.pid]) if "ray::Replica" in " ".join(p.cmdline())]  # noqa: E731
        for p in replicas():
            p.kill()

        def status(i: int) -> int:
            return s.post("/v1/completions", {"model": model, "prompt": shared + f"late {i}", "max_tokens": 2})[0]

        with ThreadPoolExecutor(4) as pool:
            statuses = list(pool.map(status, range(8)))
        assert statuses.count(500) <= 2 and statuses.count(200) >= 5 and set(statuses) <= {200, 500}, (
            statuses,
            s.request("GET", "/health")[2],
        )
        _, _, body = s.request("GET", "/health")
        retired = json.loads(body)["replicas_retired"]
        assert sum(r is not None for r in retired) == 1 and "died" in next(r for r in retired if r), retired
        late = statuses.count(200)
        for p in replicas():
            p.kill()
        statuses = [status(100 + i) for i in range(3)]
        assert statuses[0] == 500 and statuses[1:] == [503, 503], statuses
        code, _, body = s.request("GET", "/health")
        assert all(json.loads(body)["replicas_retired"]), body
    finally:
        assert s.stop() == 0
    assert not [p for p in with_descendants([s.proc.pid]) if p.is_running()]
    lines = ledger_lines(tmp_path / "kvgraft-ledger.jsonl")
    # the front's lines alone, one per answered request (a replica writes none; a failed request has none)
    assert [e["kind"] for e in lines] == ["serve"] * (answered + 1 + late)
    cancelled = lines[answered]["outputs"]
    assert cancelled["finish_reason"] == "cancelled" and cancelled["costs"]["decode_tokens"] < 20000
    run_cli("verify", "-m", "serve.yaml", cwd=tmp_path, env=env, check_rc=0)
    p = run_cli("replay", "--served", "kvgraft-ledger.jsonl", "--json", cwd=tmp_path, env=env, check_rc=0)
    assert json.loads(p.stdout)["matched"] == answered + 1 + late  # the cancelled one: the tokens it decoded


def test_replicas_on_other_nodes_have_their_prompt_chunks_published_and_shared(aws, tmp_path):
    """`kvgraft serve --replicas` across nodes, each node with a disk of its own: a replica indexes the prompt chunks
    it deposits in its own node's cache, which the front (which writes the ledger and publishes the index) never
    reads. Here three caches on one bucket stand for three nodes: two replicas' servers (answers not recorded where
    they are computed, as in a Ray actor) and the front's recorder. The front indexes a replica's chunks from the
    rows sent with its answer, records and publishes them (--sync-every 0); the other replica reads the batch before
    its next lookup and restores the chunks from the bucket with the same first-token logits as computing them;
    and a reader with a fresh cache finds every chunk. Without the rows, nothing reaches the bucket's index."""
    import yaml
    from conftest import REPO

    from kvgraft_cli.config.manifest import load_manifest
    from kvgraft_cli.engine.engine import load_engine
    from kvgraft_cli.runs.context import RunContext
    from kvgraft_cli.serve.answer import Options, Recorder, Server, sync
    from kvgraft_cli.serve.protocol import parse
    from kvgraft_cli.store.remote import RemoteStore

    data = yaml.safe_load((REPO / "kvgraft_cli" / "data" / "default.yaml").read_text())
    data["prefill"] = {"schedule": "chunked", "chunk_size": 16}
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    manifest = load_manifest(tmp_path / "serve.yaml")
    engine = load_engine(manifest)
    url = new_url(aws, "nodes")
    ledger = tmp_path / "ledger.jsonl"

    def node(name: str) -> RunContext:
        return RunContext(manifest, tmp_path / name, ledger, remote=url)

    options = Options(warm_bytes=0, sync_every=0)
    replicas = [Server(node(f"node{i}"), engine, options) for i in (1, 2)]
    for r in replicas:
        r.open()
    front = node("front").open_store()
    recorder = Recorder(node("front"), replicas[0].facts, options, 16, tmp_path / "requests.jsonl")
    shared = "Problem: one plus one and two times five " * 5

    def ask(replica: Server, prompt: str, every: float = 0):
        body = {"model": data["name"], "prompt": prompt, "max_tokens": 3}
        req = parse(json.dumps(body).encode(), "completion")
        ans = replica.answer(req, record=False)  # as a replica computes it
        ans = recorder.record(front, req, ans, 0.0, time.perf_counter())  # as the front records it
        sync(front.publish_due, every, "publish")
        return ans

    def published() -> set[str]:
        reader = RemoteStore(url, cache=tmp_path / secrets.token_hex(4))  # a fresh cache: the bucket's index alone
        try:
            return set(reader.prompt_chunks(manifest.compute_sha256))
        finally:
            reader.close()

    try:
        first = ask(replicas[0], shared + "first")
        assert first.cached_tokens == 0 and len(first.deposited_chunks) >= 10
        again = ask(replicas[1], shared + "first")  # the other node: from the bucket, not computed
        assert again.cache_chunks == first.deposited_chunks and not again.deposited_chunks
        assert again.first_logits_sha256 == first.first_logits_sha256 and again.ids == first.ids
        assert published() == set(first.deposited_chunks)
        # within the period (--sync-every 3600) the rows wait in the front; it publishes them when it closes
        late = ask(replicas[1], "Another problem entirely, asked later " * 5, every=3600)
        assert late.deposited_chunks and published() == set(first.deposited_chunks)
    finally:
        for r in replicas:
            r.close()
        front.close()
    assert published() == set(first.deposited_chunks) | set(late.deposited_chunks)


def test_rows_recorded_before_a_kill_are_published_by_the_next_open(aws, tmp_path):
    """A writer killed between a ledger line and its next index batch (a server between two --sync-every periods)
    leaves the recorded artifacts noted in its cache (remote_unpublished): the next open of that cache queues them
    again and publishes them, so a recorded prompt chunk is never left out of the bucket's index for good."""
    import yaml
    from conftest import REPO

    from kvgraft_cli.config.manifest import load_manifest
    from kvgraft_cli.engine.engine import load_engine
    from kvgraft_cli.serve import promptcache
    from kvgraft_cli.store.local import Store
    from kvgraft_cli.store.remote import RemoteStore

    data = yaml.safe_load((REPO / "kvgraft_cli" / "data" / "default.yaml").read_text())
    data["prefill"] = {"schedule": "chunked", "chunk_size": 16}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    engine = load_engine(load_manifest(tmp_path / "m.yaml"))
    url = new_url(aws, "killed")

    def published() -> set[str]:
        reader = RemoteStore(url, cache=tmp_path / secrets.token_hex(4))
        try:
            return set(reader.prompt_chunks(engine.manifest.compute_sha256))
        finally:
            reader.close()

    writer = RemoteStore(url, cache=tmp_path / "writer")
    pre = promptcache.prefill(engine, writer, engine.prefix_ids("Problem: one plus one and two times five " * 5), 16)
    writer.mark_recorded(pre.deposited)  # what a ledger line's append does after it is written
    assert len(pre.deposited) >= 10
    Store.close(writer)  # killed: its connection gone, no flush
    assert published() == set()
    RemoteStore(url, cache=tmp_path / "writer").close()  # the next open, say the restarted server's
    assert published() == set(pre.deposited)
