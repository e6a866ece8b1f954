"""engine.lean: the two properties its bits rest on, on this machine's kernels. That the whole forward gives
transformers' bytes is checked at every load (lean.attach); test_gguf.py's real-model test asserts the main job's
engine ran with it (the ledger's environment.forward)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvgraft_cli.engine import quantized as Q


def _layer(rows: int, cols: int, seed: int):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (rows, cols)).astype(np.uint8)
    d = (rng.random((rows, cols // Q.GROUP)) * 0.01).astype(np.float32)
    m = (rng.standard_normal((rows, cols // Q.GROUP)) * 0.01).astype(np.float32)
    return Q._int4_linear_class()(Q._planes("Q4_1", d, m, codes), None, rows, cols)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_fused_product_is_the_separate_products_side_by_side(threads):
    """q, k and v (576, 192, 192 rows of SmolLM2's shape) fused into one int4 product: every column's bits are the
    separate layer's, for one token and for a chunk."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        parts = [_layer(n, 576, i) for i, n in enumerate((576, 192, 192))]
        fused = Q.fuse(parts)
        x = torch.from_numpy(np.random.default_rng(9).standard_normal((64, 576)).astype(np.float32))
        with torch.inference_mode():
            for rows in (x[:1], x):
                assert torch.equal(fused(rows), torch.cat([p(rows) for p in parts], dim=-1))
    finally:
        torch.set_num_threads(before)


def test_fuse_refuses_what_it_cannot_stack():
    two_planes = Q._int4_linear_class()(
        Q._planes("Q8_0", np.ones((64, 2), np.float32), None, np.zeros((64, 64), np.int8)), None, 64, 64
    )
    with pytest.raises(Exception, match="single-plane"):
        Q.fuse([two_planes, _layer(64, 64, 1)])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("keys", [5, 300, 2048, 4100])
def test_attention_over_the_cache_views_is_attention_over_a_copy(threads, keys):
    """lean._attend reads keys and values as the growing cache holds them (a view of a buffer with room, its heads
    apart): the batched products give the bits they give over a contiguous copy (grouped_attention's)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(keys)
        kbuf, vbuf = torch.randn(1, 3, keys + 256, 64, generator=g), torch.randn(1, 3, keys + 256, 64, generator=g)
        k, v = kbuf[:, :, :keys], vbuf[:, :, :keys]
        assert not k.is_contiguous()
        for queries in (1, 16):
            q = torch.randn(1, 3, 3 * queries, 64, generator=g)
            w = torch.matmul(q, k.transpose(2, 3))
            assert torch.equal(w, torch.matmul(q, k.contiguous().transpose(2, 3)))
            p = torch.softmax(w, dim=-1)
            assert torch.equal(torch.matmul(p, v), torch.matmul(p, v.contiguous()))
    finally:
        torch.set_num_threads(before)


def test_fuse_refuses_a_layer_kept_dequantized():
    """A projection the GGUF stores in a type that stays dequantized (a plain Linear): the lean forward is not built
    (lean.attach keeps transformers' forward)."""
    with pytest.raises(Exception, match="single-plane"):
        Q.fuse([_layer(64, 64, 1), torch.nn.Linear(64, 64, bias=False)])
