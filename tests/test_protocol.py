"""scripts/protocol.sh, the seed's experiment as a ready protocol, run end to end on a CPU with the demo model (a
user runs it on their own checkpoint and GPU): manifest, library, solve --compare, score, verify, prereg, and a
replay of that prereg into a fresh store that matches hash for hash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO, run_cli

from kvgraft_cli.config.profiles import environ_without_pins


def test_protocol_script_end_to_end(tmp_path):
    demo = REPO / "examples" / "demo"
    lib, probs = tmp_path / "library.jsonl", tmp_path / "probs.jsonl"
    lib.write_text("".join(line + "\n" for line in (demo / "library.jsonl").read_text().splitlines()[:8]))
    probs.write_text("".join(line + "\n" for line in (demo / "queries.jsonl").read_text().splitlines()[:8]))
    # The demo model reads the demo's prompt (Question/Answer), not the AIME overlay's: lay that over instead.
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text('prompt:\n  query: "\\nQuestion: {query}\\nAnswer:"\ndecode:\n  stop: ["\\n"]\n')
    env = environ_without_pins()
    env.update(
        DEVICE="cpu",
        DTYPE="float32",
        PROFILE="portable",
        K="2",
        MAX_NEW_TOKENS="24",
        ANSWER_TOKENS="24",
        OVERLAY=str(overlay),
        PATH=str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", ""),
    )
    model = REPO / "kvgraft_cli" / "data" / "demo-gemma4"
    p = subprocess.run(
        ["bash", str(REPO / "scripts" / "protocol.sh"), str(model), str(lib), str(probs), "run"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run = tmp_path / "run"
    for name in (
        "manifest.yaml",
        "prereg.yaml",
        "outputs.library.jsonl",
        "outputs.baseline.jsonl",
        "outputs.library.scores.jsonl",
        "outputs.baseline.scores.jsonl",
    ):
        assert (run / name).is_file(), name
    kinds = [json.loads(line)["kind"] for line in (run / "kvgraft-ledger.jsonl").read_text().splitlines()]
    scores = [
        json.loads(line)
        for line in (run / "kvgraft-ledger.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "score"
    ]
    baseline, library = (int(e["outputs"]["result"]["correct"]) for e in scores)
    assert library > baseline  # the demo model reads the grafted solutions (the overlay's query template)
    assert kinds.count("solve-outputs") == 2 and kinds.count("score") == 2 and kinds[-1] == "register"
    rep = run_cli("replay", "prereg.yaml", "--store", "fresh-store", "--json", cwd=run, check_rc=0)
    out = json.loads(rep.stdout)
    assert out["passed"] and out["mismatched"] == 0
    assert {c["run"] for c in out["comparisons"]} >= {"deposit-1", "solve-1", "solve-2", "score-1", "score-2"}
    # A usage error: too few arguments prints the help and exits 2.
    bad = subprocess.run(["bash", str(REPO / "scripts" / "protocol.sh"), str(model)], capture_output=True, text=True)
    assert bad.returncode == 2 and "MODEL_DIR" in bad.stdout
