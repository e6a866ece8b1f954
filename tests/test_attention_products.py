"""Attention's products by ATen's own kernels (``model.attn_products: aten``, engine.attention.scores and mix): what
makes the avx2 profile's bits every AVX2 machine's. MKL's float32 products follow the CPU they run on (an Intel Xeon
replayed 55 of 129 hashes of a run an AMD EPYC made under the same pins, docs/EXACTNESS.md); ATen's mul and sum run
the instructions ATEN_CPU_CAPABILITY pins, in an order the shapes and the thread count fix.

Checked: the products are the same bits however many query rows a call takes and at 1 or 2 threads; `manifest init
--profile avx2 --attn grouped` chooses them; and under them a q4 forward's attention makes no BLAS call (MKL_VERBOSE
prints none), where the same forward with ``blas`` makes MKL's (the check goes red on attention that uses BLAS). The
lean forward's schedules and batched decode under them: tests/test_lean.py."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import EXAMPLES, run_cli
from ggufblocks import tiny_llama

from kvgraft_cli.engine import attention


def _operands(seed: int, rows: int, keys: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 3, rows, 64, generator=g)
    # the keys and values as the cache holds them: a view of a longer buffer
    k = torch.randn(1, 3, keys + 40, 64, generator=g)[:, :, :keys]
    v = torch.randn(1, 3, keys + 40, 64, generator=g)[:, :, :keys]
    w = torch.softmax(torch.randn(1, 3, rows, keys, generator=g), dim=-1)
    return q, k, v, w


@pytest.mark.parametrize("rows, keys", [(3, 1), (3, 700), (48, 333)])
def test_aten_products_are_the_same_bits_in_any_block_of_rows_and_at_any_thread_count(monkeypatch, rows, keys):
    q, k, v, w = _operands(rows + keys, rows, keys)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = attention.scores(q, k, True), attention.mix(w, v, True)
        torch.set_num_threads(2)
        for block in (attention.ATEN_TEMP, 64 * 64 * 3, 1):  # all rows in one call, a few, one at a time
            monkeypatch.setattr(attention, "ATEN_TEMP", block)
            got = attention.scores(q, k, True), attention.mix(w, v, True)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), block
    finally:
        torch.set_num_threads(before)
    # the same sums as the BLAS's, in another order: close, and (over 64 or more terms) not the same bits
    assert torch.allclose(want[0], torch.matmul(q, k.transpose(2, 3)), atol=1e-4)
    assert torch.allclose(want[1], torch.matmul(w, v), atol=1e-5)


def test_an_aten_product_is_a_row_alone(tmp_path):
    """A query row's products are its own bits whichever rows share the call (a batched decode step's premise)."""
    q, k, v, w = _operands(7, 12, 500)
    both = attention.scores(q, k, True), attention.mix(w, v, True)
    for r in (0, 5, 11):
        one = attention.scores(q[:, :, r : r + 1], k, True), attention.mix(w[:, :, r : r + 1], v, True)
        assert torch.equal(one[0], both[0][:, :, r : r + 1]) and torch.equal(one[1], both[1][:, :, r : r + 1])


def test_the_avx2_profiles_q4_forward_calls_no_blas(tmp_path):
    """`manifest init --weights q4 --attn grouped --profile avx2` writes attn_products aten; a deposit under it
    prints no MKL call for attention with MKL_VERBOSE on, and the same manifest with blas prints MKL's batched
    SGEMMs. (SmolLM2's head is int4 too: a deposit of the main job makes no MKL call at all.)"""
    tiny_llama(tmp_path / "tiny.gguf")
    env = {"KVGRAFT_MODEL_CACHE": str(tmp_path / "models")}
    run_cli(
        "manifest", "init", "tiny.gguf", "--weights", "q4", "--attn", "grouped", "--profile", "avx2", "-o", "m.yaml",
        cwd=tmp_path, env=env, check_rc=0,
    )  # fmt: skip
    data = yaml.safe_load((tmp_path / "m.yaml").read_text())
    assert data["model"]["attn_products"] == "aten"
    data["model"]["attn_products"] = "blas"
    (tmp_path / "blas.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    (tmp_path / "one.jsonl").write_text(EXAMPLES.read_text().splitlines()[0] + "\n")
    calls = {}
    for name in ("m", "blas"):
        p = run_cli(
            "deposit", "one.jsonl", "-m", f"{name}.yaml", "--store", f"{name}-store", "--ledger", f"{name}.jsonl",
            cwd=tmp_path, env={**env, "MKL_VERBOSE": "1"}, check_rc=0,
        )  # fmt: skip
        # Every MKL product but the head's: this tiny model's head is a dense float32 layer (its 103-token
        # vocabulary fits no int4 block), an SGEMM of 103 rows that stays MKL's
        lines = (p.stdout + p.stderr).splitlines()
        calls[name] = sum("MKL_VERBOSE SGEMM" in x and not x.split("(", 1)[1].startswith("T,N,103,") for x in lines)
        entry = json.loads((tmp_path / f"{name}.jsonl").read_text().splitlines()[-1])
        assert entry["kind"] == "deposit"
    assert calls["m"] == 0 and calls["blas"] > 0, calls
