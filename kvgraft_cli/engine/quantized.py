"""Weights kept at the width the GGUF stores them: a manifest's ``model.weights: q4``.

A GGUF's Q4_0 and Q4_1 tensors are blocks of 32 weights, each block a 4-bit code per weight, a scale and (Q4_1) a
minimum: ``w = d * q + m``. torch's CPU weight-only kernel ``aten._weight_int4pack_mm_for_cpu`` multiplies by
exactly that shape of matrix, groups of 32 along the input dimension with a scale and a zero point per group
(``w = (q - 8) * scale + zero``), reading half a byte a weight instead of four. So the codes go into the kernel as
the file stores them, and a decode step reads about what llama.cpp reads. A Q8_0 tensor (8-bit codes, a scale per
32) is split into two 4-bit planes, ``x = 16 * hi + lo``, each an int4 matrix with its own scale and zero, whose
products are added: the same 8-bit codes, read at a byte a weight.

What it changes against the dequantized model (the default, ``model.weights: dequantized``): the kernel takes its
activations, scales and zeros in bfloat16 (its float32 path is a fallback, 23-29x slower here), so the codes are the
file's but a scale or zero that float16 held exactly is rounded to bfloat16, and each linear layer's input is rounded
to bfloat16 and its output comes back as float32 from a bfloat16 result. The rest of the model (embeddings, norms,
rotary, attention, the residual stream) stays in the manifest's dtype. docs/PERFORMANCE.md measures the logits'
distance and the main job's accuracy.

Determinism: the kernel's row for one token does not depend on how many rows are computed together (measured at
1..512 rows; tests/test_quantized.py), it is deterministic run to run at a pinned thread count, and which code path
it takes is ATen's CPU capability, which the manifest's profile pins (``ATEN_CPU_CAPABILITY``; under the portable
profile's ``default`` it is the scalar path, 40x slower than AVX-512's). The conversion is pinned by
``model.weights_sha256``: the SHA-256 of the canonical tensors (codes packed two to a byte, bfloat16 scales and
zeros) computed at every load, so a changed GGUF reader or rounding shows up as drift. Before anything runs, every
converted matrix is checked code by code against the dequantized checkpoint (``d * q + m`` recomputed in float32
must equal its weights bit for bit): a wrong tensor name, row permutation or block layout cannot pass.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UnsupportedModel

GROUP = 32  # a Q4_0 / Q4_1 / Q8_0 block, and the kernel's group size
QUANT_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # the GGUF types kept quantized; other tensors stay dequantized


@dataclass
class Plane:
    """One int4 matrix: codes 0..15 [out, in] (uint8) with a scale and a zero per group of 32 [out, in/32] (float32,
    before the kernel's bfloat16): ``w = (code - 8) * scale + zero``."""

    codes: Any
    scale: Any
    zero: Any


def _block_fields(tensor) -> tuple[Any, Any, Any]:
    """(d, m, codes) of a Q4_0/Q4_1/Q8_0 tensor as numpy arrays [rows, blocks] (d, m float32; m None for Q4_0 and
    Q8_0) and [rows, cols] (Q4: uint8 0..15; Q8_0: int8), decoded as gguf's own dequantizer reads the blocks."""
    import numpy as np

    kind = tensor.tensor_type.name
    data = np.asarray(tensor.data)
    rows = data.shape[0]
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blocks = data.reshape(-1, size)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(rows, -1)
    if kind == "Q8_0":
        codes = blocks[:, 2:].copy().view(np.int8).reshape(rows, -1)
        return d, None, codes
    start = 2 if kind == "Q4_0" else 4
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(rows, -1) if kind == "Q4_1" else None
    packed = blocks[:, start:]  # [n, 16]: element j in the low nibble of byte j, element 16+j in its high nibble
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=1).reshape(rows, -1)
    return d, m, codes


def _reference(kind: str, d, m, codes):
    """The dequantized weights as gguf computes them (float32), for the bit-for-bit check."""
    import numpy as np

    rep = lambda a: np.repeat(a, GROUP, axis=1)  # noqa: E731
    if kind == "Q4_1":
        return rep(d) * codes.astype(np.float32) + rep(m)
    if kind == "Q4_0":
        return rep(d) * (codes.astype(np.int8) - np.int8(8)).astype(np.float32)
    return codes.astype(np.float32) * rep(d)


def _planes(kind: str, d, m, codes) -> list[Plane]:
    """The int4 planes of one tensor (one for Q4_0/Q4_1, two for Q8_0), scales and zeros in float32."""
    import numpy as np

    if kind == "Q4_1":
        return [Plane(codes.astype(np.uint8), d, m + np.float32(8) * d)]
    if kind == "Q4_0":
        return [Plane(codes.astype(np.uint8), d, np.zeros_like(d))]
    hi = (codes >> 4).astype(np.int16) + 8  # arithmetic shift: -8..7, stored as 0..15
    lo = (codes & 0x0F).astype(np.uint8)  # 0..15: x = 16 * (hi - 8) + lo
    return [
        Plane(hi.astype(np.uint8), np.float32(16) * d, np.zeros_like(d)),
        Plane(lo, d, np.float32(8) * d),
    ]


def read_planes(gguf_path: Path, model) -> dict[str, list[Plane]]:
    """The int4 planes of every linear layer of ``model`` (loaded from this GGUF's dequantized checkpoint) whose
    GGUF tensor is Q4_0, Q4_1 or Q8_0, by module name; the LM head from the embedding when the two are tied.

    Each is checked against the module's weight: the GGUF's codes dequantized in float32 (as gguf does) must equal
    the loaded weight bit for bit, in the model's dtype; UnsupportedModel naming the tensor otherwise."""
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
            mm = torch.ops.aten._weight_int4pack_mm_for_cpu
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


def fuse(layers: list) -> Any:
    """One layer computing ``layers`` (int4 layers of one plane each, the same input, no bias) side by side
    (engine.lean). Their packed codes and their scales and zeros stacked along the output dimension when the
    kernel's packing allows it (:func:`_stacks`): each output column is computed from its own row of codes, so its
    bits are the separate layer's (tests/test_lean.py). Otherwise the layers are computed one after another and
    their outputs joined: the same bits, without the saving."""
    import torch

    cls = _int4_linear_class()
    if any(not isinstance(m, cls) or len(m.packed) != 1 or m.bias is not None for m in layers):
        raise UnsupportedModel("only single-plane int4 layers without a bias are fused")
    if not all(_stacks(m.out_features) for m in layers[:-1]):
        return _Joined(layers)
    fused = cls.__new__(cls)
    torch.nn.Module.__init__(fused)
    fused.in_features = layers[0].in_features
    fused.out_features = sum(m.out_features for m in layers)
    fused.packed = [torch.cat([m.packed[0] for m in layers])]
    fused.scales_zeros = [torch.cat([m.scales_zeros[0] for m in layers], dim=1).contiguous()]
    fused.bias = None
    fused.nbytes = sum(m.nbytes for m in layers)
    return fused


class _Joined:
    """Layers computed one after another, their outputs joined along the last dimension (what :func:`fuse` gives
    when the packing does not stack)."""

    def __init__(self, layers: list):
        self.layers = layers
        self.out_features = sum(m.out_features for m in layers)

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

    pinned = manifest.data["model"]
    gguf_path = manifest.gguf_path
    assert gguf_path is not None  # model.weights q4 validates only with a GGUF model.path
    want = pinned["weights_sha256"]
    have = quantize_from_gguf(model, gguf_path, quantized_path(pinned["gguf_sha256"]), want)
    if have != want:
        drift.add("model.weights_sha256", want, have)
        drift.enforce(allow_drift, manifest.source)


def weights_sha256(gguf_path: Path, model_dir: Path, dtype: str, cache: Path | None = None) -> str:
    """The q4 form's canonical SHA-256 for a GGUF whose dequantized checkpoint is ``model_dir`` (what `kvgraft
    manifest init --weights q4` pins), the form written to ``cache`` for the runs that follow."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=getattr(torch, dtype))
    planes = read_planes(gguf_path, model)
    if cache is not None:
        save_planes(planes, cache)
    return canonical_sha256(planes)
