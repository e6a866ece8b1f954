"""The suite's CLI calls run in children of a warm process (tests/forkserver.py): each must be what a fresh
`python -m kvgraft_cli` gives, byte for byte, or the rest of the suite tests something users never run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import EXAMPLES, REPO, run_cli
from forkserver import forkable, run_forked

from kvgraft_cli.config.profiles import KNOWN_BIT_ENV, environ_without_pins

forked_only = pytest.mark.skipif(
    os.environ.get("KVGRAFT_TEST_FRESH") == "1", reason="KVGRAFT_TEST_FRESH=1: every call is a fresh interpreter"
)


def _files(folder: Path) -> dict[str, bytes]:
    # The store's objects, not its SQLite index (which records when each was written).
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.suffix != ".sqlite"
    }


def _ledger_without_times(path: Path) -> list[dict]:
    lines = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]
    for e in lines:
        e.pop("time", None)
        e.pop("prev", None)  # chains over the line, time included
    return lines


def test_a_forked_deposit_and_error_are_the_fresh_ones(tmp_path):
    runs = {}
    for how in ("forked", "fresh"):
        d = tmp_path / how
        d.mkdir()
        args = ("deposit", str(EXAMPLES), "--limit", "2", "--json")
        p = run_cli(*args, cwd=d, fresh=how == "fresh", check_rc=0)
        bad = run_cli("deposit", "nosuch.jsonl", cwd=d, fresh=how == "fresh")
        runs[how] = (p.stdout, p.stderr, bad.returncode, bad.stderr, _files(d / "kvgraft-store"))
        runs[how] += (_ledger_without_times(d / "kvgraft-ledger.jsonl"),)
    assert runs["forked"] == runs["fresh"]
    assert runs["fresh"][2] == 2 and runs["fresh"][3].startswith("Error: ")


def _probe_both(mode: str, cwd: Path) -> dict[str, subprocess.CompletedProcess]:
    # The probe runs from a folder of its own (`python -m` finds it there), not from tests/, where the zygote started.
    (cwd / "fork_probe.py").write_bytes((REPO / "tests" / "fork_probe.py").read_bytes())
    env = environ_without_pins()
    pins = {n: os.environ.get(n) for n in KNOWN_BIT_ENV}
    fresh = subprocess.run(
        [sys.executable, "-m", "fork_probe", mode],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return {"fresh": fresh, "forked": run_forked([mode], cwd, env, pins, timeout=120, module="fork_probe")}


@forked_only
def test_a_forked_child_sees_what_a_fresh_interpreter_sees(tmp_path):
    runs = _probe_both("state", tmp_path)
    for p in runs.values():
        assert p.returncode == 3, p.stderr
        assert p.stdout.splitlines()[1:] == ["thread", "atexit"]  # threads joined, then atexit, as at interpreter exit
    state = {how: json.loads(p.stdout.splitlines()[0]) for how, p in runs.items()}
    assert state["forked"] == state["fresh"]
    assert state["fresh"]["prog"] == "fork_probe.py" and state["fresh"]["stdin"] == "/dev/null"


@forked_only
def test_torch_imported_before_the_pins_is_drift_in_a_forked_child_too(tmp_path):
    for mode, drift in (("pins-first", []), ("torch-first", ["env.ATEN_CPU_CAPABILITY", "env.MKL_CBWR"])):
        runs = _probe_both(mode, tmp_path)
        got = {how: (p.returncode, p.stderr, json.loads(p.stdout)) for how, p in runs.items()}
        assert got["forked"] == got["fresh"], mode
        assert got["fresh"][2][:2] == drift, mode


@forked_only
def test_a_manifest_pinning_other_kernels_runs_where_torch_was_imported_under_them(tmp_path):
    # The avx2 profile pins ATEN_CPU_CAPABILITY, MKL_CBWR and ONEDNN_MAX_CPU_ISA to other values than the tests'
    # process (the portable flags): a child of the portable zygote must hand the command to one started under them,
    # or it fails as drift ("torch already imported"), or computes with the wrong kernels.
    (tmp_path / "m.yaml").write_text(
        run_cli("manifest", "init", "builtin:tiny-gemma4", "--profile", "avx2", cwd=tmp_path, check_rc=0).stdout,
        encoding="utf-8",
    )
    outs, under = {}, {}
    for how in ("forked", "fresh"):
        p = run_cli(
            "deposit", str(EXAMPLES), "--limit", "1", "-m", "../m.yaml", "--json",
            cwd=(tmp_path / how).mkdir() or tmp_path / how, fresh=how == "fresh", check_rc=0,
        )  # fmt: skip
        ledger = _ledger_without_times(tmp_path / how / "kvgraft-ledger.jsonl")
        outs[how] = ([(r["artifact"], r["logits_sha256"]) for r in json.loads(p.stdout)["results"]], ledger)
        under[how] = getattr(p, "forked_under", None)
        # The kernels ATen chose (the tiny model's bits alone would not tell them apart).
        assert [e["environment"]["kernels"]["aten"] for e in ledger] == ["avx2"]
        assert not [e for e in ledger if e.get("drift")]
    assert outs["forked"] == outs["fresh"]
    # ATen happens to read its capability lazily, so even a child of the portable zygote would record avx2 above:
    # check that the command was handed to a zygote whose torch import saw the avx2 pins.
    assert under["forked"]["ATEN_CPU_CAPABILITY"] == "avx2" and under["fresh"] is None


@forked_only
def test_variables_read_at_interpreter_start_get_a_fresh_interpreter():
    assert forkable(None) and forkable({"KVGRAFT_MAX_LINE": "2K", "COLUMNS": "80", "XDG_CACHE_HOME": "/x"})
    for name in ("PYTHONHASHSEED", "LC_ALL", "OMP_NUM_THREADS", "HF_HOME", "ATEN_CPU_CAPABILITY"):
        assert not forkable({name: "1"}), name
