"""A lean forward for Llama models under ``model.weights: q4`` and ``grouped`` attention: transformers' arithmetic,
bit for bit, without transformers' per-step overhead.

A decode step of SmolLM2-135M through transformers' LlamaForCausalLM is thousands of small operations and the Python
around them (decorators, keyword plumbing, a causal mask built for every call, 30 decoder-layer modules, seven
projection modules a layer): with the weights at 4 bits the products are cheap, so that overhead is much of the step
(docs/PERFORMANCE.md, "The GGUF's own 4-bit codes and a lean forward"). This forward runs the same operations in the
same order on the same tensors (the model's own embedding, norm weights, rotary module, ``apply_rotary_pos_emb``'s
products, kvgraft's ``grouped_attention`` arithmetic, the cache's own ``update``), with changes that do not change a
bit:

- q, k and v are one int4 product, and so are gate and up: their planes are stacked along the output dimension.
  torch's int4 kernel computes each output column from its own row of codes, so a column's bits do not depend on
  which other rows share the call (tests/test_lean.py checks it; the packed layout is row by row, so stacking the
  packed tensors is packing the stacked codes). A layer that does not stack (several planes: Q8_0, Q6_K; or kept
  dequantized) is computed alone and its output joined to the others' (quantized.fuse).
- q and k, side by side in that product's output, are rotated as one tensor (elementwise: each head's bits are
  its own), and a float32 norm skips the casts to float32 that return their input.
- attention reads the cache's keys and values where the cache holds them, instead of copying the whole cache into
  contiguous tensors first (:meth:`LeanLlama._attend`).
- the additive causal mask is built only when a forward has more than one token (a decode step attends to every
  cached token: eager's mask is all zeros there, and adding zero changes no bit that softmax reads).

**Under the invariant schedule** (``prefill.schedule: invariant``: every token computed as in a forward of its own)
a forward of many tokens is computed at once with attention row by row (:meth:`LeanLlama._attend_rows`): each query
row attends to exactly the keys before it, in the very call a decode step at that position makes. Every other
operation is row-local, and torch's int4 kernel computes a row's bits whatever rows share the call (checked), so the
batched forward gives the token-by-token bytes at prefill speed, not at one call a token (benchmarks/bench_lean.py
with an invariant manifest; docs/PERFORMANCE.md, "The invariant schedule's cost"): any split of a prompt gives the
same bits, and kvgraft serve's prompt cache may cut a prompt anywhere.

Whether it is in force is checked at every load (:func:`attach`): a forward of a few tokens and a decode step
through both paths on fresh caches (and again at positions given explicitly, as the probe gives them) must give the
same logits bytes and the same cache bytes, or the engine keeps transformers' forward. ``KVGRAFT_LEAN=0`` turns it off (for comparisons; benchmarks/bench_lean.py measures both).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from .attention import aten_products, mix, scores

SUPPORTED_MODEL_TYPES = ("llama",)


class LeanLlama:
    """The forward of a q4 Llama model (see the module doc). ``__call__(cache, ids, last_only)`` returns the logits
    [len(ids) or 1, vocab] of ``ids`` at the positions after the cache's, extending ``cache`` in place, as
    ``model(input_ids=..., cache=...)`` does; with ``rows`` True, the bits of one such call per token (the invariant
    schedule's)."""

    aten = False  # attention's products by ATen's own kernels (model.attn_products: aten); set from the config

    def __init__(self, model: Any):
        from .quantized import fuse

        inner = model.model
        cfg = model.config
        self.embed = inner.embed_tokens.weight
        self.rotary = inner.rotary_emb
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.layers = []
        for layer in inner.layers[: cfg.num_hidden_layers]:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                (
                    layer.input_layernorm,
                    fuse([attn.q_proj, attn.k_proj, attn.v_proj]),
                    (attn.q_proj.out_features, attn.k_proj.out_features),
                    attn,
                    layer.post_attention_layernorm,
                    fuse([mlp.gate_proj, mlp.up_proj]),
                    mlp.gate_proj.out_features,
                    mlp.down_proj,
                )
            )
        self.norm = inner.norm
        self.head = model.lm_head
        self.aten = aten_products(cfg)  # model.attn_products: aten (engine.attention.scores and mix)
        # a 16-bit cache's keys and values widened (:meth:`_widened`), per thread: an engine computes one forward at a
        # time in kvgraft's own commands and server, and a library user's second thread gets buffers of its own
        self._local = threading.local()
        # Layers whose rows are computed together only if their kernel keeps a row's bits whatever shares the call
        # (the int4 one does; a BLAS GEMM does not): the others are computed a row at a time under ``rows``. A fused
        # q/k/v or gate/up that joins a layer kept dequantized (a GGUF type not kept 4-bit) is one of the others.
        int4 = _int4_class()
        self.row_local = {
            id(m)
            for x in self.layers
            for m in (self.head, x[1], x[3].o_proj, x[5], x[7])
            if isinstance(m, int4) or getattr(m, "row_local", False)
        }

    @staticmethod
    def _rms(norm, x):
        # LlamaRMSNorm.forward, inline: the same operations in the same order
        import torch

        dtype = x.dtype
        h = x if dtype == torch.float32 else x.to(torch.float32)  # .to of a float32 tensor returns it: one call less
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + norm.variance_epsilon)
        return norm.weight * (h if dtype == torch.float32 else h.to(dtype))

    def _attend(self, query, key, value, mask, scaling: float):
        """attention.grouped_attention's arithmetic (float32, no dropout) on the cache's own views: the keys and
        values are not first copied into contiguous tensors. Each head's rows are contiguous in the buffer the cache
        grows in, and the batched products over them give the same bits as over a copy (tests/test_lean.py, up to
        4,100 keys at 1 and 2 threads): the copy was the whole cache, every step."""
        import torch

        b, heads, q_len, dim = query.shape
        group = heads // self.kv_heads
        if key.dtype != query.dtype:  # a 16-bit cache (model.kv_dtype): widened exactly, contiguous, as grouped does
            key, value = self._widened(key, 0, query.dtype), self._widened(value, 1, query.dtype)
        q = query.reshape(b, self.kv_heads, group * q_len, dim)
        weights = scores(q, key, self.aten).view(b, heads, q_len, -1) * scaling
        if mask is not None:
            weights = weights + mask
        weights = torch.nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
        out = mix(weights.view(b, self.kv_heads, group * q_len, -1), value, self.aten)
        return out.view(b, heads, q_len, value.shape[-1]).transpose(1, 2).contiguous()

    def _widened(self, t, slot: int, dtype):
        """``t`` (a 16-bit cache's keys or values) widened to ``dtype`` in a contiguous tensor: the values ``t.to(dtype)``
        gives, in a scratch buffer this forward keeps (one for keys, one for values) instead of new memory every layer
        of every step. Under deterministic algorithms torch fills every new tensor before it is written: that fill was
        a second pass over the widened cache, which made a 16-bit cache decode slower than a float32 one
        (docs/PERFORMANCE.md, "Graft at memory speed"). Each attention call (under the invariant schedule, a layer's
        rows) consumes its widened copy before the next is made."""
        import torch

        n = t.numel()
        scratch = self._local.__dict__.setdefault("scratch", [None, None])
        buf = scratch[slot]
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = scratch[slot] = torch.empty(n + n // 4, dtype=dtype)  # room to grow a quarter first
        wide = buf[:n].view(t.shape)
        wide.copy_(t)
        return wide

    def _attend_rows(self, query, key, value, scaling: float):
        """The invariant schedule's attention for ``q_len`` > 1: row r attends to the first ``past + r + 1`` keys,
        alone, exactly as the decode step at its position does (same shapes, the same views of the cache's buffer),
        so its bits are the token-by-token forward's whichever rows share the call. No mask: a row sees no key past
        its own."""
        import torch

        n = query.shape[2]
        past = key.shape[2] - n
        if key.dtype != query.dtype:  # a 16-bit cache widened once for every row (each row reads a prefix of it)
            key, value = self._widened(key, 0, query.dtype), self._widened(value, 1, query.dtype)
        rows = [
            self._attend(query[:, :, r : r + 1], key[:, :, : past + r + 1], value[:, :, : past + r + 1], None, scaling)
            for r in range(n)
        ]
        return torch.cat(rows, dim=1)

    def _linear(self, module, x, rows: bool):
        """``module(x)``; under ``rows`` one row at a time unless the module's kernel is row-local."""
        import torch

        if not rows or x.shape[1] == 1 or id(module) in self.row_local:
            return module(x)
        return torch.cat([module(x[:, r : r + 1]) for r in range(x.shape[1])], dim=1)

    def __call__(self, cache, ids: list[int], last_only: bool = False, rows: bool = False, start: int | None = None):
        import torch

        n = len(ids)
        past = cache.get_seq_length()
        # Rotary positions from ``start`` when given (the probe's prefixes away from position 0); the causal mask,
        # as transformers builds it, from the cache's own positions.
        cache_positions = torch.arange(past, past + n).unsqueeze(0)
        position_ids = cache_positions if start is None else torch.arange(start, start + n).unsqueeze(0)
        rows = rows and n > 1
        mask = None
        if n > 1 and not rows:  # eager's additive causal mask (masking_utils.eager_mask): 0 where a key is seen
            seen = torch.arange(past + n).unsqueeze(0) <= cache_positions[0].unsqueeze(1)
            mask = torch.where(seen, 0.0, torch.finfo(self.embed.dtype).min).to(self.embed.dtype)[None, None]

        def attend(i: int, q, k, v, scaling: float):
            k, v = cache.update(k, v, i)
            return self._attend_rows(q, k, v, scaling) if rows else self._attend(q, k, v, mask, scaling)

        hidden = self._layers(ids, position_ids, attend, rows)
        if last_only:
            hidden = hidden[:, -1:, :]
        return self._linear(self.head, hidden, rows)[0]

    def step(self, caches: list, ids: list[int]):
        """One decode step of several sequences at once: ``ids[r]`` after ``caches[r]`` (each extended in place).
        Returns the logits [len(ids), vocab], row r the bits ``self(caches[r], [ids[r]])`` gives alone.

        The rows go through the linear layers together (torch's int4 kernel computes a row's bits whatever rows
        share the call, and reads each weight once for all of them: the point of batching), a layer whose kernel
        is not row-local one row at a time (:meth:`_linear`); everything else is elementwise or a reduction within
        a row, and attention is each row's own decode step: its query row against its own cache, in the call a
        decode step alone makes. :func:`check_step` compares the two at first use."""
        import torch

        n = len(ids)
        position_ids = torch.tensor([[c.get_seq_length() for c in caches]], dtype=torch.long)

        def attend(i: int, q, k, v, scaling: float):
            out = []
            for r, cache in enumerate(caches):
                kr, vr = cache.update(k[:, :, r : r + 1], v[:, :, r : r + 1], i)
                out.append(self._attend(q[:, :, r : r + 1], kr, vr, None, scaling))
            return torch.cat(out, dim=1)

        hidden = self._layers(ids, position_ids, attend, rows=n > 1)
        return self._linear(self.head, hidden, n > 1)[0]

    def _layers(self, ids: list[int], position_ids, attend, rows: bool):
        """The decoder over ``ids`` at ``position_ids``, to the final norm: ``attend(layer, q, k, v, scaling)``
        stores the new keys and values and returns attention's output [1, len(ids), heads, dim]."""
        import torch
        from transformers.models.llama.modeling_llama import rotate_half

        n = len(ids)
        x = torch.tensor([ids], dtype=torch.long)
        hidden = torch.nn.functional.embedding(x, self.embed)
        cos, sin = self.rotary(hidden, position_ids=position_ids)
        shape = (1, n, -1, self.head_dim)
        for i, (norm1, qkv, (q_out, k_out), attn, norm2, gate_up, g_out, down) in enumerate(self.layers):
            residual = hidden
            h = self._linear(qkv, self._rms(norm1, hidden), rows)
            # q and k side by side are rotated as one tensor: an elementwise product, each head's bits its own
            qk = h[..., : q_out + k_out].view(shape).transpose(1, 2)
            qk = qk * cos.unsqueeze(1) + rotate_half(qk) * sin.unsqueeze(1)
            q, k = qk[:, : q_out // self.head_dim], qk[:, q_out // self.head_dim :]
            v = h[..., q_out + k_out :].view(shape).transpose(1, 2)
            out = attend(i, q, k, v, attn.scaling)
            hidden = residual + self._linear(attn.o_proj, out.reshape(1, n, -1).contiguous(), rows)
            residual = hidden
            h = self._linear(gate_up, self._rms(norm2, hidden), rows)
            hidden = residual + self._linear(down, torch.nn.functional.silu(h[..., :g_out]) * h[..., g_out:], rows)
        return self._rms(self.norm, hidden)


def _int4_class():
    from .quantized import _int4_linear_class

    return _int4_linear_class()


def attach(engine) -> bool:
    """Give ``engine`` the lean forward when its model is one (a q4 Llama under grouped attention, KVGRAFT_LEAN not
    0) and a check on this machine shows it computes transformers' bytes: a 5-token forward, a 3-token one after it
    and a decode step, on fresh caches, then a forward and a step at positions given explicitly (the probe's),
    logits and cache states compared with torch.equal. Under the invariant schedule transformers' side runs one call
    per token and the lean side the whole forward with ``rows``: the schedule's bits, which the lean forward then
    computes batched. Returns whether it did."""

    if os.environ.get("KVGRAFT_LEAN", "1") == "0":
        return False
    model = engine.model
    m = engine.manifest.model
    if (
        m.weights != "q4"
        or m.attn_implementation != "grouped"
        or getattr(model.config, "model_type", None) not in SUPPORTED_MODEL_TYPES
        or str(engine.device) != "cpu"
    ):
        return False
    lean = LeanLlama(model)
    runs = (
        [([11, 12, 13, 14, 15], None), ([16, 17, 18], None), ([19], None)],  # a prefill, another, a decode step
        [([21, 22, 23, 24], 7), ([25], 11)],  # positions given explicitly (the probe's), on an empty cache
    )
    with engine._infer():
        if not all(_same_bytes(engine, lean, run) for run in runs):
            return False
    engine.lean = lean
    return True


def _same_bytes(engine, lean: LeanLlama, run: list) -> bool:
    """Whether ``run`` (forwards of (ids, start) in turn, on fresh caches) gives the same logits and cache bytes
    through transformers' model and the lean forward: under the invariant schedule transformers one call a token."""
    import torch

    ref_cache, lean_cache = engine.new_cache(), engine.new_cache()
    for ids, start in run:
        calls = (
            [([t], None if start is None else start + i) for i, t in enumerate(ids)]
            if engine.invariant
            else [(ids, start)]
        )
        want = torch.cat(
            [
                engine.model(
                    input_ids=torch.tensor([c], dtype=torch.long),
                    cache=ref_cache,
                    use_cache=True,
                    **({} if p is None else {"position_ids": torch.arange(p, p + len(c)).unsqueeze(0)}),
                ).logits[0]
                for c, p in calls
            ]
        )
        if not torch.equal(want, lean(lean_cache, ids, rows=engine.invariant, start=start)):
            return False
    return all(
        torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        for a, b in zip(ref_cache.layers, lean_cache.layers)
    )


def check_step(engine) -> str | None:
    """Whether ``engine`` decodes several sequences in one step with each sequence's own bits (:meth:`LeanLlama.step`):
    None when it does, else why not, in words a server prints at start. Checked on this machine, once per engine
    (Engine.batch_refusal): three sequences of 5, 9 and 2 tokens decode two steps together, then two of them a third
    step (one has left), against each decoded alone on a cache of its own; logits and cache bytes compared with
    torch.equal. A configuration whose step would mix rows (a kernel whose row depends on the rows beside it) fails
    here and decodes one sequence at a time."""
    import torch

    if engine.lean is None:
        return (
            "batched decode needs the lean forward (model.weights q4, attn_implementation grouped, a Llama model, "
            f"the CPU, KVGRAFT_LEAN not 0); this engine runs {engine.environment.get('forward', 'transformers')}'s"
        )
    lean = engine.lean
    prompts = ([3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16], [17, 18])  # ids any vocabulary holds
    steps = ([19, 20, 21], [22, 23, 24], [25, None, 26])  # None: that sequence has left
    with engine._infer():
        alone = [engine.prefill(p)[0] for p in prompts]
        together = [engine.prefill(p)[0] for p in prompts]
        for toks in steps:
            live = [r for r, t in enumerate(toks) if t is not None]
            batched = lean.step([together[r] for r in live], [toks[r] for r in live])
            for j, r in enumerate(live):
                if not torch.equal(batched[j], lean(alone[r], [toks[r]])[-1]):
                    return f"a batched decode step's logits differ from a step alone on this machine (row {j})"
    for a, b in zip(alone, together):
        if not all(torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values) for x, y in zip(a.layers, b.layers)):
            return "a batched decode step's cache states differ from a step alone on this machine"
    return None
