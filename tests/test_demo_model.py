"""The committed demo model (kvgraft_cli/data/demo-gemma4) is the one scripts/train_demo_model.py trained: pinned
file hashes; the script runs (a few steps, never the full training in CI); its demo files are deterministic and
held out; and the model reads its context through kvgraft: a grafted solution's answer comes back, a missing one
does not."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys

from conftest import REPO, run_cli

DEMO = REPO / "kvgraft_cli" / "data" / "demo-gemma4"
SCRIPT = REPO / "scripts" / "train_demo_model.py"
PINNED = {  # the committed files: a changed weight, config or tokenizer file fails here
    "config.json": "f84d17dd1a4b29943cad2b6ca51383e80c0c63ac2e3f04b302874c72abdfe9c7",
    "model.safetensors": "d0a5b7c06af5eb2ee013f3db4607e2de44518b44fbebac881cb5db3247d1d5d6",
    "tokenizer.json": "c02c2086b9895f0a6c5523f86226ebbb177b3782a27464f453b6d8468fc60862",
    "tokenizer_config.json": "2e82dbc3e20a656b022331e8b616deb37897c4544b5c4489a598793cae589c91",
}


def _script():
    spec = importlib.util.spec_from_file_location("train_demo_model", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_files_match_pinned_hashes():
    got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(DEMO.iterdir())}
    assert got == PINNED


def test_model_and_tokenizer_hashes_match_the_demo_manifest(tmp_path):
    out = json.loads(run_cli("model-hash", str(DEMO), "--json", cwd=tmp_path, check_rc=0).stdout)
    shown = json.loads(
        run_cli(
            "manifest", "show", str(REPO / "kvgraft_cli" / "data" / "demo.yaml"), "--json", cwd=tmp_path, check_rc=0
        ).stdout
    )["manifest"]["model"]
    assert (out["model_sha256"], out["tokenizer_sha256"]) == (shown["sha256"], shown["tokenizer_sha256"])
    embedded = json.loads(run_cli("manifest", "show", "--json", cwd=tmp_path, check_rc=0).stdout)["manifest"]["model"]
    assert out["tokenizer_sha256"] == embedded["tokenizer_sha256"]  # the embedded model's tokenizer, unchanged


def test_training_script_runs_a_few_steps(tmp_path):
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "3", "--out", str(tmp_path / "m")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert "step 3" in p.stdout
    names = sorted(x.name for x in (tmp_path / "m").iterdir())
    assert names == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert (tmp_path / "m" / "tokenizer.json").read_bytes() == (DEMO / "tokenizer.json").read_bytes()
    assert (tmp_path / "m" / "model.safetensors").read_bytes() != (DEMO / "model.safetensors").read_bytes()


def test_demo_files_are_deterministic_and_held_out(tmp_path):
    mod = _script()
    mod.write_demo_files(tmp_path / "a")
    mod.write_demo_files(tmp_path / "b")
    for name in ("library.jsonl", "queries.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert (tmp_path / "a" / "queries.jsonl").read_bytes() == (
        REPO / "examples" / "demo" / "queries.jsonl"
    ).read_bytes()
    lib = [json.loads(x) for x in (tmp_path / "a" / "library.jsonl").read_text().splitlines()]
    qs = [json.loads(x) for x in (tmp_path / "a" / "queries.jsonl").read_text().splitlines()]
    problems = {x["problem"] for x in lib}
    rec = [q for q in qs if q["id"].startswith("rec-")]
    fam = [q for q in qs if q["id"].startswith("fam-")]
    assert rec and all(q["problem"] in problems for q in rec)  # recurring: asked again
    assert fam and not any(q["problem"] in problems for q in fam)  # transfer: new instances
    # Held out: the training stream (seed 0) never produces a demo problem.
    import random

    r = random.Random(mod.TRAIN_SEED)
    seen = {mod.example(r, 1.0)[0] for _ in range(2000)}
    assert not any(q["problem"] in ctx for ctx in seen for q in qs[:5])


def test_readme_main_job(tmp_path):
    """The README's main job, command by command, and the figure it quotes (49/50 with the library, 0/50 without):
    through kvgraft itself, the library's grafts give the answers back and the baseline does not."""
    demo, m = REPO / "examples" / "demo", str(REPO / "kvgraft_cli" / "data" / "demo.yaml")
    run_cli("deposit", str(demo / "library.jsonl"), "-m", m, cwd=tmp_path, check_rc=0)
    p = run_cli("solve", str(demo / "queries.jsonl"), "-m", m, "--compare", "--k", "2", cwd=tmp_path, check_rc=0)
    assert "decode tokens with the library instead of" in p.stdout
    s = run_cli(
        "score", "queries.solve.jsonl", "--answers", str(demo / "queries.jsonl"), "-m", m, cwd=tmp_path, check_rc=0
    )
    assert "accuracy 49/50 = 0.9800, Wilson 95% [0.8950, 0.9965]" in " ".join(s.stdout.split())
    base = [json.loads(x) for x in (tmp_path / "queries.baseline.jsonl").read_text().splitlines()]
    assert len(base) == 50 and all(x["hit"] == "none" for x in base)
    s = run_cli(
        "score", "queries.baseline.jsonl", "--answers", str(demo / "queries.jsonl"), "-m", m, cwd=tmp_path, check_rc=0
    )
    assert "accuracy 0/50 = 0.0000" in " ".join(s.stdout.split())
    v = run_cli("verify", "-m", m, cwd=tmp_path, check_rc=0)
    assert "PASS" in v.stdout
