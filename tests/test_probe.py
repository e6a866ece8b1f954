"""The own-position probe: offset 0 is the only exact point on rotary models, re-rotation is the model's own
rotary embedding (close to the keys computed at K, exactly the identity at 0), GPT-2 is explained, not moved."""

from __future__ import annotations

import json

import pytest
from conftest import EXAMPLES, run_cli

from kvgraft_cli import artifact as kvg
from kvgraft_cli.archs import tiny_manifest
from kvgraft_cli.engine import load_engine, tensor_sha256
from kvgraft_cli.errors import InputError
from kvgraft_cli.graft import Loaded
from kvgraft_cli.hashing import sha256_bytes
from kvgraft_cli.probe import LEARNED_NOTE, positions_kind, probe, rerotate
from kvgraft_cli.runctx import RunContext

PREFIX = "A prefix longer than the sixteen-token window of the sliding layers. " * 2


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return tmp_path_factory.mktemp("zoo")


def _loaded(eng, text=PREFIX):
    ids = eng.prefix_ids(text)
    cache, last = eng.prefill(ids)
    payload = kvg.encode(ids, eng.capture(cache), eng.artifact_meta(tensor_sha256(last)))
    return Loaded(sha256_bytes(payload), kvg.decode(payload), "memory")


@pytest.mark.parametrize("arch,dtype", [("llama", "float32"), ("gemma2", "float32"), ("qwen3", "bfloat16"),
                                        ("phi3", "float32"), ("gpt2", "float32")])
def test_offset_zero_is_the_only_exact_point(tmp_path, zoo, arch, dtype):
    eng = load_engine(tiny_manifest(arch, zoo, dtype=dtype))
    ctx = RunContext.make(eng.manifest, tmp_path / "store", tmp_path / "ledger.jsonl")
    report = probe(ctx, eng, _loaded(eng), [0, 1, 5, 64], samples=3)
    assert report.exact_offsets == [0] and report.own_position_unique
    zero, *others = report.offsets
    assert zero.max_abs_diff == 0.0 and zero.max_kl == 0.0 and zero.argmax_agreement == 1.0
    assert all(o.max_abs_diff > 0 for o in others)
    if arch == "gpt2":
        assert report.positions == "learned" and report.method == "unmoved cache" and report.note == LEARNED_NOTE
        assert zero.unmoved_max_abs_diff is None
    else:
        assert report.positions == "rotary"
        # Re-rotation is what makes a shifted graft close: without it the error is orders of magnitude larger.
        for o in others:
            assert o.unmoved_max_abs_diff > 10 * o.max_abs_diff
    entry = json.loads((tmp_path / "ledger.jsonl").read_text().splitlines()[-1])
    assert entry["kind"] == "probe" and entry["outputs"]["result"]["exact_offsets"] == [0]


def test_rerotation_uses_the_models_rotary_embedding(zoo):
    import torch

    eng = load_engine(tiny_manifest("llama", zoo))
    assert positions_kind(eng) == "rotary"
    ids = eng.prefix_ids("rotate me")
    at_zero, _ = eng.prefill(ids)
    keys0 = [layer.keys.clone() for layer in at_zero.layers]
    rerotate(eng, at_zero, 0)  # the identity: cos 1, sin 0
    assert all(torch.equal(a, layer.keys) for a, layer in zip(keys0, at_zero.layers))
    rerotate(eng, at_zero, 37)
    direct, _ = eng.prefill(ids, offset=37)
    for moved, ref, before in zip(at_zero.layers, direct.layers, keys0):
        # Close to the keys computed at 37 (same rotation, other rounding), far from the unmoved ones.
        assert (moved.keys - ref.keys).abs().max() < 1e-5 < (before - ref.keys).abs().max()
        assert torch.equal(moved.values, ref.values) or (moved.values - ref.values).abs().max() < 1e-5


def test_offsets_past_the_position_limit_are_refused(tmp_path, zoo):
    eng = load_engine(tiny_manifest("llama", zoo))
    ctx = RunContext.make(eng.manifest, tmp_path / "store", tmp_path / "ledger.jsonl")
    with pytest.raises(InputError, match="past the model's 512 positions"):
        probe(ctx, eng, _loaded(eng), [0, 500], samples=1)
    assert not (tmp_path / "ledger.jsonl").exists()


def test_probe_cli_on_the_embedded_model(tmp_path):
    run_cli("deposit", str(EXAMPLES), "--limit", "1", cwd=tmp_path, check_rc=0)
    p = run_cli("probe", "--offsets", "0,1,64", "--samples", "2", "--json", cwd=tmp_path, check_rc=0)
    report = json.loads(p.stdout)
    assert report["exact_offsets"] == [0] and report["positions"] == "rotary"
    assert [o["offset"] for o in report["offsets"]] == [0, 1, 64]
    human = run_cli("probe", "--offsets", "0,3", "--samples", "1", cwd=tmp_path, check_rc=0)
    assert "offset 0 is the only exact point" in human.stdout
    run_cli("verify", cwd=tmp_path, check_rc=0)
    bad = run_cli("probe", "--offsets", "0,x", cwd=tmp_path, check_rc=2)
    assert bad.stderr.startswith("Error: --offsets must be comma-separated integers")
    assert "Traceback" not in bad.stderr
