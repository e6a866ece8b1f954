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
@pytest.mark.parametrize("shapes", [(576, 192, 192), (32, 16, 16)])
def test_a_fused_product_is_the_separate_products_side_by_side(threads, shapes):
    """q, k and v (576, 192, 192 rows of SmolLM2's shape; 32, 16, 16 of the tiny Llama's, which the kernel's packing
    does not stack: quantized.fuse joins their outputs instead) fused into one product: every column's bits are the
    separate layer's, for one token and for a chunk."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        parts = [_layer(n, 576, i) for i, n in enumerate(shapes)]
        fused = Q.fuse(parts)
        x = torch.from_numpy(np.random.default_rng(9).standard_normal((64, 576)).astype(np.float32))
        with torch.inference_mode():
            for rows in (x[:1], x):
                assert torch.equal(fused(rows), torch.cat([p(rows) for p in parts], dim=-1))
    finally:
        torch.set_num_threads(before)


def _two_planes(rows: int, cols: int, seed: int):
    rng = np.random.default_rng(seed)
    codes = rng.integers(-128, 128, (rows, cols)).astype(np.int8)
    d = (rng.random((rows, cols // Q.GROUP)) * 0.01).astype(np.float32)
    return Q._int4_linear_class()(Q._planes("Q8_0", d, None, codes), None, rows, cols)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_mixed_fuse_stacks_the_runs_it_can_and_joins_the_rest(threads):
    """What a Q4_K_M file gives (q and k Q5_0 or Q4_K, v Q8_0 or Q6_K; or a layer of a type kept dequantized): runs
    of layers with as many planes are one stacked product, the others are computed alone, and every column's bits
    are the separate layer's. Row-local (computed batched under the invariant schedule) only when every part is
    int4."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.from_numpy(np.random.default_rng(9).standard_normal((64, 576)).astype(np.float32))
        dense = torch.nn.Linear(576, 64, bias=False)
        for parts, local, stacked_rows in (
            ([_layer(576, 576, 1), _layer(192, 576, 2), _two_planes(192, 576, 3)], True, 768),
            ([_two_planes(64, 576, 4), _two_planes(128, 576, 5), _layer(64, 576, 6)], True, 192),
            ([_layer(576, 576, 7), _layer(192, 576, 8), dense], False, 768),
        ):
            fused = Q.fuse(parts)
            assert fused.row_local is local
            stacked = [m for m in fused.layers if m not in parts]
            assert [m.out_features for m in stacked] == [stacked_rows]
            with torch.inference_mode():
                for rows in (x[:1], x):
                    assert torch.equal(fused(rows), torch.cat([p(rows) for p in parts], dim=-1))
    finally:
        torch.set_num_threads(before)


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


def _q4_tiny_llama(
    tmp_path, threads: int, kv_dtype: str | None = None, schedule: str = "invariant", products: str = "blas"
):
    """The zoo's tiny Llama under grouped attention and the invariant schedule, its projections and head swapped for
    int4 layers of random codes (what model.weights q4 makes of a GGUF's), with the lean forward attached (its
    check passed: logits and cache bytes equal to transformers' forward)."""
    from kvgraft_cli.config.manifest import Manifest, with_overrides
    from kvgraft_cli.engine import lean
    from kvgraft_cli.engine.engine import load_engine
    from kvgraft_cli.engine.zoo import tiny_manifest

    m = tiny_manifest(
        "llama", tmp_path, attn_implementation="grouped", schedule=schedule, threads=threads, kv_dtype=kv_dtype
    )
    m = with_overrides(m, {"model.attn_products": products})  # (engine.attention.scores and mix)
    eng = load_engine(m)
    assert eng.lean is None  # dequantized weights: transformers' forward
    seed = 100
    for layer in eng.model.model.layers:
        for mod, names in (
            (layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
            (layer.mlp, ("gate_proj", "up_proj", "down_proj")),
        ):
            for name in names:
                old = getattr(mod, name)
                seed += 1
                setattr(mod, name, _layer(old.out_features, old.in_features, seed))
    # (the head stays float32: the zoo's vocabulary is no multiple of the kernel's 16 rows)
    # What attach requires of the manifest (a q4 manifest proper also names its GGUF: not validated here)
    data = eng.manifest.to_dict()
    data["model"]["weights"] = "q4"
    eng.manifest = Manifest(data, eng.manifest.source, eng.manifest.file_sha256, eng.manifest.base_dir)
    assert lean.attach(eng)  # its own check: the lean rows against transformers one token a call
    return eng


@pytest.mark.parametrize("threads", [1, 2])
def test_the_invariant_schedule_batched_gives_the_token_by_token_bytes(tmp_path, threads):
    """Under the invariant schedule the lean forward computes many tokens at once, attention row by row: logits and
    cache bytes equal transformers' forward one token a call (the schedule's definition), whatever the split."""
    before = torch.get_num_threads()
    eng = _q4_tiny_llama(tmp_path, threads)
    try:
        ids = [int(t) for t in np.random.default_rng(3).integers(3, 200, 90)]
        ref_cache = eng.new_cache()
        with eng._infer():
            want = torch.cat(
                [eng.model(input_ids=torch.tensor([[t]]), cache=ref_cache, use_cache=True).logits[0] for t in ids]
            )
        for splits in ([90], [64, 26], [7] * 12 + [6], [1, 89]):
            cache, got, pos = eng.new_cache(), [], 0
            for n in splits:
                got.append(eng.forward(cache, ids[pos : pos + n]))
                pos += n
            assert torch.equal(torch.cat(got), want), splits
            for a, b in zip(ref_cache.layers, cache.layers):
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), splits
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("past,n", [(0, 64), (1984, 43), (500, 7)])
def test_attention_row_by_row_is_the_decode_steps(threads, past, n):
    """The invariant schedule's attention (LeanLlama._attend_rows) on SmolLM2's shapes (3 KV heads, 9 query heads,
    64 dims) over a growing cache's views: each row's bits are the decode step's at its position. The batched
    products with a causal mask give other bits here, which is why the rows are computed alone (the tiny model's
    shapes are too small to tell the two apart)."""
    from kvgraft_cli.engine.lean import LeanLlama

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lean = LeanLlama.__new__(LeanLlama)
        lean.kv_heads = 3
        g = torch.Generator().manual_seed(past + n)
        kb, vb = (torch.randn(1, 3, past + n + 100, 64, generator=g) for _ in range(2))
        q = torch.randn(1, 9, n, 64, generator=g)
        k, v = kb[:, :, : past + n], vb[:, :, : past + n]
        steps = [
            lean._attend(q[:, :, r : r + 1], kb[:, :, : past + r + 1], vb[:, :, : past + r + 1], None, 0.125)
            for r in range(n)
        ]
        decode = torch.cat(steps, dim=1)
        assert torch.equal(lean._attend_rows(q, k, v, 0.125), decode)
        seen = torch.arange(past + n).unsqueeze(0) <= torch.arange(past, past + n).unsqueeze(1)
        mask = torch.where(seen, 0.0, torch.finfo(torch.float32).min)[None, None]
        assert not torch.equal(lean._attend(q, k, v, mask, 0.125), decode)
    finally:
        torch.set_num_threads(before)


def test_positions_given_explicitly_are_transformers_bytes(tmp_path):
    """The probe computes prefixes away from position 0 (engine.forward's ``start``): through the lean forward,
    batched, a prefix placed at position 30 and a suffix after it give the bytes of transformers' forward one token a
    call with the same positions (the invariant schedule's definition)."""
    eng = _q4_tiny_llama(tmp_path, 1)
    ids = [int(t) for t in np.random.default_rng(5).integers(3, 200, 28)]
    lean = eng.lean
    assert lean is not None
    cache, _ = eng.prefill(ids[:20], offset=30)
    got = eng.forward(cache, ids[20:], start=50)
    eng.lean = None  # transformers' forward, one token a call
    try:
        ref, _ = eng.prefill(ids[:20], offset=30)
        want = eng.forward(ref, ids[20:], start=50)
    finally:
        eng.lean = lean
    assert torch.equal(got, want)
    for a, b in zip(ref.layers, cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("schedule", ["single", "invariant"])
def test_the_lean_forward_keeps_a_16_bit_cache_as_transformers_does(tmp_path, schedule):
    """model.kv_dtype float16: the lean forward attaches (its check compares logits and the 16-bit cache's bytes with
    transformers' forward), and a graft through it is the fresh computation's bytes."""
    from kvgraft_cli.artifacts import format as kvg
    from kvgraft_cli.engine.engine import tensor_sha256

    eng = _q4_tiny_llama(tmp_path, 1, kv_dtype="float16", schedule=schedule)
    ids = [int(t) for t in np.random.default_rng(7).integers(3, 200, 30)]
    cache, last = eng.prefill(ids)
    assert cache.layers[0].keys.dtype == torch.float16
    art = kvg.decode(kvg.encode(ids, eng.capture(cache), eng.artifact_meta(tensor_sha256(last))))
    fresh = eng.forward(cache, [9, 10, 11])
    assert torch.equal(eng.forward(eng.restore(art.layers), [9, 10, 11]), fresh)


def _alone(eng, prompt: list[int], budget: int):
    """A sequence's greedy decode alone: (ids, each step's logits, the cache)."""
    cache, last = eng.prefill(prompt)
    ids, steps = eng.greedy(cache, last, budget)
    return ids, steps, cache


def _same_cache(a, b) -> bool:
    return all(torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values) for x, y in zip(a.layers, b.layers))


@pytest.mark.parametrize("threads, products", [(1, "aten"), (2, "blas")])
def test_a_batched_decode_gives_each_sequence_its_bits_alone(tmp_path, threads, products):
    """Seven sequences of 1 to 61 prompt tokens and budgets of 1 to 24 decode in steps of at most 4 rows
    (engine.decoding.step), joining at different steps and leaving when their budget ends: every sequence's ids,
    every step's logits and its whole cache are the bytes of the same sequence decoded alone (attention's products
    by MKL or by ATen's own kernels, model.attn_products)."""
    from kvgraft_cli.engine.decoding import step

    before = torch.get_num_threads()
    eng = _q4_tiny_llama(tmp_path, threads, products=products)
    try:
        assert eng.batch_refusal is None
        rng = np.random.default_rng(threads)
        plan = [
            (int(n), int(b), j)
            for n, b, j in zip([1, 9, 61, 4, 30, 17, 2], [24, 1, 13, 20, 7, 24, 16], [0, 0, 0, 2, 3, 5, 9])
        ]
        prompts = [[int(t) for t in rng.integers(3, 200, n)] for n, _, _ in plan]
        alone = [_alone(eng, p, b) for p, (_, b, _) in zip(prompts, plan)]
        streams, rows, t = [None] * len(plan), [], 0
        while t < 40:
            for i, (_, budget, joins) in enumerate(plan):
                if joins == t:
                    cache, last = eng.prefill(prompts[i])
                    streams[i] = s = eng.stream(cache, budget, keep_logits=True)
                    s.feed(last)
            rows.append(step(eng, [s for s in streams if s is not None], batch=4))
            t += 1
        assert max(rows) > 1 and all(s.done for s in streams)
        for s, (ids, steps, cache) in zip(streams, alone):
            assert s.ids == ids
            assert torch.equal(torch.stack(s.logits), steps)
            assert _same_cache(s.cache, cache)
    finally:
        torch.set_num_threads(before)


def test_a_step_that_batches_a_dense_float32_product_is_caught(tmp_path):
    """The tiny Llama's head stays a float32 dense layer (a GEMM, whose row depends on the rows beside it): the step
    computes it a row at a time. Declared row-local, the step batches it, its rows are no longer the bits alone,
    and the check at first use says so: the engine then decodes one sequence at a time, with the bits alone."""
    from kvgraft_cli.engine.decoding import step
    from kvgraft_cli.engine.lean import check_step

    eng = _q4_tiny_llama(tmp_path, 1)
    assert check_step(eng) is None
    eng.lean.row_local.add(id(eng.lean.head))  # the GEMM batched
    refusal = check_step(eng)
    assert refusal is not None and "differ from a step alone" in refusal
    eng._batch_refusal = refusal
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13]]
    alone = [_alone(eng, p, 6)[0] for p in prompts]
    streams = []
    for p in prompts:
        cache, last = eng.prefill(p)
        streams.append(eng.stream(cache, 6))
        streams[-1].feed(last)
    while not all(s.done for s in streams):
        step(eng, streams, batch=4)
    assert [s.ids for s in streams] == alone
