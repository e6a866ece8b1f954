"""Graft exactness across architectures, each a tiny seeded config built here (no download): full-attention,
sliding-window and mixed layouts, rotary and learned absolute positions. Other cache state is refused by name."""

from __future__ import annotations

import pytest

from kvgraft_cli.artifacts import format as kvg
from kvgraft_cli.config.manifest import dump_yaml, load_manifest
from kvgraft_cli.config.modelhash import hash_model_dir
from kvgraft_cli.engine.engine import load_engine, tensor_sha256
from kvgraft_cli.engine.tinymodel import write_tiny_model
from kvgraft_cli.engine.zoo import _COMMON, ARCHS
from kvgraft_cli.errors import UnsupportedModel

ARCH_NAMES = list(ARCHS)
COMMON = _COMMON  # the zoo's shared tiny dimensions, reused for the refused Qwen3-Next below


def _engine(tmp_path, config, dtype="float32"):
    d = write_tiny_model(tmp_path / "model", seed=1, config=config)
    data = load_manifest(None).data
    h = hash_model_dir(d)
    data["model"].update(path=str(d), sha256=h.model_sha256, tokenizer_sha256=h.tokenizer_sha256, dtype=dtype)
    (tmp_path / "m.yaml").write_text(dump_yaml(data))
    return load_engine(load_manifest(tmp_path / "m.yaml"))


@pytest.mark.parametrize(
    "arch,dtype",
    [(a, "float32") for a in ARCH_NAMES]
    + [(a, d) for a in ("llama", "gemma2", "gemma4", "gpt2") for d in ("bfloat16", "float16")],
)
def test_graft_is_byte_exact(tmp_path, arch, dtype):
    import torch

    spec = ARCHS[arch]
    eng = _engine(tmp_path, spec.make_config(), dtype)
    assert tuple(k for k, _ in eng.layout) == spec.layer_kinds
    ids = eng.prefix_ids("A prefix longer than the sixteen-token window of the sliding layers. " * 2)
    cache, last = eng.prefill(ids)
    art = kvg.decode(kvg.encode(ids, eng.capture(cache), eng.artifact_meta(tensor_sha256(last))))
    kvg.check_compatible(art.meta, eng.compatibility(), arch)
    assert all(l.keys.dtype == getattr(torch, dtype) for l in art.layers if l.kind != "empty")
    for suffix_text in (" a suffix", "\nQuestion: and then?\nAnswer:"):
        suffix = eng.encode(suffix_text)
        fresh, _ = eng.prefill(ids)
        grafted = eng.restore(art.layers)
        want, got = eng.forward(fresh, suffix), eng.forward(grafted, suffix)
        assert torch.equal(want, got), arch
        gen_f, steps_f = eng.greedy(fresh, want[-1], 4)
        gen_g, steps_g = eng.greedy(grafted, got[-1], 4)
        assert gen_f == gen_g and torch.equal(steps_f, steps_g)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_new_caches_are_copies_of_one_template_that_share_no_layer(tmp_path, arch):
    """engine._empty_cache: a model whose layers hold plain values only (llama) copies one template built from the
    config; one with sliding layers (a tensor of their window: gemma2) builds each cache from the config. Either way
    each cache has layers of its own, of the types the config builds, and the template never fills."""
    from transformers import DynamicCache

    eng = _engine(tmp_path, ARCHS[arch].make_config())
    want = [type(layer) for layer in DynamicCache(config=eng.model.config).layers]
    caches = [eng.new_cache(grow=False), eng.new_cache(grow=False)]
    assert (eng._empty is not False) == (arch == "llama")
    for cache in caches:
        assert [type(layer) for layer in cache.layers] == want
    ids = eng.prefix_ids("A prefix longer than the sixteen-token window of the sliding layers. " * 2)
    eng.forward(caches[0], ids)
    assert all(layer.is_initialized for layer in caches[0].layers)
    assert not any(layer.is_initialized for layer in caches[1].layers)
    template = eng._empty.layers if eng._empty else []
    assert not any(layer.is_initialized for layer in template)
    held = {id(layer) for cache in caches for layer in cache.layers} | {id(layer) for layer in template}
    assert len(held) == 2 * len(want) + len(template)


def test_linear_attention_cache_is_refused_by_name(tmp_path):
    import transformers as T

    cfg = T.Qwen3NextConfig(
        **{**COMMON, "head_dim": 8},
        layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    )
    with pytest.raises(UnsupportedModel, match="LinearAttentionLayer"):
        _engine(tmp_path, cfg)
