"""Graft exactness across architectures, each a tiny seeded config built here (no download): full-attention,
sliding-window and mixed layouts, rotary and learned absolute positions. Other cache state is refused by name."""

from __future__ import annotations

import pytest

from kvgraft_cli import artifact as kvg
from kvgraft_cli.engine import load_engine, tensor_sha256
from kvgraft_cli.errors import UnsupportedModel
from kvgraft_cli.manifest import dump_yaml, load_manifest
from kvgraft_cli.modelhash import hash_model_dir
from kvgraft_cli.tinymodel import SPECIALS, build_config, write_tiny_model

V = len(SPECIALS) + 256
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2)


def _configs():
    import transformers as T

    return {
        "llama": (lambda: T.LlamaConfig(**COMMON), ["full", "full"]),
        "mistral": (lambda: T.MistralConfig(**COMMON, sliding_window=16), ["sliding", "sliding"]),
        "qwen2": (lambda: T.Qwen2Config(**COMMON), ["full", "full"]),
        "qwen3": (lambda: T.Qwen3Config(**COMMON, head_dim=8), ["full", "full"]),
        "gemma2": (lambda: T.Gemma2Config(**COMMON, head_dim=8, sliding_window=16), ["sliding", "full"]),
        "gemma3": (lambda: T.Gemma3TextConfig(**COMMON, head_dim=8, sliding_window=16,
                                              layer_types=["sliding_attention", "full_attention"]), ["sliding", "full"]),
        "gemma4": (lambda: build_config(), ["sliding", "sliding", "sliding", "full"]),
        "phi3": (lambda: T.Phi3Config(**COMMON), ["full", "full"]),
        "olmo2": (lambda: T.Olmo2Config(**COMMON), ["full", "full"]),
        "gpt2": (lambda: T.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=512, bos_token_id=2,
                                      eos_token_id=1), ["full", "full"]),
    }


ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma4", "phi3", "olmo2", "gpt2"]


def _engine(tmp_path, config, dtype="float32"):
    d = write_tiny_model(tmp_path / "model", seed=1, config=config)
    data = load_manifest(None).data
    h = hash_model_dir(d)
    data["model"].update(path=str(d), sha256=h.model_sha256, tokenizer_sha256=h.tokenizer_sha256, dtype=dtype)
    (tmp_path / "m.yaml").write_text(dump_yaml(data))
    return load_engine(load_manifest(tmp_path / "m.yaml"))


@pytest.mark.parametrize("arch,dtype", [(a, "float32") for a in ARCHS]
                         + [(a, d) for a in ("llama", "gemma2", "gemma4", "gpt2") for d in ("bfloat16", "float16")])
def test_graft_is_byte_exact(tmp_path, arch, dtype):
    import torch

    make, kinds = _configs()[arch]
    eng = _engine(tmp_path, make(), dtype)
    assert [k for k, _ in eng.layout] == kinds
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


def test_linear_attention_cache_is_refused_by_name(tmp_path):
    import transformers as T

    cfg = T.Qwen3NextConfig(**{**COMMON, "head_dim": 8}, layer_types=["linear_attention", "full_attention"],
                            linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                            linear_value_head_dim=8, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                            shared_expert_intermediate_size=16)
    with pytest.raises(UnsupportedModel, match="LinearAttentionLayer"):
        _engine(tmp_path, cfg)
