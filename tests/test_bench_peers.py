"""benchmarks/bench_peers.py's own logic, without running it (issue 27: the side by side with llama.cpp builds llama.cpp
and runs two models for half an hour; none of that runs here): the build cache it reuses, how it reads a verdict,
and the timing harness the benchmarks share."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import bench_peers  # noqa: E402
import harness  # noqa: E402
from peers import llama_build  # noqa: E402


def test_interleaved_calls_each_run_once_a_round_in_turn():
    calls = []
    laps = harness.interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3)
    assert calls == ["a", "b"] * 3
    assert {k: len(v) for k, v in laps.items()} == {"a": 3, "b": 3}


def test_a_finished_build_is_reused_and_keyed_by_its_flags(tmp_path, monkeypatch):
    dest = llama_build.build_dir(tmp_path)
    assert dest.parent == tmp_path and dest.name.startswith(f"llama-cpp-python-{llama_build.VERSION}-")
    (dest / "site").mkdir(parents=True)
    (dest / "build.json").write_text(json.dumps({"package": "llama-cpp-python==x", "cmake_args": "y"}))
    got = llama_build.ensure_built(tmp_path, say=pytest.fail)  # nothing to say: nothing is built
    assert got["cached"] is True and got["site"] == str(dest / "site")
    monkeypatch.setattr(llama_build, "CMAKE_ARGS", llama_build.CMAKE_ARGS + " -DGGML_OPENMP=OFF")
    assert llama_build.build_dir(tmp_path) != dest  # other flags, another build


def _result(restore_exact_at_2: bool) -> dict:
    per = {
        "restore_exact": True,
        "fresh_equals_one_pass": False,
        "restored_equals_one_pass": False,
        "max_abs_diff": 0.0,
    }
    return {
        "exactness": {"1": per, "2": {**per, "restore_exact": restore_exact_at_2}, "fresh_same_across_threads": True}
    }


def test_the_verdict_says_which_thread_count_differs():
    assert (
        bench_peers._verdict("llama.cpp", _result(True))
        == "restore vs fresh: 1 thr equal, 2 thr equal; vs one pass: differ"
    )
    assert "2 thr DIFFER" in bench_peers._verdict("llama.cpp", _result(False))
    check = {"check": {"passed": False, "sha_equal": 0, "samples": 1, "check_s": 3.0}}
    assert bench_peers._verdict("kvgraft float32", check).startswith("graft --check FAILED (0/1 SHA-equal")


def test_help_needs_no_build(tmp_path):
    p = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_peers.py"), "--help"],
        capture_output=True,
        text=True,
        env={"KVGRAFT_PEER_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert "llama.cpp" in p.stdout and list(tmp_path.iterdir()) == []


def test_the_tamper_line_says_what_happened():
    assert (
        bench_peers._tamper({"loaded": True, "logits_changed": True})
        == "loaded without an error; first-token logits CHANGED"
    )
    assert (
        bench_peers._tamper({"loaded": False, "error": "x.kvg: identity mismatch"})
        == "refused: x.kvg: identity mismatch"
    )


def test_a_kvgraft_configuration_reads_its_optional_fields():
    assert bench_peers._spec("bfloat16") == ("bfloat16", "native", "eager", "dequantized", None, "sha256-tree")
    assert bench_peers._spec("float32:native:grouped:q4:-:sha256") == (
        "float32",
        "native",
        "grouped",
        "q4",
        None,
        "sha256",
    )
    assert bench_peers._spec("float32:native:grouped:q4:float16:blake3")[4:] == ("float16", "blake3")
    with pytest.raises(SystemExit, match="at most"):
        bench_peers._spec("float32:native:grouped:q4:float16:blake3:x")
