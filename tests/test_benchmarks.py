"""The benchmarks keep running as the code under them changes (issue #48): every ``benchmarks/*.py`` but the harness
answers ``--help``, and runs its smallest configuration end to end in a fresh process, as a user runs it, its printed
table checked for the rows it must have (and a result file written through ``harness.write_json`` for its settings,
its machine and its results). A benchmark nobody runs breaks silently when an API under it moves; here it goes red.

The smallest configurations are the benchmarks' own arguments (one length of 16 tokens, one round) or, where those
could not make a run small, the benchmark's ``--smoke`` flag. Models: the embedded tiny one, random miniatures of
SmolLM's shape, or tests/ggufblocks.py's tiny Llama GGUF kept at its 4-bit codes (``tiny`` below: a q4 manifest and
a serve manifest made like manifests/smollm2-serve.yaml, so the q4 benchmarks run without the real model).

--help only (HELP_ONLY below), each for its reason:
  bench_peers.py   llama.cpp's side is built from source first (benchmarks/peers/llama_build.py, about 10 minutes
                   on 2 cores), and the benchmark has no kvgraft-only mode
  bench_serve.py   the same: llama-cpp-python's server is built and started beside kvgraft's, no kvgraft-only mode
(bench_serve_peers.py runs its kvgraft side alone: ``--servers kvgraft``.)

The smoke runs that start two model-loading processes (COSTLY: a server and its deposit, a solve after the fill,
one child a kernel profile; 8-10 s each on 2 cores) run with ``KVGRAFT_BENCH_SMOKE=all`` only, so this file adds
about a minute to a suite run, not two; the others run every time.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import MATH500, REPO, run_cli
from ggufblocks import tiny_llama

from kvgraft_cli.config.profiles import environ_without_pins

pytestmark = pytest.mark.xdist_group("benchmarks")  # one worker makes `tiny` once and runs the smoke runs

BENCHMARKS = REPO / "benchmarks"
NAMES = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.name != "harness.py")

HELP_ONLY = {
    "bench_peers": "builds llama.cpp from source first (about 10 minutes); no kvgraft-only mode",
    "bench_serve": "builds and starts llama.cpp's server beside kvgraft's; no kvgraft-only mode",
}

# name: (arguments, patterns its stdout must match (re.MULTILINE), keys of the result file's "results" or None when
# the run writes none). In the arguments {q4}, {serve} and {gguf} are `tiny`'s files, {data} three MATH-500 rows;
# out.json is the result file, in the run's own folder (its working directory).
SMOKE: dict[str, tuple[list[str], list[str], list[str] | None]] = {
    "bench_attention": (["--smoke"], [r"^float32, 16 .* True\s+True$"], None),
    "bench_batch": (
        ["-m", "{q4}", "--sizes", "2", "--steps", "2", "--rounds", "1", "--profile", "3"],
        [
            r"forward lean$",
            r"^\s+2\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+x\s+yes$",
            r"^where a step of 2 rows goes \(2 steps profiled; own CPU time\):$",
            r"^aten::\w+\s+[\d.]+%\s+\d+\s+[\d.]+$",
        ],
        None,
    ),
    "bench_deposit": (["--smoke"], [r"^math-0\s+\d+\s+[\d.]+", r"deposit / prefill = [\d.]+ by stages"], None),
    "bench_device_restore": (
        ["--tokens", "16", "--repeat", "1", "--device", "cpu", "--chunk-mib", "1", "--ring", "2"],
        [r"^open_file \+ \.to\(device\)\s+[\d.]+\s+[\d.]+$", r"^open_file_on_device\s+[\d.]+", r"^host -> cpu copy"],
        None,
    ),
    "bench_graft": (["--model", "tiny", "--lengths", "16", "--repeat", "1"], [r"^\s+16\s+[\d.]+\s.*\sTrue$"], None),
    "bench_lean": (
        ["--manifest", "{q4}", "--lengths", "16", "--decode", "2", "--rounds", "1"],
        [r"16 tokens: prefill .* same bytes and tokens: yes$"],
        None,
    ),
    "bench_pins": (
        ["--manifest", "{q4}", "--smoke", "--lengths", "16", "--decode", "2", "--json", "out.json"],
        [r"^native, blas\s+[\d.]+\s+1\.00x", r"^avx2, aten\s+[\d.]+\s+[\d.]+x"],
        ["cpu", "lengths", "threads"],
    ),
    "bench_profiles": (
        ["--smoke", "--lengths", "16"],
        [r"^single schedule, prefill$", r"^single schedule, decode", r"^\s+16\s+[\d.]+\s+[\d.]+\s+[\d.]+x$"],
        None,
    ),
    "bench_replicas": (
        ["--manifest", "{serve}", "--recurring", "1", "--new", "1", "--max-tokens", "2", "--clients", "1"]
        + ["--replicas", "--dir", "run", "--json", "out.json"],
        [r"one: start .* 1 exact hits, 0 errors$", r"identical in every configuration .*: 2/2$"],
        ["one"],
    ),
    "bench_restore": (
        ["--smoke"],
        [r"^raw, sha256\s+.*True$", r"^shuffle-zstd, sha256-tree\s+.*True$", r"same logits bits: True$"],
        None,
    ),
    "bench_retrieval": (
        ["--sizes", "400", "--cache", "cache"],
        [r"^formatting variants exact on their source: 400/400$", r"^near duplicates \(400\): exact hits 0,"],
        None,
    ),
    "bench_serve_chunk": (
        ["--manifest", "{q4}", "--tokens", "64", "--chunks", "16", "--question", "8", "--repeat", "1"],
        [r"^single\s+[\d.]+\s+1\.00x\s+72\s*$", r"^chunked 16\s+[\d.]+\s+[\d.]+x\s+8\s+[\d.]+$"],
        None,
    ),
    "bench_serve_peers": (
        ["--manifest", "{serve}", "--servers", "kvgraft", "--concurrency", "1", "--questions", "1"]
        + ["--max-tokens", "2", "--kvgraft-args", "", "--stagger", "0", "--dir", "run", "--json", "out.json"],
        [r"^kvgraft\s+alone\s+1\s.*\s-\s+0$", r"^kvgraft\s+1\s+2\s.*\s0/2\s+0$"],
        ["build", "environment", "questions", "records", "runs", "summary"],
    ),
    "bench_startup": (
        ["--smoke"],
        [r"^\| `kvgraft --help` \| [\d.]+ \|$", r"^\| `kvgraft graft -n 4 \(tiny model\)` \| [\d.]+ \|$"],
        None,
    ),
    "bench_tenants": (
        ["--manifest", "{serve}", "--rounds", "1", "--system", "50", "--max-tokens", "2", "--json", "out.json"],
        [r"^A cold\s+[\d.]+", r"^B first\s+[\d.]+", r"^B warm\s+[\d.]+"],
        ["first_token_s", "rounds", "system_tokens"],
    ),
    "bench_verify": (
        ["--entries", "100", "--artifact-mb", "1", "--files", "2"],
        [r"^line checks: 100 entries", r"\(2 files ok\)$"],
        None,
    ),
    "bench_widening": (
        ["--sizes", "2000", "--queries", "2", "--repeat", "1", "--solve-repeat", "1", "--chunk", "10"]
        + ["--chars", "200", "300", "--math500", "", "--json-out", "out.json"],
        [r"^2 queries \(\{'exact': 1, 'related': 1\}\)", r"^\| 2,\d{3} \| \d+ \|"],
        ["disk_bytes", "fill", "fill_s", "queries", "ratios", "rows", "sizes"],
    ),
    "eval_graders": (
        ["--data", "{data}", "--shifts", "1"],
        [r"^MATH-500: 3 problems", r"^identity   accepted of 3: exact 3,", r"^cases      44 hand-written pairs"],
        None,
    ),
    "graft_steps": (
        ["--gguf", "{gguf}", "--tokens", "16", "--repeat", "1", "--idle", "0"],
        [r"^read\+hash\s+[\d.]+\s+[\d.]+$", r"^total\s+[\d.]+\s+[\d.]+$", r"BLAKE3, one thread\s+[\d.]+$"],
        None,
    ),
    "q4_vs_dequantized": (
        ["--manifest", "{q4}", "--problems", "1", "--json", "out.json"],
        [r'^  "argmax_agreement": [\d.]+,$', r'^  "positions": \d+,$'],
        ["argmax_agreement", "manifest", "max_abs_logit_diff", "max_kl", "mean_kl", "model", "positions", "problems"]
        + ["torch"],
    ),
}
# Two model-loading processes each (see the docstring): with KVGRAFT_BENCH_SMOKE=all only.
COSTLY = {"bench_pins", "bench_profiles", "bench_replicas", "bench_serve_peers", "bench_startup", "bench_widening"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    """tests/ggufblocks.py's tiny Llama GGUF (its context widened to 4,096 positions: the benchmarks' real MATH-500
    prompts fit), `manifest init --weights q4 --attn grouped` on it at 1 thread (q4.yaml), and serve.yaml: the serve
    manifest (manifests/smollm2-serve.yaml: chunks of 16, a float16 cache, MATH-500's input fields) on that model.
    The placeholders of SMOKE's arguments, and KVGRAFT_MODEL_CACHE (the GGUF's conversion, made once here)."""
    import gguf

    d = tmp_path_factory.mktemp("tiny")
    widen = gguf.GGUFWriter.add_context_length
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "add_context_length", lambda self, n: widen(self, 4096))
        tiny_llama(d / "tiny.gguf")
    env = {"KVGRAFT_MODEL_CACHE": str(d / "models")}
    run_cli("manifest", "init", "tiny.gguf", "--weights", "q4", "--attn", "grouped", "--threads", "1", "-o", "q4.yaml",
            cwd=d, env=env, check_rc=0)  # fmt: skip
    q4 = yaml.safe_load((d / "q4.yaml").read_text())
    q4["model"]["path"] = str(d / "tiny.gguf")  # the benchmarks copy the manifest elsewhere
    (d / "q4.yaml").write_text(yaml.safe_dump(q4, sort_keys=False))
    serve = yaml.safe_load((REPO / "manifests" / "smollm2-serve.yaml").read_text())
    serve.update(name="tiny-q4-serve", runtime=q4["runtime"], decode={"max_new_tokens": 40, "answer_tokens": 8})
    serve["model"] = {**q4["model"], "kv_dtype": "float16"}
    (d / "serve.yaml").write_text(yaml.safe_dump(serve, sort_keys=False))
    (d / "math3.jsonl").write_text("".join(MATH500.read_text().splitlines(keepends=True)[:3]))
    return {
        "q4": str(d / "q4.yaml"),
        "serve": str(d / "serve.yaml"),
        "gguf": str(d / "tiny.gguf"),
        "data": str(d / "math3.jsonl"),
        **env,
    }


def _run(name: str, args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python benchmarks/NAME.py ARGS`` in a fresh process in ``cwd``, without the tests' kernel pins."""
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), *args],
        cwd=cwd,
        env={**environ_without_pins(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_benchmark_has_a_smoke_run_or_a_reason():
    """A new benchmark gets a smoke configuration here, or a line in HELP_ONLY saying why it cannot have one."""
    assert sorted([*SMOKE, *HELP_ONLY]) == NAMES
    assert not set(SMOKE) & set(HELP_ONLY) and COSTLY <= set(SMOKE)


@pytest.mark.parametrize("name", NAMES)
def test_help(name, tmp_path):
    p = _run(name, ["--help"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert "usage" in p.stdout
    assert list(tmp_path.iterdir()) == []  # --help builds, writes and downloads nothing


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_smoke(name, tmp_path, request):
    args, patterns, results = SMOKE[name]
    if name in COSTLY and os.environ.get("KVGRAFT_BENCH_SMOKE") != "all":
        pytest.skip("two model-loading processes (8-10 s): run with KVGRAFT_BENCH_SMOKE=all")
    if name == "eval_graders" and importlib.util.find_spec("math_verify") is None:
        pytest.skip("math-verify is not installed (pip install 'kvgraft[mathverify]')")
    tiny = request.getfixturevalue("tiny") if any("{" in a for a in args) else {}
    (tmp_path / "tmp").mkdir()  # the temporary folders some benchmarks leave behind: in the test's own
    env = {"TMPDIR": str(tmp_path / "tmp"), **({"KVGRAFT_MODEL_CACHE": tiny["KVGRAFT_MODEL_CACHE"]} if tiny else {})}
    p = _run(name, [a.format(**tiny) for a in args], tmp_path, env)
    assert p.returncode == 0, f"rc={p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    for pattern in patterns:
        assert re.search(pattern, p.stdout, re.MULTILINE), f"no line matches {pattern!r} in:\n{p.stdout[-3000:]}"
    if results is None:
        return
    out = json.loads((tmp_path / "out.json").read_text())  # written by harness.write_json
    assert sorted(out) == ["environment", "results", "settings"]
    assert out["environment"]["cpu"]["logical_cpus"] and out["environment"]["versions"]["kvgraft"]
    assert sorted(out["results"]) == results
    assert out["settings"]["json" if "--json" in args else "json_out"].endswith("out.json")
