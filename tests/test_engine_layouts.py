"""Cache layouts beyond the default: Gemma-4 KV sharing (layers that hold no KV) and a plain Llama."""

from __future__ import annotations

import pytest

from kvgraft_cli.artifacts import format as kvg
from kvgraft_cli.config.manifest import dump_yaml, load_manifest
from kvgraft_cli.config.modelhash import hash_model_dir
from kvgraft_cli.engine.engine import load_engine, tensor_sha256
from kvgraft_cli.engine.tinymodel import SPECIALS, build_config, write_tiny_model


def _gemma_shared():
    return build_config(
        num_hidden_layers=6,
        num_kv_shared_layers=2,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    )


def _llama():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(SPECIALS) + 256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )


@pytest.mark.parametrize(
    "make_config,kinds",
    [
        (_gemma_shared, ["sliding", "sliding", "full", "sliding", "empty", "empty"]),
        (_llama, ["full", "full"]),
    ],
)
def test_roundtrip_graft_is_exact(tmp_path, make_config, kinds):
    import torch

    model_dir = write_tiny_model(tmp_path / "model", seed=3, config=make_config())
    data = load_manifest(None).data
    h = hash_model_dir(model_dir)
    data["model"].update(path=str(model_dir), sha256=h.model_sha256, tokenizer_sha256=h.tokenizer_sha256)
    (tmp_path / "m.yaml").write_text(dump_yaml(data))
    eng = load_engine(load_manifest(tmp_path / "m.yaml"))
    assert [k for k, _ in eng.layout] == kinds

    ids = eng.prefix_ids("A prefix that is longer than the thirty-two token sliding window of the model. " * 2)
    cache, last = eng.prefill(ids)
    payload = kvg.encode(ids, eng.capture(cache), eng.artifact_meta(tensor_sha256(last)))
    art = kvg.decode(payload)
    assert [l.kind for l in art.layers] == kinds
    kvg.check_compatible(art.meta, eng.compatibility(), "t")

    suffix = eng.encode(" and a suffix")
    fresh, _ = eng.prefill(ids)
    want = eng.forward(fresh, suffix)
    got = eng.forward(eng.restore(art.layers), suffix)
    assert torch.equal(want, got)
