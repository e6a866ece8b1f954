"""Blocks of GGUF's k-quant types for tests (gguf has no quantizer for them): test_quantized.py's decoding checks and
test_gguf.py's small mixed GGUF."""

from __future__ import annotations

import gguf
import numpy as np


def k_blocks(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """Q4_K, Q5_K or Q6_K blocks [rows, bytes] (gguf has no quantizer for them): every field random, which any bytes are
    (codes, 6-bit scales and minimums, Q6_K's signed 8-bit scales), but the float16 factors, set to the magnitudes a
    quantizer writes (and their extremes: the largest codes and scales below)."""
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
    factors = (rng.random((blocks.shape[0], 2)) * 2e-3 + 1e-4).astype(np.float16)
    if kind != "Q6_K":
        blocks[:, 0:4] = factors.view(np.uint8)  # d, dmin
    else:
        blocks[:, 208:210] = factors[:, :1].view(np.uint8)  # d
        blocks[0, 192:194] = (0x80, 0x7F)  # scales -128 and 127 ...
        blocks[0, :16] = 0  # ... over codes of -32 (low nibbles 0, high bits 0)
        blocks[0, 128:132] = 0
    return blocks.reshape(rows, -1)
