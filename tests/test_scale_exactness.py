"""scripts/scale_exactness.py, the graft-vs-fresh check at real scale that scripts/gpu_check.sh runs on a lent GPU
(GPU_SCALE=1): its code path end to end on the CPU with small models (the tiny shape, and a config.json of another
architecture through --config), and the large shapes' sizes as the script's docstring states them (counted on the
meta device: nothing allocated)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "scale_exactness.py"
sys.path.insert(0, str(REPO / "scripts"))


def _run(*args: str) -> tuple[int, list[dict]]:
    p = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--device",
            "cpu",
            "--samples",
            "3",
            "--prefix-chars",
            "1",
            "60",
            "--json",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert p.returncode in (0, 1), p.stderr[-2000:]
    return p.returncode, [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_shape_grafts_byte_equal(dtype):
    rc, records = _run("--shape", "tiny", "--dtype", dtype)
    assert rc == 0 and len(records) == 1
    r = records[0]
    assert r["exact"] and r["samples"] == r["sha_equal"] == 3 and r["max_kl"] == 0.0
    assert r["arch"] == "tiny" and r["dtype"] == dtype and r["device"] == "cpu" and r["attn"] == "eager"
    assert r["parameters"] > 0 and len(r["fingerprint"]) == 64


def test_config_file_builds_that_architecture(tmp_path):
    """--config takes a Hugging Face config.json (here the zoo's Llama, not Gemma-4) and runs it the same way."""
    from kvgraft_cli.engine.zoo import ARCHS

    ARCHS["llama"].make_config().save_pretrained(tmp_path)
    rc, records = _run("--config", str(tmp_path / "config.json"))
    assert rc == 0 and records[0]["exact"] and records[0]["samples"] == 3
    assert records[0]["arch"] == "config.json"


def test_large_shapes_are_the_sizes_the_docstring_says():
    import scale_exactness as se

    for name, billions, layers in (("gemma3-12b-dims", 12.1, 48), ("gemma3-27b-dims", 29.2, 62)):
        config = se.shape_config(name)
        assert round(se.parameter_count(config) / 1e9, 1) == billions, name
        assert f"{billions}B parameters" in se.__doc__
        kinds = config.layer_types
        assert len(kinds) == layers and kinds[-1] == "full_attention"
        assert kinds.count("full_attention") == layers // 6 + (layers % 6 != 0)  # 5 local : 1 global, last global
        assert config.sliding_window == 1024 and config.vocab_size == 262_144


def test_layers_cuts_the_depth_and_keeps_the_widths():
    """--layers (what fits a CPU's memory): the shape's widths, fewer layers, the last one global."""
    import scale_exactness as se

    full, cut = se.shape_config("gemma3-12b-dims"), se.shape_config("gemma3-12b-dims", layers=6)
    assert cut.num_hidden_layers == 6 and cut.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    for field in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "sliding_window",
    ):
        assert getattr(cut, field) == getattr(full, field), field
    # head_dim differs by layer kind (Gemma-4's global layers are wider): compare a sliding and the global layer
    for i_cut, i_full in ((0, 0), (5, 47)):
        assert cut.per_layer_config[i_cut].head_dim == full.per_layer_config[i_full].head_dim


def test_random_engine_names_its_draw(tmp_path):
    """engine.randommodel: the model's name covers how its weights were drawn (another seed, another model hash),
    and the same seed draws the same weights (equal logits bytes)."""
    from kvgraft_cli.engine.engine import tensor_sha256
    from kvgraft_cli.engine.randommodel import random_engine
    from kvgraft_cli.engine.tinymodel import build_config

    def draw(seed, where):
        eng = random_engine(
            "tiny", build_config(), tmp_path / where, device="cpu", dtype="float32", profile="portable", seed=seed
        )  # the flags this test process runs under
        logits = eng.forward(eng.new_cache(), eng.prefix_ids("the same prompt"))
        return eng, tensor_sha256(logits)

    (a, la), (b, lb), (c, lc) = draw(0, "a"), draw(0, "b"), draw(1, "c")
    assert a.hashes.model_sha256 == b.hashes.model_sha256 != c.hashes.model_sha256
    assert a.hashes.tokenizer_sha256 == c.hashes.tokenizer_sha256
    assert la == lb != lc
    assert a.manifest.model.sha256 == a.hashes.model_sha256 and a.manifest.runtime.device == "cpu"
    assert "(weights)" in a.hashes.files and a.model.config._attn_implementation == "eager"


def test_refusals_are_one_error_line(tmp_path):
    """No GPU (on this CPU machine) and a config file that is not one: exit 2, one `Error:` line, no traceback."""
    import torch

    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    cases = [["--config", str(bad), "--device", "cpu"], ["--config", str(tmp_path / "missing.json"), "--device", "cpu"]]
    if not torch.cuda.is_available():
        cases.append(["--shape", "tiny", "--device", "cuda"])
    for args in cases:
        p = subprocess.run(
            [sys.executable, str(SCRIPT), "--samples", "1", *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        assert p.returncode == 2, (args, p.stderr[-500:])
        assert p.stderr.startswith("Error: ") and "Traceback" not in p.stderr, p.stderr[-500:]
        assert ("no CUDA GPU" in p.stderr) if "cuda" in args else (f"Error: {args[1]}: not a readable" in p.stderr)
