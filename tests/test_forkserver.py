"""The suite's CLI calls run in children of a warm process (tests/forkserver.py): each must be what a fresh
`python -m kvgraft_cli` gives, byte for byte, or the rest of the suite tests something users never run."""

from __future__ import annotations

import json
from pathlib import Path

import forkserver
from conftest import EXAMPLES, run_cli
from forkserver import forkable


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


def test_a_manifest_pinning_other_kernels_runs_where_torch_was_imported_under_them(tmp_path):
    # The avx2 profile pins ATEN_CPU_CAPABILITY, MKL_CBWR and ONEDNN_MAX_CPU_ISA to other values than the tests'
    # process (the portable flags): a child of the portable zygote must hand the command to one started under them,
    # or it fails as drift ("torch already imported"), or computes with the wrong kernels.
    (tmp_path / "m.yaml").write_text(
        run_cli("manifest", "init", "builtin:tiny-gemma4", "--profile", "avx2", cwd=tmp_path, check_rc=0).stdout,
        encoding="utf-8",
    )
    outs = {}
    for how in ("forked", "fresh"):
        p = run_cli(
            "deposit", str(EXAMPLES), "--limit", "1", "-m", "../m.yaml", "--json",
            cwd=(tmp_path / how).mkdir() or tmp_path / how, fresh=how == "fresh", check_rc=0,
        )  # fmt: skip
        ledger = _ledger_without_times(tmp_path / how / "kvgraft-ledger.jsonl")
        outs[how] = ([(r["artifact"], r["logits_sha256"]) for r in json.loads(p.stdout)["results"]], ledger)
        # The kernels torch chose at import (the tiny model's bits alone would not tell them apart).
        assert [e["environment"]["kernels"]["aten"] for e in ledger] == ["avx2"]
        assert not [e for e in ledger if e.get("drift")]
    assert outs["forked"] == outs["fresh"]
    # ATen happens to read its capability lazily, so even a child of the portable zygote would record avx2 above:
    # check that the command was handed to a zygote whose torch import saw the avx2 pins.
    assert any(z.pins["ATEN_CPU_CAPABILITY"] == "avx2" for z in forkserver._ZYGOTES.values())


def test_variables_read_at_interpreter_start_get_a_fresh_interpreter():
    assert forkable(None) and forkable({"KVGRAFT_MAX_LINE": "2K", "COLUMNS": "80", "XDG_CACHE_HOME": "/x"})
    for name in ("PYTHONHASHSEED", "LC_ALL", "OMP_NUM_THREADS", "HF_HOME", "ATEN_CPU_CAPABILITY"):
        assert not forkable({name: "1"}), name
