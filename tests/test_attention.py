"""engine.attention's ``grouped`` kernel: it computes eager attention's arithmetic (checked bit for bit where the
order of sums cannot matter), a graft under it is byte-equal to a fresh computation under it across the zoo, a user
pins it with `manifest init --attn grouped`, and what it does not implement is refused by name."""

from __future__ import annotations

import json

import pytest
from conftest import EXAMPLES, run_cli

from kvgraft_cli.engine.attention import grouped_attention
from kvgraft_cli.errors import UnsupportedModel
from kvgraft_cli.runs import matrix as mx


def _inputs(heads, kv_heads, q_len, keys, dtype):
    """Small-integer queries and keys (their products and sums are exact in any order) and values with a single 1
    per column (each output is one softmax weight, exactly): what is left to compare is which query row reads which
    key of which KV head, the scale, the cap, the mask and the softmax."""
    import torch

    g = torch.Generator().manual_seed(heads * 1000 + kv_heads * 100 + q_len * 10 + keys)
    dim = 8
    q = torch.randint(-3, 4, (1, heads, q_len, dim), generator=g).to(dtype)
    k = torch.randint(-3, 4, (1, kv_heads, keys, dim), generator=g).to(dtype)
    v = torch.zeros(1, kv_heads, keys, dim, dtype=dtype)
    for h in range(kv_heads):
        rows = torch.randint(0, keys, (dim,), generator=g)
        v[0, h, rows, torch.arange(dim)] = 1.0
    mask = torch.zeros(1, 1, q_len, keys, dtype=dtype)
    causal = torch.triu(torch.full((q_len, q_len), torch.finfo(dtype).min, dtype=dtype), 1)
    mask[..., keys - q_len :] = causal  # the queries are the last q_len positions
    return q, k, v, mask


class _Module:  # what an attention function reads from its module
    def __init__(self, heads, kv_heads, dim=8):
        self.training = False
        self.num_key_value_groups = heads // kv_heads
        self.head_dim = dim


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 2), (8, 2), (9, 3)])
@pytest.mark.parametrize("q_len,keys", [(1, 7), (5, 5), (3, 40)])
@pytest.mark.parametrize("softcap", [None, 50.0])
def test_the_arithmetic_is_eagers(heads, kv_heads, q_len, keys, softcap):
    """Against transformers' own eager attention (Gemma-2's: scale, soft cap, mask, float32 softmax), bit for bit
    on inputs whose sums are exact in any order."""
    import torch
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, mask = _inputs(heads, kv_heads, q_len, keys, dtype)
        m = _Module(heads, kv_heads)
        want, _ = eager_attention_forward(m, q, k, v, mask, scaling=0.125, softcap=softcap)
        got, _ = grouped_attention(m, q, k, v, mask, scaling=0.125, softcap=softcap)
        assert got.shape == want.shape == (1, q_len, heads, 8)
        assert torch.equal(got, want), (dtype, heads, kv_heads, q_len, keys, softcap)


@pytest.mark.parametrize("kwarg", ["sinks", "s_aux", "position_bias", "head_mask"])
def test_what_it_does_not_implement_is_refused(kwarg):
    import torch

    q, k, v, mask = _inputs(4, 2, 2, 5, torch.float32)
    with pytest.raises(UnsupportedModel, match=f"does not implement {kwarg}"):
        grouped_attention(_Module(4, 2), q, k, v, mask, scaling=0.125, **{kwarg: torch.zeros(4)})
    with pytest.raises(UnsupportedModel, match="do not group"):
        grouped_attention(_Module(4, 2), q[:, :3], k, v, mask, scaling=0.125)


@pytest.mark.parametrize(
    "arch,module",
    [("llama", "llama"), ("mistral", "mistral"), ("gemma2", "gemma2"), ("gemma4", "gemma4"), ("gpt2", "gpt2")],
)
def test_masks_are_eagers(tmp_path, monkeypatch, arch, module):
    """The kernel gets the very masks eager gets (causal, sliding windows), in a prefill longer than the zoo's
    windows and in a query over the cache: transformers builds none for an implementation it does not know."""
    import importlib

    import torch
    from transformers import AttentionInterface

    from kvgraft_cli.engine.engine import load_engine
    from kvgraft_cli.engine.zoo import tiny_manifest

    seen: dict[str, list] = {"eager": [], "grouped": []}
    mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")

    def spy(impl, real):
        def f(m, q, k, v, mask, *a, **kw):
            seen[impl].append(None if mask is None else mask.clone())
            return real(m, q, k, v, mask, *a, **kw)

        return f

    monkeypatch.setattr(mod, "eager_attention_forward", spy("eager", mod.eager_attention_forward))
    for impl in seen:
        eng = load_engine(tiny_manifest(arch, tmp_path, attn_implementation=impl))
        seen[impl].clear()  # the layout probe's forward
        if impl == "grouped":  # after load_engine, which registers the kernel itself
            monkeypatch.setitem(AttentionInterface._global_mapping, "grouped", spy("grouped", grouped_attention))
        cache = eng.new_cache()
        eng.forward(cache, eng.prefix_ids("a prefix longer than every sliding window of the zoo: 0123456789"))
        eng.forward(cache, eng.encode("and a query"))
    assert len(seen["grouped"]) == len(seen["eager"]) > 0
    assert any(m is not None and m.shape[-2] > 1 for m in seen["grouped"])  # multi-token forwards are masked
    for want, got in zip(seen["eager"], seen["grouped"]):
        assert (want is None and got is None) or torch.equal(want, got)


def test_models_it_does_not_reproduce_are_refused():
    from transformers import GPT2Config, GPTJConfig

    from kvgraft_cli.engine.attention import check_supported

    check_supported(GPT2Config())
    with pytest.raises(UnsupportedModel, match="'gptj'"):
        check_supported(GPTJConfig())
    with pytest.raises(UnsupportedModel, match="reorder_and_upcast_attn"):
        check_supported(GPT2Config(reorder_and_upcast_attn=True))


def test_graft_is_byte_equal_under_grouped_across_the_zoo(tmp_path):
    """The exactness matrix with --attn grouped: every architecture of the zoo, float32 and bfloat16."""
    from transformers import AttentionInterface

    from kvgraft_cli.engine.zoo import ARCHS

    cells = mx.run_profile("portable", tmp_path, list(ARCHS), ["float32", "bfloat16"], 3, attn="grouped")
    assert len(cells) == 2 * len(ARCHS)
    for c in cells:
        assert c.attn == "grouped" and c.exact and c.samples == c.sha_equal == 3, mx.describe(c)
    assert AttentionInterface._global_mapping["grouped"] is grouped_attention  # what the cells ran


def test_a_user_pins_grouped_and_graft_check_passes(tmp_path):
    run_cli("manifest", "init", "builtin:tiny-gemma4", "--attn", "grouped", "-o", "m.yaml", cwd=tmp_path, check_rc=0)
    assert "attn_implementation: grouped" in (tmp_path / "m.yaml").read_text()
    run_cli("deposit", str(EXAMPLES), "--limit", "3", "-m", "m.yaml", cwd=tmp_path, check_rc=0)
    r = json.loads(
        run_cli("graft", "--check", "--samples", "10", "-m", "m.yaml", "--json", cwd=tmp_path, check_rc=0).stdout
    )
    assert r["passed"] and (r["samples"], r["sha_equal"], r["max_kl"]) == (10, 10, 0.0)


def test_the_products_see_contiguous_keys_and_values(monkeypatch):
    """A grafted cache hands attention strided views of the buffers it grows in; the kernel multiplies contiguous
    copies (oneDNN kept a reordered copy of a strided bfloat16 operand per decode step, 6 MB each at 8,192 tokens)."""
    import torch

    seen = []
    real = torch.matmul

    def spy(a, b):
        seen.append(b.transpose(-1, -2).is_contiguous() if len(seen) % 2 == 0 else b.is_contiguous())
        return real(a, b)

    q, k, v, mask = _inputs(6, 2, 3, 40, torch.bfloat16)
    kb, vb = torch.zeros(1, 2, 64, 8, dtype=torch.bfloat16), torch.zeros(1, 2, 64, 8, dtype=torch.bfloat16)
    kb[..., :40, :], vb[..., :40, :] = k, v
    monkeypatch.setattr(torch, "matmul", spy)
    got, _ = grouped_attention(_Module(6, 2), q, kb[..., :40, :], vb[..., :40, :], mask, scaling=0.125)
    monkeypatch.undo()
    assert seen == [True, True]
    assert torch.equal(got, grouped_attention(_Module(6, 2), q, k, v, mask, scaling=0.125)[0])
