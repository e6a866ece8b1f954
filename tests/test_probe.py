"""The own-position probe: offset 0 is the only exact point on rotary models, re-rotation is the model's own
rotary embedding (close to the keys computed at K, exactly the identity at 0), GPT-2 is explained, not moved."""

from __future__ import annotations

import json

import pytest
from conftest import EXAMPLES, deposit_here, run_cli

from kvgraft_cli.artifacts import format as kvg
from kvgraft_cli.engine.engine import load_engine, tensor_sha256
from kvgraft_cli.engine.zoo import tiny_manifest
from kvgraft_cli.errors import InputError
from kvgraft_cli.runs.context import RunContext
from kvgraft_cli.runs.graft import Loaded
from kvgraft_cli.runs.probe import LEARNED_NOTE, positions_kind, probe, rerotate
from kvgraft_cli.util.hashing import sha256_bytes

PREFIX = "A prefix longer than the sixteen-token window of the sliding layers. " * 2


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return tmp_path_factory.mktemp("zoo")


def _loaded(eng, text=PREFIX):
    ids = eng.prefix_ids(text)
    cache, last = eng.prefill(ids)
    payload = kvg.encode(ids, eng.capture(cache), eng.artifact_meta(tensor_sha256(last)))
    return Loaded(sha256_bytes(payload), kvg.decode(payload), "memory")


@pytest.mark.parametrize(
    "arch,dtype",
    [("llama", "float32"), ("gemma2", "float32"), ("qwen3", "bfloat16"), ("phi3", "float32"), ("gpt2", "float32")],
)
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


def test_probe_cli_on_the_embedded_model(tmp_path, engine):
    deposit_here(engine, tmp_path, str(EXAMPLES), limit=1)
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


def _zoo_engine(tmp_path, name, config):
    from kvgraft_cli.config.manifest import dump_yaml, load_manifest, make_manifest
    from kvgraft_cli.config.modelhash import hash_model_dir
    from kvgraft_cli.engine.tinymodel import write_tiny_model

    d = write_tiny_model(tmp_path / name, seed=1, config=config)
    h = hash_model_dir(d)
    (tmp_path / f"{name}.yaml").write_text(
        dump_yaml(make_manifest(str(d), h.model_sha256, h.tokenizer_sha256, profile="portable"))
    )
    return load_engine(load_manifest(tmp_path / f"{name}.yaml"))


def test_multimodal_gemma3_is_probed_through_its_text_decoder(tmp_path):
    # A real Gemma-3 checkpoint loads as Gemma3ForConditionalGeneration, whose base model holds no rotary module:
    # the probe must find the decoder's, not call the model "learned".
    import transformers as T

    from kvgraft_cli.engine.zoo import _COMMON

    text = dict(_COMMON, head_dim=8, sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    vision = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=16
    )
    cfg = T.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=3,
        eoi_token_index=3,
        image_token_index=3,
    )
    eng = _zoo_engine(tmp_path, "gemma3-mm", cfg)
    assert type(eng.model).__name__ == "Gemma3ForConditionalGeneration" and positions_kind(eng) == "rotary"
    ctx = RunContext.make(eng.manifest, tmp_path / "store", tmp_path / "ledger.jsonl")
    report = probe(ctx, eng, _loaded(eng), [0, 1, 7], samples=2)
    assert report.exact_offsets == [0]
    assert all(o.unmoved_max_abs_diff > 10 * o.max_abs_diff for o in report.offsets[1:])


def test_layouts_the_probe_cannot_move_are_refused(tmp_path, zoo):
    import transformers as T

    from kvgraft_cli.engine.zoo import _COMMON
    from kvgraft_cli.errors import UnsupportedModel

    eng = _zoo_engine(tmp_path, "smollm3", T.SmolLM3Config(**_COMMON))  # some layers without RoPE
    with pytest.raises(UnsupportedModel, match="no_rope_layers"):
        positions_kind(eng)
    llama = load_engine(tiny_manifest("llama", zoo))
    ctx = RunContext.make(llama.manifest, tmp_path / "store", tmp_path / "ledger.jsonl")
    with pytest.raises(InputError, match="include 0"):
        probe(ctx, llama, _loaded(llama), [1, 8], samples=1)
    with pytest.raises(InputError, match="at least 2 tokens"):
        probe(ctx, llama, _loaded(llama, text=""), [0, 1], samples=1)  # BOS alone re-rotates exactly anywhere
    assert not (tmp_path / "ledger.jsonl").exists()


def test_no_ref_after_solve_is_the_latest_deposit_not_a_chain_link(tmp_path, deposited, engine):
    """`solve` with related hits stores chain links, newer in the index than every deposit; `probe` and `graft`
    without REF take the latest deposited artifact, never a link (a fragment that continues another artifact)."""
    import shutil

    from kvgraft_cli.ledger import log as ledger
    from kvgraft_cli.library.solve import solve
    from kvgraft_cli.runs.graft import graft_generate
    from kvgraft_cli.store.local import Store

    dctx, dreport = deposited
    shutil.copytree(dctx.store, tmp_path / "store")
    ctx = RunContext.make(engine.manifest, tmp_path / "store", tmp_path / "ledger.jsonl")
    latest = [r.artifact for r in dreport.results if r.status == "deposited"][-1]
    # Two problems the library does not hold: each a related hit grafted as a chain of 2, one new link each.
    (tmp_path / "p.jsonl").write_text("".join(line + "\n" for line in EXAMPLES.read_text().splitlines()[-2:]))
    run = solve(ctx, tmp_path / "p.jsonl", tmp_path / "out.jsonl", k=2, engine=engine)
    links = [sha for r in run.records for sha in r.chain[1:]]
    assert len(links) == 2 and latest not in links
    with Store(ctx.store, create=False) as store:
        newest = store.entries()[-1].artifact
        assert newest in links  # what the newest index row names: the old default
        _, art = store.load(newest, remember=False)
        assert art.parent is not None
        assert store.resolve(None, engine.manifest.compute_sha256) == latest

    report = probe(ctx, engine, None, [0, 1], samples=1)
    assert report.artifact == latest
    entry = ledger.read(ctx.ledger)[-1]
    assert entry["kind"] == "probe" and entry["inputs"]["artifact"]["sha256"] == latest
    assert "chain" not in entry["inputs"]
    assert graft_generate(ctx, engine, None, "What is the final answer?", 1).artifact == latest
