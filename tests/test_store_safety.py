"""No artifact a ledger line names is ever lost: failed appends, concurrent writers, crashes, a full disk, a
read-only store; `store gc` deletes only what nothing names; `verify` says loudly what it could not check."""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import EXAMPLES, REPO, deposit_here, run_cli

from kvgraft_cli.config.profiles import environ_without_pins

# Process A of the race: deposits, then (with its object and index rows in the store) signals and waits in the
# ledger append until process B has recorded the same artifact, then fails the append as Ctrl-C would.
FAILING_APPEND = """
import sys, time
from pathlib import Path
from kvgraft_cli.ledger import log

stored, other_done = Path(sys.argv[1]), Path(sys.argv[2])

def append(path, kind, body, **hooks):
    stored.touch()
    deadline = time.time() + 300
    while not other_done.exists() and time.time() < deadline:
        time.sleep(0.05)
    raise KeyboardInterrupt

log.append = append
sys.argv = ["kvgraft"] + sys.argv[3:]
from kvgraft_cli.cli.app import main
main()
"""

# A run killed in its ledger append (power cut, SIGKILL): the object and index rows are there, no ledger line.
CRASHING_APPEND = """
import os, sys
from kvgraft_cli.ledger import log

def append(path, kind, body, **hooks):
    os._exit(137)

log.append = append
sys.argv = ["kvgraft"] + sys.argv[1:]
from kvgraft_cli.cli.app import main
main()
"""


def _python(script: str, *args: str, cwd: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        cwd=cwd,
        env=environ_without_pins(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def _one_problem(folder: Path) -> Path:
    p = folder / "one.jsonl"
    p.write_text(EXAMPLES.read_text().splitlines()[0] + "\n")
    return p


@pytest.fixture(scope="module")
def one_deposited(tmp_path_factory, engine) -> Path:
    """A folder with the first example (one.jsonl) deposited into store s with ledger l.jsonl (in this process: the
    bytes the CLI writes): made once, and copied into each test that starts from it."""
    d = tmp_path_factory.mktemp("one-deposited")
    _one_problem(d)
    deposit_here(engine, d, "one.jsonl", store="s", ledger="l.jsonl")
    return d


def _from(deposited: Path, folder: Path) -> None:
    """``one_deposited``'s files, copied into ``folder`` (the store's files and its index alike)."""
    shutil.copytree(deposited, folder, dirs_exist_ok=True)


def _objects(store: Path) -> list[Path]:
    return sorted((store / "objects").rglob("*.kvg"))


def test_failed_append_never_deletes_what_a_concurrent_deposit_recorded(tmp_path, engine):
    """Two real processes deposit the same problem; A's append fails after B recorded the artifact. The artifact
    B's ledger line names must still be there (the old rollback deleted it, and verify still passed)."""
    _one_problem(tmp_path)
    stored, b_done = tmp_path / "a-stored", tmp_path / "b-done"
    a = _python(
        FAILING_APPEND,
        str(stored),
        str(b_done),
        "deposit",
        "one.jsonl",
        "--store",
        "s",
        "--ledger",
        "a.jsonl",
        cwd=tmp_path,
    )
    try:
        deadline = time.time() + 300
        while not stored.exists():
            assert a.poll() is None, a.communicate()
            assert time.time() < deadline
            time.sleep(0.1)
        r = run_cli("deposit", "one.jsonl", "--store", "s", "--ledger", "b.jsonl", "--json", cwd=tmp_path, check_rc=0)
        (result,) = json.loads(r.stdout)["results"]
        # B wrote no object, but its line is the first to record the artifact: "deposited".
        assert result["status"] == "deposited"
        b_done.touch()
        _, err = a.communicate(timeout=300)
    finally:
        b_done.touch()
        if a.poll() is None:
            a.kill()
    assert a.returncode != 0 and "Traceback" not in err
    assert not (tmp_path / "a.jsonl").exists() or (tmp_path / "a.jsonl").read_bytes() == b""
    assert [p.stem for p in _objects(tmp_path / "s")] == [result["artifact"]]
    run_cli("verify", "b.jsonl", "--full", "--require-files", cwd=tmp_path, check_rc=0)
    # B again: the artifact is recorded now, so the line says "existing".
    again = deposit_here(engine, tmp_path, "one.jsonl", store="s", ledger="b.jsonl")
    assert again.results[0].status == "existing"


def test_the_first_record_after_a_crash_says_deposited(tmp_path, engine):
    """A run killed in its append leaves an object without a ledger line; the next run's line is the first record
    of that artifact and must say so (it said "existing", although no ledger line had ever recorded it)."""
    _one_problem(tmp_path)
    a = _python(CRASHING_APPEND, "deposit", "one.jsonl", "--store", "s", "--ledger", "l.jsonl", cwd=tmp_path)
    a.communicate(timeout=300)
    assert a.returncode == 137 and len(_objects(tmp_path / "s")) == 1
    r = run_cli("deposit", "one.jsonl", "--store", "s", "--ledger", "l.jsonl", "--json", cwd=tmp_path, check_rc=0)
    assert json.loads(r.stdout)["results"][0]["status"] == "deposited"
    assert deposit_here(engine, tmp_path, "one.jsonl", store="s", ledger="l.jsonl").results[0].status == "existing"
    entries = [json.loads(x) for x in (tmp_path / "l.jsonl").read_text().splitlines()]
    assert [e["status"] for e in entries] == ["deposited", "existing"]


def test_a_store_from_before_recording_reads_its_artifacts_as_recorded(tmp_path, one_deposited, engine):
    """A store made before the ``recorded`` column: opening it for writing adds the column, and its artifacts
    count as recorded (so a re-deposit says "existing", as it did)."""
    _from(one_deposited, tmp_path)
    import sqlite3

    db = sqlite3.connect(tmp_path / "s" / "index.sqlite")
    db.execute("ALTER TABLE artifacts DROP COLUMN recorded")
    db.commit()
    db.close()
    assert deposit_here(engine, tmp_path, "one.jsonl", store="s", ledger="l.jsonl").results[0].status == "existing"


def _old(path: Path, seconds: float = 7200) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_store_gc_deletes_only_what_nothing_names(tmp_path, engine):
    problems = tmp_path / "two.jsonl"
    problems.write_text("".join(EXAMPLES.read_text().splitlines(keepends=True)[:2]))
    deposit_here(engine, tmp_path, "two.jsonl", store="s", ledger="l.jsonl")
    store = tmp_path / "s"
    indexed = _objects(store)
    for p in indexed:
        _old(p)
    sub = store / "objects" / "ab"
    sub.mkdir()
    stale_tmp = sub / f".{'ab' * 32}.kvg.x1.tmp"
    fresh_tmp = sub / f".{'ab' * 32}.kvg.x2.tmp"
    orphan = sub / f"{'ab' * 32}.kvg"
    named = sub / f"{'ab' * 31}cd.kvg"
    fresh_orphan = sub / f"{'ab' * 31}ef.kvg"
    for p in (stale_tmp, fresh_tmp, orphan, named, fresh_orphan):
        p.write_bytes(b"x" * 100)
    for p in (stale_tmp, orphan, named):
        _old(p)
    # Another ledger names `named` (e.g. a ledger line whose index row was lost): it must stay.
    (tmp_path / "other.jsonl").write_text(json.dumps({"outputs": {"artifact": {"sha256": named.stem}}}) + "\n")
    r = run_cli(
        "store",
        "gc",
        "--store",
        "s",
        "--ledger",
        "l.jsonl",
        "--ledger",
        "other.jsonl",
        "--dry-run",
        "--json",
        cwd=tmp_path,
        check_rc=0,
    )
    dry = json.loads(r.stdout)
    assert dry["deleted"] is False and orphan.exists() and stale_tmp.exists()
    r = run_cli(
        "store",
        "gc",
        "--store",
        "s",
        "--ledger",
        "l.jsonl",
        "--ledger",
        "other.jsonl",
        "--json",
        cwd=tmp_path,
        check_rc=0,
    )
    got = json.loads(r.stdout)
    assert got["temporary"] == dry["temporary"] == [str(Path("s") / "objects" / "ab" / stale_tmp.name)]
    assert got["unindexed"] == [str(Path("s") / "objects" / "ab" / orphan.name)]
    assert got["kept_for_ledger"] == [named.stem] and got["bytes"] == 200
    assert not stale_tmp.exists() and not orphan.exists()
    assert fresh_tmp.exists() and fresh_orphan.exists() and named.exists()  # within the grace period, or named
    assert all(p.exists() for p in indexed)
    run_cli("verify", "l.jsonl", "--full", "--require-files", cwd=tmp_path, check_rc=0)
    # With no grace, the fresh orphan goes too; the named one never does.
    run_cli("store", "gc", "--store", "s", "--ledger", "other.jsonl", "--grace", "0", cwd=tmp_path, check_rc=0)
    assert not fresh_orphan.exists() and named.exists() and all(p.exists() for p in indexed)


def test_a_full_disk_is_one_line_and_leaves_nothing_half_written(tmp_path, one_deposited):
    """Writing an object fails (here: the file size limit, EFBIG, as ENOSPC would): exit 2, one line, no
    temporary file, no index row, no ledger line."""
    _from(one_deposited, tmp_path)
    problems = tmp_path / "two.jsonl"
    problems.write_text("".join(EXAMPLES.read_text().splitlines(keepends=True)[1:3]))
    before = sorted(p.name for p in (tmp_path / "s").rglob("*") if p.is_file())
    ledger_before = (tmp_path / "l.jsonl").read_bytes()

    def limit():  # objects are ~85 KB; the index and the ledger already exist and stay under this
        resource.setrlimit(resource.RLIMIT_FSIZE, (70_000, 70_000))

    env = environ_without_pins()
    p = subprocess.run(
        [sys.executable, "-m", "kvgraft_cli", "deposit", "two.jsonl", "--store", "s", "--ledger", "l.jsonl"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        preexec_fn=limit,
        timeout=600,
    )
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("Error: cannot write to store s: File too large"), p.stderr
    assert "Traceback" not in p.stderr and "internal error" not in p.stderr
    assert sorted(x.name for x in (tmp_path / "s").rglob("*") if x.is_file()) == before  # (an empty folder may stay)
    assert (tmp_path / "l.jsonl").read_bytes() == ledger_before
    run_cli("verify", "l.jsonl", "--full", "--require-files", cwd=tmp_path, check_rc=0)


def _without_root_powers():
    """preexec_fn: as root, drop the capabilities that write through permission bits (CAP_DAC_OVERRIDE,
    CAP_DAC_READ_SEARCH, CAP_FOWNER) from the child's bounding set, so a read-only folder is read-only to it."""
    if os.geteuid() != 0:
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2, 3):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_a_read_only_store_serves_reads_and_refuses_writes_in_one_line(tmp_path, one_deposited):
    try:
        subprocess.run([sys.executable, "-c", "pass"], preexec_fn=_without_root_powers, check=True)
    except (OSError, subprocess.SubprocessError) as e:  # a root that may not drop capabilities: cannot be read-only
        pytest.skip(f"cannot make a folder read-only to this process ({e})")
    _from(one_deposited, tmp_path)
    (tmp_path / "two.jsonl").write_text("".join(EXAMPLES.read_text().splitlines(keepends=True)[1:3]))
    store = tmp_path / "s"
    try:
        for p in [store, *store.rglob("*")]:
            p.chmod(0o555 if p.is_dir() else 0o444)

        def run(*args):
            return subprocess.run(
                [sys.executable, "-m", "kvgraft_cli", *args],
                cwd=tmp_path,
                env=environ_without_pins(),
                capture_output=True,
                text=True,
                preexec_fn=_without_root_powers,
                timeout=600,
            )

        w = run("deposit", "two.jsonl", "--store", "s", "--ledger", "l.jsonl")
        assert w.returncode == 2 and w.stderr.startswith("Error: cannot "), w.stderr
        assert "readonly" in w.stderr or "Read-only" in w.stderr or "Permission denied" in w.stderr, w.stderr
        assert "Traceback" not in w.stderr and len((tmp_path / "l.jsonl").read_text().splitlines()) == 1
        r = run("store", "list", "--store", "s", "--json")
        assert r.returncode == 0, r.stderr
        g = run("graft", "--store", "s", "--ledger", "l.jsonl", "--json")
        assert g.returncode == 0, g.stderr
        g = run("solve", "one.jsonl", "--store", "s", "--ledger", "l.jsonl", "--outputs", "out.jsonl", "--json")
        assert g.returncode == 0 and json.loads(g.stdout)["library"]["records"][0]["hit"] == "exact", g.stderr
    finally:
        for p in [store, *store.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)


def test_a_torn_ledger_refusal_names_ledger_repair(tmp_path):
    _one_problem(tmp_path)
    (tmp_path / "l.jsonl").write_bytes(b'{"seq":0')
    r = run_cli("deposit", "one.jsonl", "--store", "s", "--ledger", "l.jsonl", cwd=tmp_path, check_rc=2)
    assert "kvgraft ledger repair" in r.stderr
    assert not (tmp_path / "s").exists()  # refused before any work


def test_verify_warns_loudly_about_missing_files(tmp_path, one_deposited):
    _from(one_deposited, tmp_path)
    shutil.rmtree(tmp_path / "s")
    r = run_cli("verify", "l.jsonl", cwd=tmp_path, check_rc=0)
    assert re.search(r"WARN 1 of \d+ referenced files are missing", r.stdout), r.stdout
    assert "PASS (1 files not checked: missing)" in r.stdout
    r = run_cli("verify", "l.jsonl", "--json", cwd=tmp_path, check_rc=0)
    assert json.loads(r.stdout)["warnings"] and len(json.loads(r.stdout)["files"]["missing"]) == 1
    run_cli("verify", "l.jsonl", "--require-files", cwd=tmp_path, check_rc=1)


def _gate_verify_command() -> list[str]:
    text = (REPO / "docs" / "ci-ledger-gate.yml").read_text()
    block = text[text.index("kvgraft verify ledger/reference.jsonl") :]
    block = block[: block.index("\n      - name:")]
    return block.replace("\\\n", " ").split()[1:]


def test_the_docs_ci_gate_passes_on_this_repositorys_own_ledger(tmp_path):
    """docs/ci-ledger-gate.yml's verify step, as written, on ledger/reference.jsonl (base: the ledger itself)."""
    args = _gate_verify_command()
    assert "--checkpoint" in args and "--key" in args and "--since" in args
    shutil.copy(REPO / "ledger" / "reference.jsonl", tmp_path / "base-ledger.jsonl")
    args = [str(tmp_path / "base-ledger.jsonl") if a == "/tmp/base-ledger.jsonl" else a for a in args]
    run_cli(*args, "--no-cache", cwd=REPO, check_rc=0)


def test_verify_origin_pins_the_checkpoints_log(tmp_path):
    shutil.copy(REPO / "ledger" / "reference.jsonl", tmp_path / "l.jsonl")
    shutil.copy(REPO / "ledger" / "checkpoint.txt", tmp_path / "cp.txt")
    common = (
        "verify",
        "l.jsonl",
        "--no-files",
        "--checkpoint",
        "cp.txt",
        "--key",
        str(REPO / "ledger" / "kvgraft.pub"),
    )
    run_cli(*common, "--origin", "kvgraft.example/reference-ledger", cwd=tmp_path, check_rc=0)
    r = run_cli(*common, "--origin", "kvgraft.example/other-ledger", cwd=tmp_path, check_rc=1)
    assert "names the log 'kvgraft.example/reference-ledger', not 'kvgraft.example/other-ledger'" in r.stderr
    run_cli("verify", "l.jsonl", "--origin", "x", cwd=tmp_path, check_rc=2)


def test_an_artifact_no_ledger_line_recorded_is_not_served_until_one_does(tmp_path, engine):
    _one_problem(tmp_path)
    a = _python(CRASHING_APPEND, "deposit", "one.jsonl", "--store", "s", "--ledger", "l.jsonl", cwd=tmp_path)
    a.communicate(timeout=300)
    assert a.returncode == 137
    r = run_cli("store", "stats", "--store", "s", "--json", cwd=tmp_path, check_rc=0)
    assert json.loads(r.stdout)["unrecorded"] == 1
    r = run_cli(
        "solve", "one.jsonl", "--store", "s", "--ledger", "l.jsonl", "-o", "o.jsonl", "--json", cwd=tmp_path, check_rc=0
    )
    assert json.loads(r.stdout)["library"]["records"][0]["hit"] != "exact"
    deposit_here(engine, tmp_path, "one.jsonl", store="s", ledger="l.jsonl")
    r = run_cli(
        "solve",
        "one.jsonl",
        "--store",
        "s",
        "--ledger",
        "l.jsonl",
        "-o",
        "o.jsonl",
        "--force",
        "--json",
        cwd=tmp_path,
        check_rc=0,
    )
    assert json.loads(r.stdout)["library"]["records"][0]["hit"] == "exact"
    assert json.loads(run_cli("store", "stats", "--store", "s", "--json", cwd=tmp_path).stdout)["unrecorded"] == 0


def test_store_gc_refuses_a_ledger_it_cannot_read_and_skips_what_is_not_a_file(tmp_path, one_deposited):
    _from(one_deposited, tmp_path)
    odd = tmp_path / "s" / "objects" / "ab" / "x.kvg.tmp"
    odd.mkdir(parents=True)
    _old(odd)
    r = run_cli("store", "gc", "--store", "s", "--ledger", "nonexistent.jsonl", cwd=tmp_path, check_rc=2)
    assert "ledger not found: nonexistent.jsonl" in r.stderr
    r = run_cli("store", "gc", "--store", "s", "--ledger", "l.jsonl", "--json", cwd=tmp_path, check_rc=0)
    assert json.loads(r.stdout)["temporary"] == [] and odd.is_dir()


def test_hostile_json_in_ledgers_outputs_and_records_is_a_finding_or_input_error(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    good = (REPO / "ledger" / "reference.jsonl").read_text().splitlines()[:3]
    (tmp_path / "deep.jsonl").write_text("\n".join(good + [deep]) + "\n")
    r = run_cli("verify", "deep.jsonl", "--no-files", "--json", cwd=tmp_path, check_rc=1)
    assert json.loads(r.stdout)["first_problem"].startswith("line 4: not JSON (JSON nested too deeply)")
    (tmp_path / "big.jsonl").write_text("\n".join(good + ['{"seq": ' + "9" * 5000 + "}"]) + "\n")
    r = run_cli("verify", "big.jsonl", "--no-files", "--json", cwd=tmp_path, check_rc=1)
    assert json.loads(r.stdout)["first_problem"].startswith("line 4: not JSON")
    for args in (("ledger", "log", "deep.jsonl"), ("prereg", "make", "deep.jsonl", "--target", "t", "-o", "p.yaml")):
        r = run_cli(*args, cwd=tmp_path)
        assert r.returncode in (0, 2) and "internal error" not in r.stderr, (args, r.stderr)
    (tmp_path / "odd.jsonl").write_text("\n".join(good + ["[1]", '"x"']) + "\n")
    r = run_cli("prereg", "make", "odd.jsonl", "--target", "t", "-o", "p.yaml", cwd=tmp_path, check_rc=2)
    assert "line 4 is not a ledger entry" in r.stderr
    (tmp_path / "out.jsonl").write_text(deep + "\n")
    (tmp_path / "answers.jsonl").write_text('{"id": "a", "problem": "p", "answer": "1"}\n')
    r = run_cli(
        "score",
        "out.jsonl",
        "--answers",
        "answers.jsonl",
        "--ledger",
        "l.jsonl",
        "--records",
        "r.jsonl",
        cwd=tmp_path,
        check_rc=2,
    )
    assert "out.jsonl:1: malformed JSON (JSON nested too deeply)" in r.stderr
