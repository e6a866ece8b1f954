"""Kernel-flag profiles: which environment variables change the bits of a forward pass, and the named sets of
pins (``portable``, ``native``) that `kvgraft manifest init` writes. Plain data, no torch: applying them is the
engine's job (engine.determinism)."""

from __future__ import annotations

import os
from typing import Any

# The choices a manifest can pin (the schema's enums; tests/test_manifest.py checks they agree).
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "grouped")  # grouped: kvgraft's own (engine.attention)
WEIGHTS = ("dequantized", "q4")  # a GGUF's linear layers: dequantized, or its 4-bit codes kept (engine.quantized)
SDPA_BACKENDS = ("math", "efficient", "flash", "cudnn")

# Environment variables known to change the bits of a forward pass. A manifest pins each (a value, or null for
# "must be unset"); one that is set but not pinned is drift.
KNOWN_BIT_ENV = (
    "MKL_CBWR",
    "ATEN_CPU_CAPABILITY",
    "MKL_ENABLE_INSTRUCTIONS",
    "DNNL_MAX_CPU_ISA",
    "ONEDNN_MAX_CPU_ISA",
    "CUBLAS_WORKSPACE_CONFIG",
    "NVIDIA_TF32_OVERRIDE",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
)

# Named kernel-flag profiles for `kvgraft manifest init`.
PROFILES: dict[str, dict[str, Any]] = {
    # Single thread, MKL in conditional-numerical-reproducibility mode, ATen's baseline CPU kernels, and oneDNN
    # capped at SSE4.1. Measured on two x86-64 machines (AMD EPYC with AVX2; Intel Xeon with AVX-512, AVX512-BF16 and
    # AMX): float32 forwards were identical with the first three flags alone, but bfloat16/float16 matmuls go
    # through oneDNN, which picks AMX/AVX-512 kernels on the Xeon and changed bits there; the cap makes them agree.
    "portable": {
        "threads": 1,
        "env": {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"},
    },
    # Every x86-64 CPU with AVX2 and FMA (Intel since Haswell, AMD since Zen), Intel or AMD, whatever its widest
    # instruction set: ATen's AVX2 kernels (the int4 product among them), MKL's AVX2 code path in conditional-numerical-
    # reproducibility mode, oneDNN capped at AVX2. Each library then runs the same instructions on every such machine,
    # so the bits are theirs at the pinned thread count; on an AVX2 CPU they are the native profile's, at its speed.
    # What each pin costs on a CPU with AVX-512: docs/EXACTNESS.md ("The avx2 profile").
    "avx2": {
        "threads": None,
        "env": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    },
    # This machine's fastest kernels; bits pinned to this CPU (its kernel identity, config.kernels) and thread count.
    "native": {"threads": None, "env": {}},
}


def default_profile(device: str = "cpu") -> str:
    """The profile `kvgraft manifest init` writes unless told: ``native`` on a GPU (gpu_name pins the device),
    ``avx2`` on a CPU that can run it (bits every AVX2 machine reproduces), else ``portable``."""
    from .kernels import this_cpu

    if device != "cpu":
        return "native"
    return "portable" if this_cpu().missing("avx2") else "avx2"


def environ_without_pins() -> dict[str, str]:
    """This process's environment minus every known bit-changing variable: what a child gets when it pins its own
    flags (a leftover would count as drift there, or silently change bits)."""
    return {k: v for k, v in os.environ.items() if k not in KNOWN_BIT_ENV}


def profile_env(profile: str, device: str = "cpu") -> dict[str, str | None]:
    """The environment a profile pins: its own variables, CUBLAS_WORKSPACE_CONFIG on CUDA, every other known
    bit-changing variable null (must be unset), so a stray one in the shell shows up as drift."""
    env: dict[str, str | None] = {k: None for k in KNOWN_BIT_ENV}
    env.update(PROFILES[profile]["env"])
    if device == "cuda":
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # deterministic cuBLAS workspaces
    return dict(sorted(env.items()))
