"""Weights kept at the width the GGUF stores them: a manifest's ``model.weights: q4``.

A GGUF's Q4_0 and Q4_1 tensors are blocks of 32 weights, each block a 4-bit code per weight, a scale and (Q4_1) a
minimum: ``w = d * q + m``; a Q4_K super-block of 256 holds eight such groups of 32, each with a 6-bit scale and
minimum under the block's two float16 factors, ``w = (d * sc) * q - (dmin * m)``, the same shape once the factors are
multiplied out (exactly, in float32). torch's CPU weight-only kernel ``aten._weight_int4pack_mm_for_cpu`` multiplies by
exactly that shape of matrix, groups of 32 along the input dimension with a scale and a zero point per group
(``w = (q - 8) * scale + zero``), reading half a byte a weight instead of four. So the codes go into the kernel as
the file stores them, and a decode step reads about what llama.cpp reads. A Q8_0 tensor (8-bit codes, a scale per
32) is split into two 4-bit planes, ``x = 16 * hi + lo``, each an int4 matrix with its own scale and zero, whose
products are added: the same 8-bit codes, read at a byte a weight. A Q6_K tensor (6-bit codes ``q`` with an 8-bit
scale ``sc`` per 16 weights and a float16 ``d`` per 256: ``w = (d * sc) * q``) has no group of 32 sharing one scale,
so the integer ``v = sc * q`` (|v| <= 4096) is written in balanced base-16 digits, ``v = sum 16^k * e_k`` with each
``e_k`` in -8..7, one int4 plane a digit (three or four) with scale ``16^k * d`` and zero 0: the file's integers
exactly, read at 1.5-2 bytes a weight (the file: 0.82), which is what keeps a Q4_K_M file's Q6_K head and projections
off the float32 path.

What it changes against the dequantized model (the default, ``model.weights: dequantized``): the kernel takes its
activations, scales and zeros in bfloat16 (its float32 path is a fallback, many times slower: docs/PERFORMANCE.md, "The
GGUF's own 4-bit codes and a lean forward"), so the codes are the file's but a scale or zero that float16 held exactly
is rounded to bfloat16, and each linear layer's input is rounded to bfloat16 and its output comes back as float32 from a
bfloat16 result. The rest of the model (embeddings, norms, rotary, attention, the residual stream) stays in the
manifest's dtype. docs/PERFORMANCE.md measures the logits' distance and the main job's accuracy.

Determinism: the kernel's row for one token does not depend on how many rows are computed together (measured at 1..512
rows; tests/test_quantized.py), it is deterministic run to run at a pinned thread count, and which code path it takes is
ATen's CPU capability, which the manifest's profile pins (``ATEN_CPU_CAPABILITY``; under the portable profile's
``default`` it is the scalar path, many times slower than AVX-512's: the same section of docs/PERFORMANCE.md). Under
the avx2 profile the product runs in kvgraft's own kernel (ckernels.py, int4mm.c): ATen's AVX2 bits, computed at
the width of the CPU's widest vectors. The
conversion is pinned by ``model.weights_sha256``: the SHA-256 of the canonical tensors (codes packed two to a byte,
bfloat16 scales and zeros) computed at every load, so a changed GGUF reader or rounding shows up as drift. Before
anything runs, every converted matrix is checked code by code against the dequantized checkpoint (``d * q + m``
recomputed in float32 must equal its weights bit for bit): a wrong tensor name, row permutation or block layout cannot
pass.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UnsupportedModel

GROUP = 32  # a Q4_0 / Q4_1 / Q8_0 block, a Q4_K sub-block, and the kernel's group size
KERNEL_ROWS = 16  # the kernel packs output rows in multiples of this
# The GGUF types kept quantized (the others stay dequantized), and the planes each becomes: "affine" one plane
# (w = d * q + m), "q8" two (Q8_0's signed high and unsigned low nibbles: balanced digits would take three planes
# for a code of 127), "digits" one per balanced base-16 digit of its integer codes (the minimum, if any, on the last
# plane)
_FORM = {
    "Q4_0": "affine",
    "Q4_1": "affine",
    "Q4_K": "affine",
    "Q8_0": "q8",
    "Q5_0": "digits",
    "Q5_1": "digits",
    "Q5_K": "digits",
    "Q6_K": "digits",
}
QUANT_TYPES = tuple(_FORM)


@dataclass
class Plane:
    """One int4 matrix: codes 0..15 [out, in] (uint8) with a scale and a zero per group of 32 [out, in/32] (float32,
    before the kernel's bfloat16): ``w = (code - 8) * scale + zero``."""

    codes: Any
    scale: Any
    zero: Any


def _block_fields(tensor) -> tuple[Any, Any, Any]:
    """(d, m, codes) of a tensor of a kept type, as numpy arrays [rows, groups of 32] (d, m float32; m None where the
    type has no minimum) and [rows, cols], decoded as gguf's own dequantizer reads the blocks, so that the weight is
    ``d * codes + m`` (Q4_0: ``d * (codes - 8)``) with the rounding gguf's arithmetic has:

    - Q4_0, Q4_1, Q4_K: codes uint8 0..15; Q4_K's ``d`` and ``m`` are each sub-block's ``d * sc`` and
      ``-(dmin * m)`` (exact products in float32; gguf subtracts ``dmin * m``, the same rounding);
    - Q8_0: codes int8;
    - Q5_0, Q5_1, Q5_K: the 5-bit codes (Q5_0's less 16) as int16, Q5_K's factors as Q4_K's;
    - Q6_K: ``d`` of the super-block (repeated for its eight groups) and codes int16 ``v = sc * q`` (|v| <= 4096):
      gguf computes ``(d * sc) * q``, and both products are exact, so ``d * v`` is the same value (a zero weight
      may differ in sign: gguf's keeps a negative scale's; the load's check compares values)."""
    import numpy as np

    kind = tensor.tensor_type.name
    data = np.asarray(tensor.data)
    rows = data.shape[0]
    from gguf import GGML_QUANT_SIZES

    blocks = data.reshape(-1, GGML_QUANT_SIZES[tensor.tensor_type][1])  # gguf's (weights, bytes) a block
    n = blocks.shape[0]
    f16 = lambda a: a.copy().view(np.float16).astype(np.float32)  # noqa: E731  (columns of float16 bytes)
    shifts = lambda *s: np.array(s, dtype=np.uint8).reshape(1, 1, -1, 1)  # noqa: E731
    if kind in ("Q4_K", "Q5_K"):
        from gguf.quants import Q4_K

        d, dmin = f16(blocks[:, 0:2]), f16(blocks[:, 2:4])  # [n, 1]
        sc, mins = Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [n, 8] each: sub-block j's 6-bit scale and minimum
        scale = (d * sc.astype(np.float32)).reshape(rows, -1)
        m = -(dmin * mins.astype(np.float32)).reshape(rows, -1)
        qs = blocks[:, -128:].reshape(n, 4, 1, 32)  # 32 bytes for sub-blocks 2i (low nibbles) and 2i+1 (high)
        codes = ((qs >> shifts(0, 4)) & 0x0F).reshape(n, 8, 32)
        if kind == "Q5_K":  # bit j of each of 32 bytes: sub-block j's fifth bit
            high = (blocks[:, 16:48].reshape(n, 1, 1, 32) >> shifts(*range(8))) & 0x01
            codes = codes.astype(np.int16) | (high.reshape(n, 8, 32).astype(np.int16) << 4)
        return scale, m, codes.reshape(rows, -1)
    if kind == "Q6_K":
        ql = blocks[:, :128].reshape(n, -1, 1, 64) >> shifts(0, 4)
        qh = blocks[:, 128:192].reshape(n, -1, 1, 32) >> shifts(0, 2, 4, 6)
        q = ((ql & 0x0F).reshape(n, -1, 32) | ((qh & 0x03).reshape(n, -1, 32) << 4)).astype(np.int16) - 32
        sc = blocks[:, 192:208].copy().view(np.int8).astype(np.int16)  # [n, 16]: one per 16 weights
        codes = (q.reshape(n, 16, 16) * sc[:, :, None]).reshape(rows, -1)
        d = np.repeat(f16(blocks[:, 208:210]), 256 // GROUP, axis=1).reshape(rows, -1)
        return d, None, codes
    d = f16(blocks[:, 0:2]).reshape(rows, -1)
    if kind == "Q8_0":
        codes = blocks[:, 2:].copy().view(np.int8).reshape(rows, -1)
        return d, None, codes
    m = f16(blocks[:, 2:4]).reshape(rows, -1) if kind in ("Q4_1", "Q5_1") else None
    packed = blocks[:, -16:]  # [n, 16]: element j in the low nibble of byte j, element 16+j in its high nibble
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=1)
    if kind in ("Q5_0", "Q5_1"):  # the fifth bits: bit j of a little-endian 32-bit word, element j's
        qh = blocks[:, -20:-16].copy().view("<u4").reshape(n, 1) >> np.arange(32, dtype=np.uint32).reshape(1, 32)
        codes = codes.astype(np.int16) | ((qh & 0x01).astype(np.int16) << 4)
        if kind == "Q5_0":
            codes -= 16
    return d, m, codes.reshape(rows, -1)


def _reference(kind: str, d, m, codes):
    """The dequantized weights as gguf computes them (float32), for the bit-for-bit check."""
    import numpy as np

    rep = lambda a: np.repeat(a, GROUP, axis=1)  # noqa: E731
    if kind == "Q4_0":
        return rep(d) * (codes.astype(np.int8) - np.int8(8)).astype(np.float32)
    if m is not None:  # Q4_1, Q5_1; Q4_K, Q5_K (gguf's - dmin * m: the same rounding as + (-(dmin * m)))
        return rep(d) * codes.astype(np.float32) + rep(m)
    return codes.astype(np.float32) * rep(d)  # Q8_0, Q5_0; Q6_K (|v| * d fits float32's 24 bits: exact, as gguf's)


def _digits(v) -> list[Any]:
    """Balanced base-16 digits of the integers ``v`` (each -8..7), lowest first, as few as hold every value."""
    import numpy as np

    rest, out = v.astype(np.int32), []
    while True:
        e = (rest + 8) % 16 - 8
        out.append(e)
        rest = (rest - e) // 16
        if not rest.any():
            return out


def _planes(kind: str, d, m, codes) -> list[Plane]:
    """The int4 planes of one tensor (one for Q4_0/Q4_1/Q4_K, two for Q8_0, a base-16 digit each for Q5_0, Q5_1,
    Q5_K and Q6_K: their minimum, if any, the last plane's zero), scales and zeros in float32, the plane of the
    highest weight first."""
    import numpy as np

    form = _FORM[kind]
    if form == "affine":
        zero = np.zeros_like(d) if m is None else m + np.float32(8) * d
        return [Plane(codes.astype(np.uint8), d, zero)]
    if form == "digits":
        zero = np.zeros_like(d)
        return [
            Plane((e + 8).astype(np.uint8), np.float32(16**k) * d, m if k == 0 and m is not None else zero)
            for k, e in reversed(list(enumerate(_digits(codes))))
        ]
    hi = (codes >> 4).astype(np.int16) + 8  # arithmetic shift: -8..7, stored as 0..15
    lo = (codes & 0x0F).astype(np.uint8)  # 0..15: x = 16 * (hi - 8) + lo
    return [
        Plane(hi.astype(np.uint8), np.float32(16) * d, np.zeros_like(d)),
        Plane(lo, d, np.float32(8) * d),
    ]


def read_planes(gguf_path: Path, model, kinds: dict[str, str] | None = None) -> dict[str, list[Plane]]:
    """The int4 planes of every linear layer of ``model`` (loaded from this GGUF's dequantized checkpoint) whose
    GGUF tensor is of a kept type (:data:`QUANT_TYPES`), by module name; the LM head from the embedding when the two are tied.

    Each is checked against the module's weight: the GGUF's codes dequantized in float32 (as gguf does) must equal
    the loaded weight bit for bit, in the model's dtype; UnsupportedModel naming the tensor otherwise. ``kinds``
    (if given) receives each kept module's GGUF type."""
    import numpy as np
    import torch
    from gguf import MODEL_ARCH_NAMES, GGUFReader, get_tensor_name_map
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    reader = GGUFReader(str(gguf_path))
    arch = reader.fields["general.architecture"].contents()
    text = model.config.get_text_config(decoder=True)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    # GGUF tensor name -> module name, from gguf's own table for the architecture (what transformers' loader uses,
    # built once instead of once per module).
    arch_key = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch), None)
    if arch_key is None:
        raise UnsupportedModel(
            f"{gguf_path}: gguf {arch!r} has no tensor-name table to keep its weights 4-bit",
            "use model.weights: dequantized for this GGUF",
        )
    table = get_tensor_name_map(arch_key, text.num_hidden_layers)
    modules = dict(model.named_modules())
    names = {g: n for n in modules if (g := table.get_name(n)) is not None}
    linears = {n for n, mod in modules.items() if isinstance(mod, torch.nn.Linear)}
    tied = getattr(text, "tie_word_embeddings", False)
    out: dict[str, list[Plane]] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        base, _, suffix = tensor.name.rpartition(".")
        module = names.get(base)
        if kind not in QUANT_TYPES or module is None or suffix != "weight":
            continue
        if module not in linears:
            if tied and "lm_head" in linears and module.endswith("embed_tokens"):
                module = "lm_head"  # a tied head is the embedding's matrix: kept quantized for the head's product
            else:
                continue  # an embedding lookup reads one row a token: it stays dequantized
        if int(tensor.shape[-1]) % KERNEL_ROWS:  # GGUF shapes list columns first: [in, out]
            continue  # the kernel packs rows in 16s: such a matrix (a small vocabulary's head) stays dequantized
        d, m, codes = _block_fields(tensor)
        # The architecture's row permutation (Llama's q/k rotary order), found by running its processor on row
        # numbers: the same rows, in the order transformers put the dequantized weights.
        rows = np.arange(codes.shape[0], dtype=np.float64).reshape(-1, 1)
        order = processor.process(weights=rows, name=tensor.name, tensor_key_mapping={}, parsed_parameters={})
        perm = np.asarray(order.weights).reshape(-1).astype(np.int64)
        d, codes = d[perm], codes[perm]
        m = None if m is None else m[perm]
        weight = model.get_submodule(module).weight
        want = torch.from_numpy(_reference(kind, d, m, codes)).to(weight.dtype)
        if tuple(want.shape) != tuple(weight.shape) or not torch.equal(want, weight.detach().cpu()):
            raise UnsupportedModel(
                f"{gguf_path}: tensor {tensor.name} ({kind}) does not dequantize to {module}'s weights bit for bit",
                "use model.weights: dequantized for this GGUF",
            )
        out[module] = _planes(kind, d, m, codes)
        if kinds is not None:
            kinds[module] = kind
    if not out:
        raise UnsupportedModel(
            f"{gguf_path}: no linear layer is stored as {', '.join(QUANT_TYPES)}",
            "use model.weights: dequantized for this GGUF",
        )
    return out


def canonical_sha256(planes: dict[str, list[Plane]]) -> str:
    """SHA-256 of what the kernels compute with: per module (sorted) and plane, the codes packed two to a byte (low
    nibble first) and the bfloat16 scales and zeros, each tensor's name, dtype and shape framed before its bytes."""
    import torch

    h = hashlib.sha256()
    for name in sorted(planes):
        for i, p in enumerate(planes[name]):
            parts = {
                "codes": _packed(p.codes).tobytes(),
                "scale": torch.from_numpy(p.scale).to(torch.bfloat16).view(torch.uint16).numpy().tobytes(),
                "zero": torch.from_numpy(p.zero).to(torch.bfloat16).view(torch.uint16).numpy().tobytes(),
            }
            for part, data in parts.items():
                h.update(f"{name}/{i}/{part}:{p.codes.shape[0]}x{p.codes.shape[1]}:{len(data)}\n".encode())
                h.update(data)
    return h.hexdigest()


_INT4: type | None = None


def _int4_linear_class():
    """The int4 linear layer's class, built on first use (importing this module imports no torch)."""
    global _INT4
    if _INT4 is None:
        _INT4 = _build_int4_linear_class()
    return _INT4


def _build_int4_linear_class():
    import torch

    from .ckernels import int4_mm

    class _Int4Linear(torch.nn.Module):
        """A linear layer whose weight is one or more int4 planes (module docstring); bias in the model's dtype."""

        def __init__(self, planes: list[Plane], bias, out_features: int, in_features: int):
            super().__init__()
            self.in_features, self.out_features = in_features, out_features
            self.packed = []
            self.scales_zeros = []
            for p in planes:
                codes = torch.from_numpy(p.codes.astype("int32"))
                self.packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
                sz = torch.stack([torch.from_numpy(p.scale).t(), torch.from_numpy(p.zero).t()], dim=-1)
                self.scales_zeros.append(sz.to(torch.bfloat16).contiguous())  # [in/32, out, 2]
            self.bias = bias
            # What one product reads: the packed codes, the scales and zeros (and the bias).
            self.nbytes = sum(t.numel() * t.element_size() for t in (*self.packed, *self.scales_zeros))
            self.nbytes += 0 if bias is None else bias.numel() * bias.element_size()

        def forward(self, x):
            shape = x.shape
            a = x.reshape(-1, self.in_features).to(torch.bfloat16)
            mm = int4_mm  # ATen's kernel's bits, at the CPU's width where it can (ckernels.py)
            y = mm(a, self.packed[0], GROUP, self.scales_zeros[0]).to(x.dtype)
            for packed, sz in zip(self.packed[1:], self.scales_zeros[1:]):  # Q8_0's second plane
                y = y + mm(a, packed, GROUP, sz).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*shape[:-1], self.out_features)

    return _Int4Linear


def _stacks(rows: int) -> bool:
    """Whether packed codes of ``rows`` rows, stacked on others, are the packing of the stacked codes. The kernel
    packs rows in blocks (64 on an AVX-512 CPU, measured), so this holds for a multiple of the block only; asked of
    the kernel itself, on this CPU, once per row count."""
    if rows not in _STACKS:
        import torch

        pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu
        g = torch.Generator().manual_seed(rows)
        a = torch.randint(0, 16, (rows, 2 * GROUP), dtype=torch.int32, generator=g)
        b = torch.randint(0, 16, (64, 2 * GROUP), dtype=torch.int32, generator=g)
        _STACKS[rows] = torch.equal(torch.cat([pack(a, 1), pack(b, 1)]), pack(torch.cat([a, b]), 1))
    return _STACKS[rows]


_STACKS: dict[int, bool] = {}


def _fusable(m) -> bool:
    return isinstance(m, _int4_linear_class()) and m.bias is None


def _stack(layers: list) -> Any:
    """Int4 layers of as many planes each, without a bias, as one layer: plane k's packed codes and scales and zeros
    stacked. Each output column is computed from its own rows of codes, and its planes are added in the same order
    as in its own layer, so its bits are that layer's."""
    import torch

    cls = _int4_linear_class()
    fused = cls.__new__(cls)
    torch.nn.Module.__init__(fused)
    fused.in_features = layers[0].in_features
    fused.out_features = sum(m.out_features for m in layers)
    planes = range(len(layers[0].packed))
    fused.packed = [torch.cat([m.packed[k] for m in layers]) for k in planes]
    fused.scales_zeros = [torch.cat([m.scales_zeros[k] for m in layers], dim=1).contiguous() for k in planes]
    fused.bias = None
    fused.nbytes = sum(m.nbytes for m in layers)
    return fused


def fuse(layers: list) -> Any:
    """One layer computing ``layers`` (the same input) side by side (engine.lean). Runs of int4 layers without a bias
    and with as many planes have their packed codes and their scales and zeros stacked along the output dimension
    when the kernel's packing allows it (:func:`_stacks`): each output column is computed from its own rows of codes,
    so its bits are the separate layer's (tests/test_lean.py). Anything else (a layer kept dequantized, another plane
    count, a row count that does not stack) is computed alone and the outputs joined: the same bits as the separate
    calls, without the saving. ``row_local`` on a joined result: whether a row's bits are its own whatever rows share
    the call (true of the int4 kernel, not of a BLAS GEMM)."""
    groups: list[list] = []
    for m in layers:
        last = groups[-1] if groups else None
        if (
            last
            and _fusable(m)
            and all(_fusable(x) and len(x.packed) == len(m.packed) and _stacks(x.out_features) for x in last)
        ):
            last.append(m)
        else:
            groups.append([m])
    parts = [_stack(g) if len(g) > 1 else g[0] for g in groups]
    return parts[0] if len(parts) == 1 else _Joined(parts)


class _Joined:
    """Layers computed one after another, their outputs joined along the last dimension (what :func:`fuse` gives
    when not every layer stacks)."""

    def __init__(self, layers: list):
        self.layers = layers
        self.out_features = sum(m.out_features for m in layers)
        self.row_local = all(isinstance(m, _int4_linear_class()) for m in layers)

    def __call__(self, x):
        import torch

        return torch.cat([m(x) for m in self.layers], dim=-1)


def quantize_model(model, planes: dict[str, list[Plane]]) -> None:
    """Replace each named linear layer of ``model`` by its int4 form (in place; CPU only)."""
    cls = _int4_linear_class()
    for name, ps in planes.items():
        old = model.get_submodule(name)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        bias = None if old.bias is None else old.bias.detach()
        setattr(parent, attr, cls(ps, bias, old.out_features, old.in_features))


def _packed(codes):
    """Codes [rows, cols] 0..15 packed two to a byte, the low nibble first (the canonical form's and the cache's)."""
    import numpy as np

    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def save_planes(planes: dict[str, list[Plane]], path: Path) -> None:
    """Write the canonical form (packed codes, bfloat16 scales and zeros) as safetensors, atomically: the model cache's
    copy, so a later load reads 60 MB instead of parsing and decoding the GGUF again."""
    import os
    import tempfile

    import torch
    from safetensors.torch import save_file

    tensors = {}
    for name in sorted(planes):
        for i, p in enumerate(planes[name]):
            tensors[f"{name}/{i}/codes"] = torch.from_numpy(_packed(p.codes))
            tensors[f"{name}/{i}/scale"] = torch.from_numpy(p.scale).to(torch.bfloat16)
            tensors[f"{name}/{i}/zero"] = torch.from_numpy(p.zero).to(torch.bfloat16)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "kvgraft-q4", "group": str(GROUP)})
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_planes(path: Path) -> dict[str, list[Plane]]:
    """The planes :func:`save_planes` wrote (bfloat16 scales and zeros widened to float32 exactly)."""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    out: dict[str, list[Plane]] = {}
    for key in sorted(k for k in tensors if k.endswith("/codes")):
        name, index, _ = key.rsplit("/", 2)
        packed = tensors[key].numpy()
        codes = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.uint8)
        codes[:, 0::2], codes[:, 1::2] = packed & 0x0F, packed >> 4
        scale = tensors[f"{name}/{index}/scale"].to(torch.float32).numpy()
        zero = tensors[f"{name}/{index}/zero"].to(torch.float32).numpy()
        out.setdefault(name, []).append(Plane(codes, scale, zero))
    return out


def quantize_from_gguf(model, gguf_path: Path, cache: Path | None = None, want: str | None = None) -> str:
    """Put ``model`` (loaded from ``gguf_path``'s dequantized checkpoint, on the CPU) in its q4 form and return the
    canonical SHA-256 the manifest pins. The planes come from ``cache`` when it holds them and they hash to
    ``want``; otherwise they are read from the GGUF and checked code by code (:func:`read_planes`), and ``cache`` is
    (re)written. A damaged or stale cache is therefore converted again, never used and never reported as drift."""
    planes, digest = None, None
    if cache is not None and cache.is_file():
        try:
            planes = load_planes(cache)
            digest = canonical_sha256(planes)
        except Exception:  # an unreadable cache file is converted again below
            planes = None
        if digest != want:
            planes = None
    if planes is None:
        planes = read_planes(gguf_path, model)
        digest = canonical_sha256(planes)
        if cache is not None:
            save_planes(planes, cache)
    quantize_model(model, planes)
    assert digest is not None
    return digest


def quantize_for_manifest(model, manifest, drift, allow_drift: bool) -> None:
    """load_engine's q4 step: ``model`` in its 4-bit form from the manifest's GGUF (through the model cache's copy),
    its canonical hash checked against ``model.weights_sha256`` (drift, refused unless ``allow_drift``)."""
    from ..config.gguf import quantized_path

    pinned = manifest.model
    gguf_path = manifest.gguf_path
    assert gguf_path is not None  # model.weights q4 validates only with a GGUF model.path
    want = pinned.weights_sha256
    have = quantize_from_gguf(model, gguf_path, quantized_path(pinned.gguf_sha256), want)
    if have != want:
        drift.add("model.weights_sha256", want, have)
        drift.enforce(allow_drift, manifest.source)


def weights_sha256(gguf_path: Path, model_dir: Path, dtype: str, cache: Path | None = None) -> tuple[str, str]:
    """The q4 form's canonical SHA-256 for a GGUF whose dequantized checkpoint is ``model_dir`` (what `kvgraft
    manifest init --weights q4` pins), the form written to ``cache`` for the runs that follow; and one line saying
    what it keeps (:func:`describe`)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=getattr(torch, dtype))
    kinds: dict[str, str] = {}
    planes = read_planes(gguf_path, model, kinds)
    if cache is not None:
        save_planes(planes, cache)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    return canonical_sha256(planes), describe(kinds, planes, linears)


def describe(kinds: dict[str, str], planes: dict[str, list[Plane]], linears: list[str]) -> str:
    """One line: how many of the model's linear layers are kept at the file's widths, by GGUF type and plane count,
    and which stay dequantized."""
    by: dict[tuple[str, int], int] = {}
    for name, kind in kinds.items():
        key = (kind, len(planes[name]))
        by[key] = by.get(key, 0) + 1
    kept = ", ".join(f"{n} {k}" + (f" ({p} planes)" if p > 1 else "") for (k, p), n in sorted(by.items()))
    dense = [n for n in linears if n not in kinds]
    line = f"{len(kinds)} of {len(linears)} linear layers kept at the file's widths: {kept}"
    if dense:
        shown = ", ".join(dense[:3]) + (f" and {len(dense) - 3} more" if len(dense) > 3 else "")
        line += f"; {len(dense)} dequantized ({shown})"
    return line
