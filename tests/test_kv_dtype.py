"""model.kv_dtype: a 16-bit KV cache under a float32 model (engine.growcache rounds every state written into it,
engine.attention and engine.lean widen it where attention reads it). Its own bits, exact like every other
configuration: a graft equals the fresh computation byte for byte, the artifact holds the keys and values at 16
bits, and what cannot keep the cache narrow is refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import run_cli

from kvgraft_cli.artifacts import format as kvg
from kvgraft_cli.config.manifest import validate_data
from kvgraft_cli.engine.engine import load_engine, tensor_sha256
from kvgraft_cli.engine.zoo import tiny_manifest
from kvgraft_cli.errors import ArtifactError, ModelMismatch, UnsupportedModel


def _engine(tmp_path, kv_dtype="float16", **kw):
    return load_engine(tiny_manifest("llama", tmp_path, attn_implementation="grouped", kv_dtype=kv_dtype, **kw))


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_a_graft_of_a_16_bit_cache_is_the_fresh_computation(tmp_path, kv_dtype):
    eng = _engine(tmp_path, kv_dtype)
    wide = getattr(torch, kv_dtype)
    ids = [int(t) for t in np.random.default_rng(1).integers(3, 200, 40)]
    query = [5, 6, 7, 8, 9]
    cache, last = eng.prefill(ids)
    assert all(layer.keys.dtype == wide and layer.values.dtype == wide for layer in cache.layers)
    payload = kvg.encode(ids, eng.capture(cache), eng.artifact_meta(tensor_sha256(last)))
    fresh = eng.forward(cache, query)
    fresh_tokens, _ = eng.greedy(cache, fresh[-1], 6)
    path = tmp_path / "a.kvg"
    kvg.write_file(path, payload, codec="raw")
    sha, art = kvg.open_file(path, kvg.payload_identity(payload), room=256)
    assert art.meta["kv_dtype"] == kv_dtype and art.meta["dtype"] == "float32"
    assert all(st.keys.dtype == wide for st in art.layers if st.kind == "full")
    header = kvg.read_header(payload)
    assert {header[k]["dtype"] for k in header if k.startswith("layers.")} == {
        "F16" if kv_dtype == "float16" else "BF16"
    }
    from kvgraft_cli.artifacts.inspect import read_info

    shown = read_info(path)
    assert (shown.dtype, shown.kv_dtype) == ("float32", kv_dtype) and "kv_dtype" not in shown.other_metadata
    grafted = eng.restore(art.layers)
    got = eng.forward(grafted, query)
    assert tensor_sha256(got) == tensor_sha256(fresh)  # the bytes, not closeness
    tokens, _ = eng.greedy(grafted, got[-1], 6)
    assert tokens == fresh_tokens
    for a, b in zip(cache.layers, grafted.layers):  # the decode steps after the graft wrote the same 16-bit states
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_the_cache_holds_the_float32_states_rounded_once(tmp_path):
    """The 16-bit cache holds what the float32 cache holds, each state rounded to nearest once: the same forward's
    keys and values under the model's own width, narrowed, are its bytes (the first layer's, whose inputs do not
    depend on the cache's width yet). A cache that rounded twice, or truncated, would differ."""
    narrow = _engine(tmp_path / "n")
    wide = _engine(tmp_path / "w", kv_dtype=None)
    ids = [int(t) for t in np.random.default_rng(2).integers(3, 200, 12)]
    a, _ = narrow.prefill(ids)
    b, _ = wide.prefill(ids)
    assert b.layers[0].keys.dtype == torch.float32
    assert torch.equal(a.layers[0].keys, b.layers[0].keys.to(torch.float16))
    assert torch.equal(a.layers[0].values, b.layers[0].values.to(torch.float16))
    assert not torch.equal(a.layers[0].keys.to(torch.float32), b.layers[0].keys)  # it did narrow them


def test_attention_widens_the_cache_exactly():
    """grouped attention over float16 keys and values is attention over their exact float32 values."""
    from kvgraft_cli.engine.attention import grouped_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 3, 16, generator=g)
    k, v = (torch.randn(1, 2, 40, 16, generator=g).to(torch.float16) for _ in range(2))
    module = torch.nn.Module()
    got, _ = grouped_attention(module, q, k, v, None, 0.25)
    want, _ = grouped_attention(module, q, k.float(), v.float(), None, 0.25)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_an_artifact_of_another_cache_width_is_refused(tmp_path):
    narrow, wide = _engine(tmp_path / "n"), _engine(tmp_path / "w", kv_dtype=None)
    ids = [3, 4, 5, 6]
    cache, last = narrow.prefill(ids)
    meta = narrow.artifact_meta(tensor_sha256(last))
    art = kvg.decode(kvg.encode(ids, narrow.capture(cache), meta))
    with pytest.raises(ModelMismatch, match="KV cache width"):
        kvg.check_compatible(art.meta, wide.compatibility(), "a.kvg")
    kvg.check_compatible(art.meta, narrow.compatibility(), "a.kvg")
    # tensors wider than the metadata says are refused by the header check, and so is a width kvgraft never writes
    bad = kvg.encode(ids, wide.capture(wide.prefill(ids)[0]), meta)
    with pytest.raises(ArtifactError, match="wrong dtype"):
        kvg.decode(bad)
    odd = kvg.encode(ids, narrow.capture(cache), {**meta, "kv_dtype": "float8"})
    with pytest.raises(ArtifactError, match="kv_dtype 'float8' is not one kvgraft writes"):
        kvg.decode(odd)


def test_what_cannot_keep_a_narrow_cache_is_refused(tmp_path, monkeypatch):
    m = tiny_manifest("llama", tmp_path, attn_implementation="grouped", kv_dtype="float16").data
    for change, field in (
        ({"attn_implementation": "eager"}, "attn_implementation grouped"),
        ({"dtype": "bfloat16"}, "float32 model"),
    ):
        data = json.loads(json.dumps(m))
        data["model"].update(change)
        assert any("model.kv_dtype" in p and field in p for p in validate_data(data, "m.yaml")), change
    monkeypatch.setenv("KVGRAFT_GROW_IN_PLACE", "0")
    with pytest.raises(UnsupportedModel, match="grows on the CPU"):
        _engine(tmp_path)
    monkeypatch.delenv("KVGRAFT_GROW_IN_PLACE")
    with pytest.raises(UnsupportedModel, match="sliding layers"):
        load_engine(tiny_manifest("gemma2", tmp_path, attn_implementation="grouped", kv_dtype="float16"))


def test_manifest_init_writes_it_and_refuses_it_without_grouped_attention(tmp_path):
    r = run_cli("manifest", "init", "builtin:tiny-gemma4", "--kv-dtype", "float16", cwd=tmp_path)
    assert r.returncode == 2 and "--attn grouped" in r.stderr and "Traceback" not in r.stderr
    tiny_manifest("llama", tmp_path)  # writes the tiny Llama's checkpoint
    model = str(tmp_path / "llama-model")
    r = run_cli("manifest", "init", model, "--kv-dtype", "float16", "--attn", "grouped", "-o", "m.yaml", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "kv_dtype: float16" in (tmp_path / "m.yaml").read_text()
    r = run_cli("manifest", "validate", "m.yaml", cwd=tmp_path)
    assert r.returncode == 0, r.stderr


def test_one_batched_pass_keeps_the_cache_narrow_too(tmp_path):
    """engine.batched_pass (what `graft --check` compares with one plain call of the model) runs on the 16-bit cache
    under model.kv_dtype: the model's own cache would keep float32 states, another configuration."""
    narrow, wide = _engine(tmp_path / "n"), _engine(tmp_path / "w", kv_dtype=None)
    ids = [int(t) for t in np.random.default_rng(4).integers(3, 200, 20)]
    a, b = narrow.batched_pass(ids, 5), wide.batched_pass(ids, 5)
    assert not torch.equal(a, b)
    cache = narrow.new_cache()
    with narrow._infer():
        want = narrow.model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=5).logits[0]
    assert torch.equal(a, want) and cache.layers[0].keys.dtype == torch.float16


def test_a_chain_of_16_bit_links_and_the_probe_keep_the_width(tmp_path):
    """A chain link continues a grafted 16-bit root (engine.restore_chain joins the links into buffers of that width)
    and grafts byte-equal to computing root and link in one cache; the probe's re-rotation keeps the cache's width and
    its own position (offset 0) exact."""
    from kvgraft_cli.runs.probe import rerotate

    eng = _engine(tmp_path)
    root_ids, link_ids, query = [3, 4, 5, 6, 7, 8], [9, 10, 11, 12], [13, 14]
    cache, last = eng.prefill(root_ids)
    root = kvg.decode(kvg.encode(root_ids, eng.capture(cache), eng.artifact_meta(tensor_sha256(last))))
    cache, last = eng.prefill(link_ids, cache=cache)
    meta = eng.artifact_meta(tensor_sha256(last), start=len(root_ids), parent="a" * 64)
    link = kvg.decode(kvg.encode(link_ids, eng.capture(cache, start=len(root_ids)), meta))
    fresh = eng.forward(cache, query)
    chained = eng.restore_chain([root, link])
    assert chained.layers[0].keys.dtype == torch.float16
    assert tensor_sha256(eng.forward(chained, query)) == tensor_sha256(fresh)
    moved = eng.restore(root.layers)
    rerotate(eng, moved, 0)
    assert moved.layers[0].keys.dtype == torch.float16
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(moved.layers, eng.restore(root.layers).layers))
