"""The CLI as a user runs it: the README's main job, JSON output, and commands that never load torch."""

from __future__ import annotations

import json

import yaml
from conftest import EXAMPLES, REPO, run_cli, run_without_torch


def test_main_job_deposit_then_check_50_samples(tmp_path):
    """README quick start: deposit the examples with the embedded default, then graft --check (50 samples). Both in
    fresh interpreters (not forked from the suite's warm one), as a user runs them."""
    p = run_cli("deposit", str(EXAMPLES), cwd=tmp_path, check_rc=0, fresh=True)
    assert "deposited" in p.stdout and "kvgraft-store" in p.stdout
    p = run_cli("graft", "--check", "--json", cwd=tmp_path, check_rc=0, fresh=True)
    r = json.loads(p.stdout)
    assert (r["samples"], r["sha_equal"], r["max_kl"], r["argmax_agreement"]) == (50, 50, 0.0, 1.0)
    assert r["passed"] and r["deposit_reproduced"] and r["generated_equal"] == 50
    p = run_cli("graft", "gcd-1", "--query", "What is gcd(84, 126)?", "-n", "4", cwd=tmp_path, check_rc=0)
    p = run_cli("store", "list", "--json", cwd=tmp_path, check_rc=0)
    assert json.loads(p.stdout)["stats"]["objects"] == 7
    lines = (tmp_path / "kvgraft-ledger.jsonl").read_text().splitlines()
    assert [json.loads(x)["kind"] for x in lines] == ["deposit"] * 7 + ["graft-check", "graft"]


def test_deposit_json_and_idempotence(tmp_path):
    first = json.loads(run_cli("deposit", str(EXAMPLES), "--limit", "2", "--json", cwd=tmp_path, check_rc=0).stdout)
    again = json.loads(run_cli("deposit", str(EXAMPLES), "--limit", "2", "--json", cwd=tmp_path, check_rc=0).stdout)
    assert first["totals"]["deposited"] == 2 and again["totals"]["existing"] == 2
    assert [r["artifact"] for r in first["results"]] == [r["artifact"] for r in again["results"]]


def test_commands_that_needrun_without_torch(tmp_path):
    for args in (
        ["--help"],
        ["manifest", "validate"],
        ["manifest", "show", "--json"],
        ["model-hash", str(REPO / "kvgraft_cli" / "data" / "tiny-gemma4")],
        ["manifest", "init", "builtin:tiny-gemma4", "--profile", "native", "--threads", "2"],
    ):
        p = run_without_torch(*args, cwd=tmp_path)
        assert p.returncode == 0, (args, p.stderr)
    # And the block really blocks: an engine command fails without torch.
    p = run_without_torch("deposit", str(EXAMPLES), "--limit", "1", cwd=tmp_path)
    assert p.returncode == 2 and "blocked" in p.stderr and "kvgraft[engine]" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_manifest_init_round_trips(tmp_path):
    tiny = str(REPO / "kvgraft_cli" / "data" / "tiny-gemma4")
    run_cli("manifest", "init", tiny, "--profile", "portable", "-o", "m.yaml", cwd=tmp_path, check_rc=0)
    p = run_cli("manifest", "validate", "m.yaml", "--json", cwd=tmp_path, check_rc=0)
    assert json.loads(p.stdout)["valid"] is True
    run_cli("manifest", "init", "builtin:tiny-gemma4", "-o", "m.yaml", cwd=tmp_path, check_rc=2)  # no overwrite
    # Same model, same profile: the written manifest has the embedded default's compute pin.
    default = json.loads(run_cli("manifest", "show", "--json", cwd=tmp_path, check_rc=0).stdout)
    mine = json.loads(run_cli("manifest", "show", "m.yaml", "--json", cwd=tmp_path, check_rc=0).stdout)
    assert mine["compute_sha256"] == default["compute_sha256"]
    # Unless told, init picks the avx2 profile on a CPU with AVX2 and FMA (bits every such CPU computes), and says so
    from kvgraft_cli.config.kernels import this_cpu

    p = run_cli("manifest", "init", tiny, "-o", "d.yaml", cwd=tmp_path, check_rc=0)
    env = yaml.safe_load((tmp_path / "d.yaml").read_text())["runtime"]["env"]
    if not this_cpu().missing("avx2"):
        assert "profile avx2" in p.stderr
        assert (env["ATEN_CPU_CAPABILITY"], env["MKL_CBWR"], env["ONEDNN_MAX_CPU_ISA"]) == ("avx2", "AVX2", "AVX2")
    else:
        assert "profile portable" in p.stderr and env["ATEN_CPU_CAPABILITY"] == "default"


def test_python_dash_m_and_version_of_help(tmp_path):
    p = run_cli("--help", cwd=tmp_path, check_rc=0)
    for cmd in ("deposit", "graft", "manifest", "model-hash", "store"):
        assert cmd in p.stdout
