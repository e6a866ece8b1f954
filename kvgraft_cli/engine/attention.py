"""kvgraft's own attention implementation, ``grouped`` (a manifest's ``model.attn_implementation: grouped``).

Eager attention's arithmetic (Q·Kᵀ times the scale, the logit soft cap where the model has one, the additive mask,
softmax in float32, then ·V), computed once per KV head for all the query heads that share it. transformers' eager
attention first copies every cached key and value once per query head of the group (``repeat_kv``): with grouped
heads (3 query heads a KV head in SmolLM-135M, 4 in Llama-3-8B) each forward writes and reads the layer's whole cache
that many times over, which after a graft of thousands of tokens is most of a decode step's time and the largest
temporary of a graft's first forward.

The products are the same sums over the same operands, but in matrices of other shapes (the group's query rows
stacked), so the BLAS may order the sums differently and the bits are not eager's (on this project's CPU a single
query row's differ, and so do a 16-token query's logits over a grafted 2,048-token cache of SmolLM-135M's shape).
Where the order of sums cannot matter they are eager's, bit for bit (tests/test_attention.py). ``grouped`` is
therefore a kernel choice of its own, pinned by the manifest like ``eager`` and ``sdpa``: a graft under it is
byte-equal to a fresh computation under it (``kvgraft matrix --attn grouped``), never to one under eager. The
softmax is in float32 for every architecture (GPT-2's eager one runs in the model's dtype).
"""

from __future__ import annotations

import threading
from typing import Any

from . import ckernels  # stdlib only at import: the library is built and checked on first use

NAME = "grouped"
# model.attn_products: which code computes attention's two products (Q·Kᵀ and weights·V). ``blas`` (absent): torch's
# matmul, which hands float32 products to MKL, whose blocking and kernels follow the CPU it runs on (cache sizes,
# vendor) even in its reproducible modes. Measured 2026-12-06: the main job's prereg, made on an AMD EPYC under the
# avx2 profile, replayed on an Intel Xeon with 55 of 129 hashes (1 of its 20 deposits' logits); with MKL_CBWR
# AVX2,STRICT, 71 (14 of 20). ``aten``: an elementwise product and a sum, both ATen's own kernels (the instructions
# ATEN_CPU_CAPABILITY pins, in an order fixed by the shapes and the thread count alone), so every x86-64 CPU with
# AVX2 computes the same bits. Its own bits, part of the compute pin. docs/EXACTNESS.md, "The avx2 profile".
PRODUCTS = ("blas", "aten")
# Floats in one product's temporary at most (the query rows are taken as many at a time as fit): 1 MiB, within a
# core's L2. Any size gives the same bits (tests/test_attention_products.py); the timing that chose it: docs/SERVE.md.
ATEN_TEMP = 1 << 18


def scores(q, key, aten: bool):
    """Q·Kᵀ: ``q`` [b, kv, m, d], ``key`` [b, kv, n, d] -> [b, kv, m, n] (``aten``: ATen's mul and sum over d, whose
    bits engine.ckernels computes without the temporary where it runs)."""
    import torch

    if not aten:
        return torch.matmul(q, key.transpose(2, 3))
    out = ckernels.scores(q, key)
    return aten_scores(q, key) if out is None else out


def aten_scores(q, key):
    """Q·Kᵀ as ATen's elementwise product and sum over d."""
    import torch

    rows = _rows(key)
    # Each output's sum is over its own d products, in an order that does not depend on how many rows share the call
    parts = [_product(q[:, :, i : i + rows].unsqueeze(3), key.unsqueeze(2)).sum(-1) for i in range(0, q.shape[2], rows)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def mix(weights, value, aten: bool):
    """weights·V: ``weights`` [b, kv, m, n], ``value`` [b, kv, n, d] -> [b, kv, m, d] (``aten``: ATen's mul and sum
    over n, whose bits engine.ckernels computes without the temporary where it runs)."""
    import torch

    if not aten:
        return torch.matmul(weights, value)
    out = ckernels.mix(weights, value)
    return aten_mix(weights, value) if out is None else out


def aten_mix(weights, value):
    """weights·V as ATen's elementwise product and sum over n."""
    import torch

    rows = _rows(value)
    w = weights
    parts = [
        _product(w[:, :, i : i + rows].unsqueeze(-1), value.unsqueeze(2)).sum(-2) for i in range(0, w.shape[2], rows)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


_SCRATCH = threading.local()


def _product(a, b):
    """``a * b`` (broadcast) written into a scratch buffer this thread keeps: under deterministic algorithms torch
    fills every new tensor before it is written, a third pass over the largest temporary of a decode step. The
    values are the product's, wherever they are written."""
    import torch

    shape = torch.broadcast_shapes(a.shape, b.shape)
    n = 1
    for x in shape:
        n *= x
    buf = getattr(_SCRATCH, "buf", None)
    # (a buffer made in inference mode cannot be written outside it, nor the other way: one a mode)
    if (
        buf is None
        or buf.numel() < n
        or buf.dtype != a.dtype
        or buf.is_inference() != torch.is_inference_mode_enabled()
    ):
        buf = _SCRATCH.buf = torch.empty(max(n, 1 << 16), dtype=a.dtype)
    return torch.mul(a, b, out=buf[:n].view(shape))


def _rows(t) -> int:
    """How many query rows a product takes at a time: its temporary (rows x keys x dim per KV head) within
    ATEN_TEMP."""
    b, kv, n, d = t.shape
    return max(1, ATEN_TEMP // max(1, b * kv * n * d))


def aten_products(config) -> bool:
    """Whether a model loaded under a manifest with ``model.attn_products: aten`` (engine.load_engine marks its
    config) computes attention's products with ATen's own kernels."""
    return getattr(config, "kvgraft_attn_products", "blas") == "aten"


# Keyword arguments some architectures pass that change the arithmetic and that this kernel does not implement.
_UNSUPPORTED = ("sinks", "s_aux", "position_bias", "head_mask")
# Model types whose own eager attention is the arithmetic above (read in transformers 5.24's modeling files; the
# zoo's architectures, tests/test_attention.py). Others may compute Q·K in float32 (GPT-J, CodeGen), add sinks or
# biases: grouped refuses them rather than compute something else under their name.
SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "gemma4_text",
    "phi3",
    "olmo2",
    "gpt2",
)


def grouped_attention(
    module: Any,
    query,
    key,
    value,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs,
):
    """Attention over ``key``/``value`` [batch, kv_heads, keys, dim] for ``query`` [batch, heads, queries, dim]
    without expanding the KV heads. Returns (output [batch, queries, heads, dim], weights), as transformers'
    attention functions do. Refuses what it does not implement (attention sinks, biases, head masks) by name."""
    import torch

    from ..errors import UnsupportedModel

    used = [k for k in _UNSUPPORTED if kwargs.get(k) is not None]
    if used:
        raise UnsupportedModel(
            f"attention implementation {NAME!r} does not implement {', '.join(used)} ({type(module).__name__})",
            "use attn_implementation: eager for this model",
        )
    b, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if heads % kv_heads:
        raise UnsupportedModel(f"{heads} query heads do not group over {kv_heads} KV heads ({type(module).__name__})")
    group = heads // kv_heads
    if scaling is None:
        scaling = dim**-0.5
    # Query head j reads KV head j // group (transformers' repeat_kv order): stack each group's query rows.
    q = query.reshape(b, kv_heads, group * q_len, dim)
    # Keys and values in one layout whatever holds them (a fresh cache's concatenation, a grafted cache's view of
    # the buffer it grows in, growcache), as repeat_kv's copy makes them for eager. oneDNN otherwise keeps a
    # reordered copy of a strided bfloat16 operand for every new length, so memory grows at every decode step
    # (benchmarks/bench_attention.py's --rss-child; docs/PERFORMANCE.md, "Attention without copying KV heads"). The
    # copy also shows the BLAS one layout for a graft and for a fresh computation (on this CPU the two layouts gave
    # the same bits).
    # A 16-bit cache (model.kv_dtype) is widened to the query's dtype here, exactly (every float16 and bfloat16 value
    # is a float32 one), into the same contiguous layout: attention's arithmetic stays float32.
    key, value = key.to(query.dtype).contiguous(), value.to(query.dtype).contiguous()
    aten = aten_products(getattr(module, "config", None))
    weights = scores(q, key, aten).view(b, heads, q_len, -1) * scaling
    if softcap is not None:
        weights = torch.tanh(weights / softcap) * softcap
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    out = mix(weights.view(b, kv_heads, group * q_len, -1), value, aten).view(b, heads, q_len, value.shape[-1])
    return out.transpose(1, 2).contiguous(), weights


def check_supported(config) -> None:
    """Refuse a model whose eager attention is not the arithmetic this kernel does (UnsupportedModel, naming it)."""
    from ..errors import UnsupportedModel

    text = config.get_text_config()
    model_type = getattr(text, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES or getattr(text, "reorder_and_upcast_attn", False):
        raise UnsupportedModel(
            f"attention implementation {NAME!r} is not offered for model type {model_type!r}"
            + (" with reorder_and_upcast_attn" if model_type in SUPPORTED_MODEL_TYPES else ""),
            f"grouped reproduces the eager attention of {', '.join(SUPPORTED_MODEL_TYPES)}; "
            "use attn_implementation: eager",
        )


def register() -> None:
    """Make ``grouped`` an attention implementation transformers can load a model with (idempotent): the kernel,
    and for its masks eager's (an additive float mask, causal and sliding-window as the model asks). Without the
    second, transformers builds no mask for an implementation it does not know, and every forward of more than one
    token would attend to the tokens after it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, grouped_attention)
    AttentionMaskInterface.register(NAME, eager_mask)
