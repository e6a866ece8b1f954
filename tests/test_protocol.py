"""scripts/protocol.sh, the seed's experiment as a ready protocol, run end to end on a CPU with an embedded model
(a user runs it on their own checkpoint and GPU): manifest, library, solve --compare, score, verify, prereg, and a
replay of that prereg into a fresh store that matches hash for hash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import EXAMPLES, REPO, run_cli
from kvgraft_cli.config.profiles import environ_without_pins


def test_protocol_script_end_to_end(tmp_path):
    probs = tmp_path / "probs.jsonl"
    probs.write_text("".join(line + "\n" for line in EXAMPLES.read_text().splitlines() if "noref" not in line))
    env = environ_without_pins()
    env.update(DEVICE="cpu", DTYPE="float32", PROFILE="portable", K="2", MAX_NEW_TOKENS="8", ANSWER_TOKENS="4",
               PATH=str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", ""))
    model = REPO / "kvgraft_cli" / "data" / "tiny-gemma4"
    p = subprocess.run(["bash", str(REPO / "scripts" / "protocol.sh"), str(model), str(probs), str(probs), "run"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run = tmp_path / "run"
    for name in ("manifest.yaml", "prereg.yaml", "outputs.library.jsonl", "outputs.baseline.jsonl",
                 "outputs.library.scores.jsonl", "outputs.baseline.scores.jsonl"):
        assert (run / name).is_file(), name
    kinds = [json.loads(line)["kind"] for line in (run / "kvgraft-ledger.jsonl").read_text().splitlines()]
    assert kinds.count("solve-outputs") == 2 and kinds.count("score") == 2 and kinds[-1] == "register"
    rep = run_cli("replay", "prereg.yaml", "--store", "fresh-store", "--json", cwd=run, check_rc=0)
    out = json.loads(rep.stdout)
    assert out["passed"] and out["mismatched"] == 0
    assert {c["run"] for c in out["comparisons"]} >= {"deposit-1", "solve-1", "solve-2", "score-1", "score-2"}
    # A usage error: too few arguments prints the help and exits 2.
    bad = subprocess.run(["bash", str(REPO / "scripts" / "protocol.sh"), str(model)], capture_output=True, text=True)
    assert bad.returncode == 2 and "MODEL_DIR" in bad.stdout
