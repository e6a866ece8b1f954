"""The main job's pre-registration (examples/smollm2/prereg.yaml) replays here, hash for hash, on the real model.

The prereg was made from a run of the main job under the avx2 profile (manifests/smollm2-math500-q4.yaml), whose
bits every x86-64 CPU with AVX2 and FMA computes: so this test pins the real model's deposit (artifact and logits
hashes), graft (the recurring problems' exact hits, grafted) and short decode (their outputs) on whatever AVX2
machine runs the suite. Within the suite's budget it replays the first part of the job: the first 2 deposits and the
first 2 recurring problems (the recurring set is the first 10 deposits, in order) solved from the library, each
compared with the hashes the whole run recorded for them. The whole job replays with `kvgraft replay
examples/smollm2/prereg.yaml` (README).

The replay is also the suite's run of the real model end to end through the CLI under the main job's manifest: the
recurring problems are exact hits answered from the grafted solution under the short budget, the chat prompts are in
the ledger, the lean forward computed every line, `verify` passes and `graft --check` is byte-exact.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_cli

pytestmark = pytest.mark.xdist_group("smollm2")  # with the real model's other tests: one worker converts the GGUF

PREREG = REPO / "examples" / "smollm2" / "prereg.yaml"
KEEP = {"deposit-1": 2, "solve-1": 2}  # run id -> its limit: how many of its problems are replayed


def _part(tmp_path) -> tuple[dict, int]:
    """The prereg's first runs, with inputs as absolute paths and outputs in ``tmp_path``; (prereg, hashes kept)."""
    data = yaml.safe_load(PREREG.read_text())
    here = PREREG.parent
    data["manifest"]["path"] = str((here / data["manifest"]["path"]).resolve())
    runs = []
    for run in data["runs"]:
        if run["id"] not in KEEP:
            continue
        for key in ("input", "answers"):
            if key in run:
                run[key] = str((here / run[key]).resolve())
        if "outputs" in run:
            run["outputs"] = str(tmp_path / "out" / (here / run["outputs"]).name)
        run["settings"]["limit"] = KEEP[run["id"]]
        runs.append(run)
    data["runs"] = runs
    (target,) = data["targets"]
    expected = {}
    for rid, limit in KEEP.items():
        # the hashes of the first ``limit`` problems (a whole outputs file's hash is left out: its file is shorter)
        full = data["targets"][target][rid]
        ids = list(dict.fromkeys(k.split()[1] for k in full if " " in k))[:limit]
        expected[rid] = {k: v for k, v in full.items() if k == "input_sha256" or k.split()[-1] in ids}
    data["targets"] = {target: expected}
    return data, sum(len(v) for v in expected.values())


def test_the_main_jobs_prereg_replays_hash_for_hash(tmp_path, smol_env):
    data, n = _part(tmp_path)
    assert data["kernels"]["x86-64-avx2"]["identity"] is None  # made under pinned kernels: the avx2 profile
    prereg = tmp_path / "part.yaml"
    prereg.write_text(yaml.safe_dump(data, sort_keys=False))
    # The real model from the GGUF's conversion this worker made once (conftest.smol_cache), as a user's cache holds it
    run_cli("replay", "--register", str(prereg), cwd=tmp_path, check_rc=0)
    p = run_cli("replay", str(prereg), "--json", cwd=tmp_path, env=smol_env, check_rc=None)
    report = json.loads(p.stdout) if p.stdout.strip() else {}
    # Every hash kept matches; the one value not compared is the shorter outputs file's own hash, which the full run
    # did not record (the replay reports it as unexpected, so its exit is 1 and "passed" false for that alone).
    bad = [c for c in report.get("comparisons", []) if not c["match"]]
    assert [(c["run"], c["what"], c["expected"]) for c in bad] == [("solve-1", "outputs_sha256", None)], p.stderr
    assert report["matched"] == n == 1 + 2 * 2 + 1 + 2 * 2  # the inputs; an artifact and logits / output and hit each

    # The real model end to end, from what the replay left: its ledger, store and outputs
    entries = [json.loads(x) for x in (tmp_path / "kvgraft-ledger.jsonl").read_text().splitlines()]
    solves = [e for e in entries if e["kind"] == "solve"]
    assert len(solves) == 2 and all(e["inputs"]["settings"]["prompts"]["format"] == "chat" for e in solves)
    assert solves[0]["inputs"]["settings"]["prompts"]["query_exact"].startswith("Repeat the final answer")
    # engine.lean in force: its forward gave transformers' bytes in the check at load (else "transformers")
    assert {e["environment"]["forward"] for e in entries if "environment" in e and "forward" in e["environment"]} == {
        "lean"
    }
    # The int4 product and attention's products ran in kvgraft's C kernels (engine.ckernels) at the CPU's widest vectors
    # wherever a C compiler built them, and ATen's made the prereg: so this replay is their check on the real model
    ran = {e["environment"]["ckernels"] for e in entries if "forward" in e.get("environment", {})}
    widest = "avx512" if "avx512f" in Path("/proc/cpuinfo").read_text() else "avx2"
    assert ran == ({widest} if shutil.which("cc") or shutil.which("gcc") else {"aten"}), ran
    (outputs,) = [Path(r["outputs"]) for r in data["runs"] if "outputs" in r]
    records = [json.loads(x) for x in outputs.read_text().splitlines()]
    assert [r["hit"] for r in records] == ["exact"] * 2
    assert all(r["decode_tokens"] <= 32 and r["output"].startswith("Final answer:") for r in records), records
    m = ["-m", data["manifest"]["path"]]
    run_cli("verify", "kvgraft-ledger.jsonl", "--full", cwd=tmp_path, check_rc=0)
    # the first deposit, the shorter prefix of the two (the check prefills it three times)
    first = next(e for e in entries if e["kind"] == "deposit")["outputs"]["artifact"]["sha256"]
    p = run_cli(
        "graft", first, "--check", "-n", "16", "--samples", "1", "--json", *m, cwd=tmp_path, env=smol_env, check_rc=0
    )  # fmt: skip
    assert json.loads(p.stdout)["passed"] is True
