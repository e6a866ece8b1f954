"""The exactness matrix: cells count byte-equal samples, a broken graft shows up, unsupported cells carry their
reason, one process runs one profile, and the CLI prints the table a README carries."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from kvgraft_cli.engine.engine import Engine
from kvgraft_cli.errors import DriftError, InputError, UnsupportedModel
from kvgraft_cli.runs import matrix as mx


def test_cells_are_exact_and_fingerprinted(tmp_path):
    cells = mx.run_profile("portable", tmp_path, ["llama", "gemma3"], ["float32", "float16"], 4)
    assert [(c.arch, c.dtype) for c in cells] == [
        ("llama", "float32"),
        ("llama", "float16"),
        ("gemma3", "float32"),
        ("gemma3", "float16"),
    ]
    for c in cells:
        assert c.exact and c.samples == c.sha_equal == 4 and c.max_kl == 0.0 and c.argmax_agreement == 1.0
        assert len(c.fingerprint) == 64
    assert len({c.fingerprint for c in cells}) == 4
    again = mx.run_profile("portable", tmp_path, ["llama"], ["float32"], 4)[0]
    assert again.fingerprint == cells[0].fingerprint  # same samples, same bits


def test_a_broken_graft_is_caught(tmp_path, monkeypatch):
    real = Engine.restore

    # layer 0's keys one ulp off: what a slightly lossy artifact round trip would do
    def nudged(self, layers, grow=True):
        import torch

        cache = real(self, layers, grow)
        k = cache.layers[0].keys
        k.copy_(torch.nextafter(k, torch.full_like(k, 1.0)))
        return cache

    monkeypatch.setattr(Engine, "restore", nudged)
    cell = mx.run_profile("portable", tmp_path, ["llama"], ["float32"], 3)[0]
    assert not cell.exact and cell.sha_equal == 0 and cell.max_kl > 0


def test_unsupported_cells_say_why(tmp_path, monkeypatch):
    def refuse(manifest, *a, **k):
        raise UnsupportedModel("cache layer 0 is a LinearAttentionLayer")

    monkeypatch.setattr(mx, "load_engine", refuse)
    cell = mx.run_profile("portable", tmp_path, ["llama"], ["float32"], 2)[0]
    assert cell.unsupported == "UnsupportedModel: cache layer 0 is a LinearAttentionLayer" and not cell.exact
    assert "unsupported: UnsupportedModel" in mx.markdown_table([cell])

    def broken(manifest, *a, **k):  # not a refusal: a bug must stop the matrix, not hide in an unsupported cell
        raise RuntimeError("The size of tensor a (8) must match the size of tensor b (16)")

    monkeypatch.setattr(mx, "load_engine", broken)
    with pytest.raises(RuntimeError, match="size of tensor"):
        mx.run_profile("portable", tmp_path, ["llama"], ["float32"], 2)


def test_one_process_runs_one_profile(tmp_path, monkeypatch):
    import os

    from kvgraft_cli.config.profiles import KNOWN_BIT_ENV

    for name in KNOWN_BIT_ENV:  # the refused run still rewrites os.environ; monkeypatch puts it back afterwards
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.delenv(name, raising=False)
    # This process imported torch under the portable flags (conftest): running native here would mislabel cells.
    with pytest.raises(DriftError, match="torch already imported"):
        mx.run_profile("native", tmp_path, ["llama"], ["float32"], 1)
    with pytest.raises(InputError, match="unknown architecture, dtype or profile: mamba, float8"):
        mx.run_profile("portable", tmp_path, ["mamba"], ["float8"], 1)


def test_markdown_table_layout():
    cells = [
        mx.Cell("llama", d, p, "cpu", "eager", 50, 50, 0.0, 1.0, "f" * 64)
        for p in ("portable", "native")
        for d in ("float32", "bfloat16")
    ]
    cells.append(mx.Cell("gpt2", "float32", "portable", "cpu", "eager", 50, 49, 1e-9, 0.99, "e" * 64))
    table = mx.markdown_table(cells).splitlines()
    assert table[0] == "| architecture | float32 portable | bfloat16 portable | float32 native | bfloat16 native |"
    assert table[2] == "| llama | 50/50, KL 0, 100% | 50/50, KL 0, 100% | 50/50, KL 0, 100% | 50/50, KL 0, 100% |"
    assert table[3] == "| gpt2 | 49/50, KL 1e-09, 99% |  |  |  |"


def test_matrix_cli_runs_each_profile_in_its_own_process(tmp_path):
    p = run_cli(
        "matrix",
        "--arch",
        "gpt2",
        "--arch",
        "mistral",
        "--dtype",
        "bfloat16",
        "--samples",
        "3",
        "--json",
        cwd=tmp_path,
        check_rc=0,
    )
    report = json.loads(p.stdout)
    assert report["total"] == report["exact"] == 4 and report["unsupported"] == 0
    assert {(c["arch"], c["profile"]) for c in report["cells"]} == {
        (a, p) for a in ("gpt2", "mistral") for p in ("portable", "native")
    }
    md = run_cli(
        "matrix",
        "--arch",
        "qwen2",
        "--dtype",
        "float32",
        "--profile",
        "portable",
        "--samples",
        "2",
        "--markdown",
        cwd=tmp_path,
        check_rc=0,
    )
    assert md.stdout.splitlines()[:3] == [
        "| architecture | float32 portable |",
        "|---|---|",
        "| qwen2 | 2/2, KL 0, 100% |",
    ]
    bad = run_cli("matrix", "--arch", "mamba", cwd=tmp_path, check_rc=2)
    assert (
        bad.stderr.startswith("Error: unknown architecture, dtype or profile: mamba") and "Traceback" not in bad.stderr
    )
