"""The torch engine: load a pinned model, prefill by the manifest's schedule, capture and restore KV caches.

Only this module (and the commands that call it) imports torch and transformers. Every forward runs under
``torch.inference_mode()`` with batch size 1; a decode step of several sequences together (engine.decoding, the lean
forward's ``step``) computes each row's bits as that sequence alone would, or is not taken. A graft is at the artifact's own position: the restored cache holds
the prefix at positions 0..n-1 and the suffix continues at n, the only numerically exact operating point.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..artifacts.format import LayerState
from ..config.manifest import Manifest, clip
from ..config.modelhash import CHARS_PER_TOKEN, ModelHashes, hash_model_dir
from ..errors import InputError, UnsupportedModel
from ..util.memory import keep_freed_memory
from . import determinism
from .attention import NAME as GROUPED
from .attention import check_supported as check_grouped
from .attention import register as register_grouped
from .decoding import Stream, step
from .determinism import Drift

# Architectures whose cache is not kvgraft's (refused by config.json's model_type before the weights load): their
# forward rejects a DynamicCache, or keeps state a DynamicCache cannot hold.
UNSUPPORTED_MODEL_TYPES = {
    "minimax": "MiniMax keeps lightning (linear) attention state in its own MiniMaxCache and rejects a DynamicCache",
}


def tensor_sha256(t) -> str:
    """SHA-256 of a tensor's raw little-endian bytes (row-major, contiguous). dtype and shape are recorded beside it."""
    import torch

    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def token_ids_sha256(ids: list[int]) -> str:
    """SHA-256 of token ids as int64 little-endian bytes (the artifact's ``token_ids`` tensor bytes)."""
    import struct

    return hashlib.sha256(struct.pack(f"<{len(ids)}q", *ids)).hexdigest()


def chunk_spans(ids: list[int], chunk: int, cuts: frozenset[int] = frozenset()) -> list[tuple[int, int]]:
    """The chunked schedule's forwards over ``ids``: (start, end) spans of ``chunk`` tokens from the first, the last
    shorter, and with ``cuts`` (prefill.cut_before's token ids) a span also ends before each cut token, so the token
    starts the next one. A span depends only on the tokens up to it and the token after it: two prompts that agree
    up to a cut token (or to a full chunk) are computed by the same forwards up to there."""
    spans: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or i - start == chunk or (cuts and ids[i] in cuts):
            spans.append((start, i))
            start = i
    return spans


def closed_span(ids: list[int], span: tuple[int, int], chunk: int, cuts: frozenset[int]) -> bool:
    """Whether a span of :func:`chunk_spans` is the same in every prompt that starts with ``ids[:span[1]]`` and goes
    on: a full chunk, or one a cut token follows. An open span (the prompt's shorter last one) may be longer in a
    prompt that goes on."""
    start, end = span
    return end - start == chunk or (end < len(ids) and ids[end] in cuts)


@dataclass
class Engine:
    """A loaded, pinned model with the operations kvgraft needs."""

    manifest: Manifest
    model: Any
    tokenizer: Any
    device: Any
    hashes: ModelHashes
    drift: Drift
    environment: dict[str, Any]
    layout: list[tuple[str, int | None]] = field(default_factory=list)  # (kind, sliding window) per cache layer
    lean: Any = None  # engine.lean.LeanLlama when in force: transformers' bits, less overhead a step
    _prompts: Any = field(default=None, init=False, repr=False)
    _cuts: frozenset[int] | None = field(default=None, init=False, repr=False)
    _empty: Any = field(default=None, init=False, repr=False)  # _empty_cache's template (False: none usable)
    _batch_refusal: Any = field(default=False, init=False, repr=False)  # batch_refusal, once checked

    @property
    def prompts(self):
        """The manifest's prompt texts bound to this tokenizer (engine.prompts.Prompts: plain templates or the
        tokenizer's chat template)."""
        if self._prompts is None:
            from .prompts import Prompts

            self._prompts = Prompts(self.manifest.prompt, self.tokenizer, self.manifest.name or "the model")
        return self._prompts

    @property
    def kv_dtype(self):
        """The cache's torch dtype when model.kv_dtype narrows it (a 16-bit cache of a float32 model), else None."""
        name = self.manifest.model.kv_dtype
        if name is None:
            return None
        import torch

        return getattr(torch, name)

    @property
    def prefill_cuts(self) -> frozenset[int]:
        """The token ids of prefill.cut_before (a chunked schedule's chunk also ends before each); empty without."""
        prefill = self.manifest.prefill
        names = prefill.cut_before
        if not names or prefill.schedule != "chunked":  # (validation refuses cuts under another schedule)
            return frozenset()
        if self._cuts is None:
            self._cuts = frozenset(cut_token_ids(self.tokenizer, list(names)))
        return self._cuts

    # -- tokens -------------------------------------------------------------------------------------------------
    def encode(self, text: str, where: str | None = None) -> list[int]:
        """Token ids of ``text`` without special tokens. Bounded for any input: a text longer than the model's
        positions times CHARS_PER_TOKEN is refused before tokenizing (InputError naming ``where``), and the ids are
        truncated at max_positions + 1 (a text that long fits nowhere: every position check refuses it)."""
        limit = self.max_positions
        if not limit:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        check_text_length(text, limit, where)
        return list(self.tokenizer(text, add_special_tokens=False, truncation=True, max_length=limit + 1)["input_ids"])

    def prefix_ids(self, text: str, where: str | None = None) -> list[int]:
        """Token ids of a rendered prefix, with BOS when the manifest asks for it; InputError (naming ``where``, e.g.
        ``problems.jsonl:7``) for a prefix longer than the model's positions, before any forward."""
        ids = self.encode(text, where or "prefix")
        ids = self.manifest.prompt.with_bos(ids, self.tokenizer.bos_token_id)
        limit = self.max_positions
        if limit and len(ids) > limit:
            raise InputError(
                f"{where or 'prefix'}: the prefix has more than the model's {limit:,} positions "
                f"({'at least ' if len(ids) > limit + 1 else ''}{len(ids):,} tokens)",
                "shorten the problem or solution",
            )
        return ids

    def decode_text(self, ids: list[int], skip_special: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def gpu_energy_mj(self) -> int | None:
        """NVML's total-energy counter of the GPU in millijoules (CUDA with pynvml installed), else None."""
        if str(self.device).split(":")[0] != "cuda":
            return None
        try:
            import pynvml

            pynvml.nvmlInit()
            index = self.device.index or 0
            return int(pynvml.nvmlDeviceGetTotalEnergyConsumption(pynvml.nvmlDeviceGetHandleByIndex(index)))
        except Exception:  # no pynvml, or a GPU/driver without the counter: energy is simply not reported
            return None

    # -- forwards -----------------------------------------------------------------------------------------------
    @contextmanager
    def _infer(self):
        import torch

        with torch.inference_mode(), determinism.sdpa_context(self.manifest.runtime.sdpa_backend):
            yield

    def new_cache(self, grow: bool = True):
        """An empty cache for this model. On the CPU its full layers grow in place (growcache.GrowingLayer: a decode
        step writes its token into room instead of concatenating the whole layer into new tensors, a copy of the
        cache every step); ``grow`` False keeps transformers' layers (what :meth:`restore` starts from)."""
        from transformers.cache_utils import DynamicLayer

        from .growcache import enabled, layer_class

        cache = self._empty_cache()
        if grow and enabled(self.device):
            kv_dtype = self.kv_dtype
            for i, layer in enumerate(cache.layers):
                if type(layer) is DynamicLayer:
                    cache.layers[i] = layer_class()()
                    cache.layers[i].kv_dtype = kv_dtype
        return cache

    def _empty_cache(self):
        """An empty ``DynamicCache(config=...)`` of this model. Building one reads the config's layer types afresh,
        a large share of a small model's restore (docs/PERFORMANCE.md, "Graft: Python first, then a staged read"),
        so the first is kept as a template and the next are its copies, layer objects copied too, when its layers
        hold nothing but plain values (a sliding layer keeps a tensor of its window: such a model builds every cache
        from the config)."""
        import copy

        from transformers import DynamicCache

        if self._empty is None:
            template = DynamicCache(config=self.model.config)
            plain = (type(None), bool, int, float, str, type)
            usable = all(type(v) in plain for v in vars(template).values() if v is not template.layers) and all(
                type(v) in plain for layer in template.layers for v in vars(layer).values()
            )
            self._empty = template if usable else False
        if self._empty is False:
            return DynamicCache(config=self.model.config)
        cache = copy.copy(self._empty)
        cache.layers = [copy.copy(layer) for layer in self._empty.layers]
        return cache

    def forward(self, cache, ids: list[int], last_only: bool = False, start: int | None = None):
        """Run ``ids`` through the model on ``cache`` (extended in place). Returns float logits [len(ids) or 1, vocab].

        ``start`` sets the position of ``ids[0]`` explicitly (the probe computes prefixes away from position 0);
        by default positions continue from the cache's length, as in every graft.
        """
        import torch

        if self.lean is not None:  # under invariant: the token-by-token bits, batched (lean.py)
            with self._infer():
                return self.lean(cache, ids, last_only, rows=self.invariant, start=start)
        if self.invariant and len(ids) > 1:
            return self._forward_token_by_token(cache, ids, last_only, start)
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        extra = {}
        if start is not None:
            extra["position_ids"] = torch.arange(start, start + len(ids), device=self.device).unsqueeze(0)
        with self._infer():
            out = self.model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1 if last_only else 0, **extra)
        return out.logits[0]

    @property
    def invariant(self) -> bool:
        """Whether the manifest's schedule is ``invariant``: every forward computes one token at a time."""
        return self.manifest.prefill.invariant

    def _forward_token_by_token(self, cache, ids: list[int], last_only: bool, start: int | None):
        """The invariant schedule's forward: one model call per token, in order, on ``cache``.

        Why this is schedule-invariant: the call for the token at position p always has the same shapes (one query
        row; the p cached keys before it) and the same inputs (by induction, the cache rows before p were computed
        the same way), so on a deterministic backend it runs the same kernels on the same bytes whichever way the
        prompt was split into calls. Batched kernels are not: a GEMM's row, a reduction's order, depend on how
        many rows are computed together (scripts/schedule_diff.py names the first such module). The cost is that
        a prefill runs at decode speed; a graft's decode steps were one token a call already."""
        import torch

        rows = []
        for i, token in enumerate(ids):
            logits = self.forward(cache, [token], start=None if start is None else start + i)
            if not last_only or i == len(ids) - 1:
                rows.append(logits)
        return torch.cat(rows)

    def single_pass(self, ids: list[int], keep: int):
        """Logits of the last ``keep`` positions of one forward over ``ids`` from position 0 on a fresh cache: the
        reference a user would compute by simply running the model on the whole prompt (under the invariant
        schedule, the schedule's own forward; otherwise one batched call of the model)."""
        if self.invariant:
            return self.forward(self.new_cache(), ids)[-keep:]
        return self.batched_pass(ids, keep)

    def batched_pass(self, ids: list[int], keep: int):
        """Logits of the last ``keep`` positions of one batched model call over ``ids`` (whatever the schedule):
        what the model's own kernels compute, for comparison with the invariant schedule's bits. Under
        model.kv_dtype on a 16-bit cache of this engine's (the model's own cache would keep float32 states: another
        configuration)."""
        import torch

        with self._infer():
            x = torch.tensor([ids], dtype=torch.long, device=self.device)
            narrow = {"cache": self.new_cache(), "use_cache": True} if self.kv_dtype is not None else {}
            return self.model(input_ids=x, logits_to_keep=keep, **narrow).logits[0]

    @property
    def max_positions(self) -> int | None:
        """The model's position limit (``max_position_embeddings``), if it declares one."""
        cfg = self.model.config.get_text_config(decoder=True)
        return getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)

    def prefill(self, ids: list[int], offset: int = 0, cache=None):
        """Prefill ``ids`` by the manifest's schedule. Returns (cache, last-position logits [vocab]).

        Into a fresh cache by default; with ``cache`` (a chain's parent, restored or computed) the ids continue it
        in place, at the positions after it: how a chain link is computed. ``offset`` (the probe's counterfactual)
        puts a fresh prefix at positions offset..offset+n-1 instead of 0..n-1.
        """
        if not ids:
            raise InputError("cannot prefill an empty prefix")
        limit = self.max_positions
        before = offset if cache is None else cache.get_seq_length()
        if limit and before + len(ids) > limit:
            raise InputError(f"prefix of {len(ids)} tokens at position {before} exceeds the model's {limit} positions")
        if cache is None:
            cache = self.new_cache()
        sched = self.manifest.prefill
        step = len(ids) if sched.schedule == "single" else (sched.chunk_size or len(ids))
        logits = None
        for start, end in chunk_spans(ids, step, self.prefill_cuts):  # (cuts: the chunked schedule's only)
            logits = self.forward(cache, ids[start:end], last_only=True, start=offset + start if offset else None)
        assert logits is not None  # (ids is not empty: the loop ran)
        return cache, logits[-1]

    def greedy(
        self,
        cache,
        last_logits,
        n: int,
        stop_at_eos: bool = False,
        stop: list[str] | None = None,
        on_token: Callable[[list[int]], bool] | None = None,
        keep_logits: bool = True,
    ):
        """Greedy-decode ``n`` tokens after ``last_logits``. Returns (token ids, logits of each step [n, vocab]).
        Stops early at EOS (``stop_at_eos``) or once the decoded text contains one of ``stop``. ``on_token`` sees the
        ids so far after each token and stops the decode by returning True (a server's cancelled request), before
        the next forward; ``keep_logits`` False returns no step logits (a server's long decodes keep none).
        One :class:`~.decoding.Stream` decoded alone: what a batched step computes for each of its rows."""
        import torch

        s = self.stream(cache, n, stop_at_eos, stop, on_token, keep_logits)
        s.feed(last_logits)
        while not s.done:
            step(self, [s])
        stacked = torch.stack(s.logits) if s.logits else last_logits.new_zeros((0, last_logits.shape[-1]))
        return s.ids, stacked

    def stream(
        self,
        cache,
        n: int,
        stop_at_eos: bool = False,
        stop: list[str] | None = None,
        on_token: Callable[[list[int]], bool] | None = None,
        keep_logits: bool = False,
    ) -> Stream:
        """A greedy decode of up to ``n`` tokens on ``cache`` (:meth:`greedy`'s stops), to be fed the prompt's last
        logits and then stepped (decoding.step), alone or beside others."""
        return Stream(
            cache,
            n,
            eos=self.tokenizer.eos_token_id if stop_at_eos else None,
            stop=list(stop or ()),
            text=self.decode_text,
            on_token=on_token,
            keep_logits=keep_logits,
        )

    @property
    def batch_refusal(self) -> str | None:
        """None when this engine decodes several sequences in one step with each one's own bits (lean.check_step,
        run on this machine at the first call), else why it does not."""
        if self._batch_refusal is False:
            from .lean import check_step

            self._batch_refusal = check_step(self)
        return self._batch_refusal

    # -- cache state ----------------------------------------------------------------------------------------------
    def cache_buffers(self, tokens: int) -> tuple[int, int]:
        """(count, bytes) of the buffers a cache of ``tokens`` positions grows in on the CPU (growcache: keys and
        values of each full layer, with the slack it keeps, and the two a layer moving to larger buffers holds
        besides its own meanwhile): what a server reserves for one request. Read from a one-token forward's cache."""
        from .growcache import SLACK_TOKENS

        cache = self.new_cache()
        probe = self.tokenizer.bos_token_id
        self.forward(cache, [probe if probe is not None else 0], last_only=True)
        full = [st for st in self.capture(cache) if st.kind == "full"]
        if not full:
            return 0, 0
        k = full[0].keys
        return 2 * len(full) + 2, k.element_size() * k.numel() * (tokens + SLACK_TOKENS) // k.shape[-2]

    def capture(self, cache, start: int = 0) -> list[LayerState]:
        """The cache's complete state, layer by layer (references, not copies). With ``start`` > 0 (a chain link),
        full layers keep only positions ``start`` onwards; sliding layers keep their whole window state."""
        layers = [_capture_layer(i, layer) for i, layer in enumerate(cache.layers)]
        if start:
            for st in layers:
                if st.kind == "full":
                    st.keys, st.values = st.keys[:, :, start:], st.values[:, :, start:]
        return layers

    def restore_chain(self, chain: list, grow: bool = True) -> Any:
        """A fresh cache holding a chain of artifacts (root first): each full layer is the links' segments one
        after another, each sliding layer the last link's window state. The links must already be checked to
        follow each other (library.chain does). ``grow``: as :meth:`restore`."""
        import torch

        from .growcache import enabled, with_room

        if len(chain) == 1:
            return self.restore(chain[0].layers, grow)
        merged = []
        for i, last in enumerate(chain[-1].layers):
            if last.kind == "full":
                keys = [a.layers[i].keys for a in chain]
                values = [a.layers[i].values for a in chain]
                if grow and enabled(self.device):  # joined into buffers the cache then grows into (no second copy)
                    kb, vb, n = with_room(keys), with_room(values), sum(k.shape[-2] for k in keys)
                    merged.append(LayerState("full", kb[..., :n, :], vb[..., :n, :], room=(kb, vb)))
                else:
                    merged.append(LayerState("full", torch.cat(keys, dim=2), torch.cat(values, dim=2)))
            else:
                merged.append(last)
        return self.restore(merged, grow)

    def restore(self, layers: list[LayerState], grow: bool = True):
        """A fresh cache holding exactly ``layers``, on the engine's device. On the CPU the cache holds the artifact's
        own (verified, read-only by convention) tensors without a copy, and its full layers grow in place
        (growcache.GrowingLayer: the first update copies a layer into a buffer of its own, never writing into the
        artifact's tensors; tests/test_codecs.py checks that grafting leaves them unchanged), so many caches can
        start from one artifact held once in memory. A layer read with room (``LayerState.room``: a graft's own
        read) is taken instead: the cache writes its next tokens into that room, and the state gives it up (set to
        None), so a second cache restored from the same state copies as above and never shares the room.
        ``grow`` False keeps transformers' own layers (each update a new tensor): a cache for code outside kvgraft's
        inference mode, such as a user's own ``model.generate`` (api.Session.graft)."""
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        from .growcache import enabled, layer_class, take_room

        cache = self.new_cache(grow=False)
        if len(cache.layers) != len(layers):
            raise UnsupportedModel(f"cache has {len(cache.layers)} layers, artifact {len(layers)}")
        grow = grow and enabled(self.device)
        for i, (layer, st) in enumerate(zip(cache.layers, layers)):
            want = DynamicSlidingWindowLayer if st.kind == "sliding" else DynamicLayer
            if st.kind == "empty":
                continue
            if type(layer) is not want and not (st.kind == "full" and type(layer) is DynamicLayer):
                raise UnsupportedModel(
                    f"layer {i}: model builds {type(layer).__name__}, artifact holds a {st.kind} layer"
                )
            if grow and st.kind == "full":  # decode steps write in place instead of re-allocating the layer
                layer = cache.layers[i] = layer_class()()
                layer.kv_dtype = self.kv_dtype
                if st.room is not None:  # taken once; used only if it holds the layer (GrowingLayer's update checks)
                    take_room(layer, st.room)
                st.room = None
            keys = st.keys.to(self.device)
            values = st.values.to(self.device)
            if type(layer).lazy_initialization is DynamicLayer.lazy_initialization:
                # What it does (transformers 5.24, pinned) less its two empty tensors, replaced at once below
                layer.device, layer.is_initialized = keys.device, True
            else:
                layer.lazy_initialization(keys, values)
            # Set the state directly: `update` would re-trim a sliding layer and miscount its cumulative length.
            layer.keys, layer.values = keys, values
            if st.kind == "sliding":
                if layer.sliding_window != st.sliding_window:
                    raise UnsupportedModel(
                        f"layer {i}: sliding window {layer.sliding_window} != artifact's {st.sliding_window}"
                    )
                layer.cumulative_length = st.cumulative_length
        return cache

    def artifact_meta(self, logits_sha256: str, start: int = 0, parent: str | None = None) -> dict[str, str]:
        """The metadata every artifact made by this engine carries (layer layout is added by artifact.encode);
        a chain link also names its parent and starts at the parent chain's length."""
        import json

        m = self.manifest
        link = {"parent_sha256": parent} if parent is not None else {}
        # Named only when not the default, so a manifest without the key deposits the bytes it always did.
        scheme = m.artifact.identity
        named = {"identity": scheme} if scheme != "sha256" else {}
        return {
            **link,
            **named,
            "model_sha256": self.hashes.model_sha256,
            "tokenizer_sha256": self.hashes.tokenizer_sha256,
            "manifest_sha256": self.manifest.machine_compute_sha256,
            "dtype": m.model.dtype,
            "device": m.runtime.device,
            "prefill": json.dumps(m.prefill_pin, sort_keys=True, separators=(",", ":")),
            "start_position": str(start),
            "logits_sha256": logits_sha256,
            "logits_dtype": m.model.dtype,
            **({"kv_dtype": m.model.kv_dtype} if m.model.kv_dtype is not None else {}),
            # The CPU whose kernels computed the bits, where the manifest leaves them to the machine (native):
            # named so that a graft elsewhere is refused naming it (config.kernels). Absent under pinned kernels.
            **({"kernels": kernels} if (kernels := self.manifest.kernels) else {}),
        }

    def compatibility(self, start: int = 0) -> dict[str, str | None]:
        """What an artifact's metadata must equal to be grafted here (at ``start``: a chain link's position)."""
        import json

        return {
            "model_sha256": self.hashes.model_sha256,
            "tokenizer_sha256": self.hashes.tokenizer_sha256,
            "manifest_sha256": self.manifest.machine_compute_sha256,
            "dtype": self.manifest.model.dtype,
            "layer_types": json.dumps([k for k, _ in self.layout], separators=(",", ":"), sort_keys=True),
            "sliding_windows": json.dumps([w for _, w in self.layout], separators=(",", ":"), sort_keys=True),
            "start_position": str(start),
            # The tensors' width: absent on an artifact of a cache at the model's dtype (every one before the key)
            "kv_dtype": self.manifest.model.kv_dtype,
            # This machine's kernel identity (None under pinned kernels: an artifact made under them names none),
            # and the bare compute pin an artifact made before kernel identities were recorded carries
            "kernels": self.manifest.kernels,
            "compute_pin_sha256": self.manifest.compute_sha256,
        }


def _capture_layer(i: int, layer) -> LayerState:
    from transformers.cache_utils import DummyLayer, DynamicLayer, DynamicSlidingWindowLayer

    if type(layer) is DummyLayer:  # a KV-sharing consumer (Gemma-3n/4): reads another layer's KV, holds none
        return LayerState("empty")
    from .growcache import layer_class

    kind_of = {DynamicLayer: "full", layer_class(): "full", DynamicSlidingWindowLayer: "sliding"}
    kind = kind_of.get(type(layer))
    if kind is None:
        raise UnsupportedModel(
            f"cache layer {i} is a {type(layer).__name__}: kvgraft deposits full-attention and sliding-window "
            "layers only (linear/recurrent attention, quantized or offloaded caches hold other state)",
            "use a model whose cache is made of DynamicLayer / DynamicSlidingWindowLayer",
        )
    if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
        return LayerState("empty")
    if kind == "sliding":
        if layer.record_past:
            raise UnsupportedModel(f"cache layer {i} records past states; cannot capture it exactly")
        return LayerState("sliding", layer.keys, layer.values, layer.sliding_window, layer.cumulative_length)
    return LayerState("full", layer.keys, layer.values)


def pin_environment(manifest: Manifest) -> Drift:
    """Apply the manifest's environment variables. Call before anything imports torch (load_engine does it first
    unless given the Drift this returned, so a command may read artifacts between the two)."""
    return determinism.apply_environment(manifest.runtime.env, manifest.runtime.device)


def load_engine(manifest: Manifest, allow_drift: bool = False, drift: Drift | None = None) -> Engine:
    """Apply the manifest's pins, check the environment and model hash, load model and tokenizer from local files."""
    runtime = manifest.runtime
    if drift is None:
        drift = pin_environment(manifest)  # before torch is imported
    device = determinism.configure_torch(runtime, drift)
    from .gguf import materialize

    materialize(manifest)  # a GGUF: its dequantized checkpoint, converted once into the cache
    model_dir = manifest.model_dir
    hashes = hash_model_dir(model_dir)
    for key, have in (("sha256", hashes.model_sha256), ("tokenizer_sha256", hashes.tokenizer_sha256)):
        want = getattr(manifest.model, key)
        if have != want:
            drift.add(f"model.{key}", want, have)
    drift.enforce(allow_drift, manifest.source)
    check_model_type(model_dir)
    keep_freed_memory()  # a forward's temporaries reuse freed heap instead of faulting fresh pages in (util.memory)

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if manifest.model.attn_implementation == GROUPED:
        register_grouped()  # kvgraft's own kernel (engine.attention), known to transformers only once registered
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir),
        local_files_only=True,
        dtype=getattr(torch, manifest.model.dtype),
        attn_implementation=manifest.model.attn_implementation,
    )
    model = model.to(device)
    if manifest.model.weights == "q4":
        from .quantized import quantize_for_manifest

        quantize_for_manifest(model, manifest, drift, allow_drift)
    return engine_from_model(manifest, model, tokenizer, device, hashes, drift)


def engine_from_model(
    manifest: Manifest, model: Any, tokenizer: Any, device: Any, hashes: ModelHashes, drift: Drift
) -> Engine:
    """An Engine around a model already on ``device`` (pins applied, torch configured by
    determinism.configure_torch): records the environment in force and probes the cache layout. load_engine ends
    here, and so does a model built in memory rather than read from a checkpoint directory."""
    if manifest.model.attn_implementation == GROUPED:
        check_grouped(model.config)
    # Read by engine.attention and engine.lean: which code computes attention's products (model.attn_products)
    model.config.kvgraft_attn_products = manifest.model.attn_products
    model.eval()
    engine = Engine(manifest, model, tokenizer, device, hashes, drift, {})
    engine.environment = determinism.effective_environment(manifest.runtime, device)
    engine.layout = _probe_layout(engine)
    _check_kv_dtype(engine)
    engine.prefill_cuts  # noqa: B018  (prefill.cut_before checked against the tokenizer at load, not mid-run)
    from .lean import attach

    engine.environment["forward"] = "lean" if attach(engine) else "transformers"
    uses = manifest.model.weights == "q4" or manifest.model.attn_products == "aten"
    if uses and str(device).split(":")[0] == "cpu":
        # Which code ran the int4 product and attention's ATen products: the C kernels' vector path or ATen's kernels
        # (the same bits; ckernels.py)
        from .ckernels import status

        engine.environment["ckernels"] = status().path
    from .fingerprint import kernels_record

    engine.environment["kernels"] = kernels_record(engine)
    return engine


def cut_token_ids(tokenizer: Any, names: list[str]) -> list[int]:
    """The ids of prefill.cut_before's tokens; InputError naming one that is not exactly one token of ``tokenizer``."""
    ids = []
    for name in names:
        tid = tokenizer.convert_tokens_to_ids(name)
        if not isinstance(tid, int) or tid == tokenizer.unk_token_id or tokenizer.convert_ids_to_tokens(tid) != name:
            raise InputError(
                f"prefill.cut_before: {name!r} is not one token of this model's tokenizer",
                "name tokens as the tokenizer spells them, e.g. a chat template's turn start such as <|im_start|>",
            )
        ids.append(tid)
    return ids


def _check_kv_dtype(engine: Engine) -> None:
    """model.kv_dtype is kept by growcache's layers (the CPU's, KVGRAFT_GROW_IN_PLACE not 0) and for full-attention
    layers only: refuse, naming why, a run where some layer would keep the model's width instead."""
    from .growcache import enabled

    if engine.kv_dtype is None:
        return
    kinds = sorted({kind for kind, _ in engine.layout if kind not in ("full", "empty")})
    if kinds or not enabled(engine.device):
        raise UnsupportedModel(
            f"model.kv_dtype {engine.manifest.model.kv_dtype}: "
            + (
                f"this model's cache has {', '.join(kinds)} layers, kept at the model's width"
                if kinds
                else "the cache that keeps it grows on the CPU (KVGRAFT_GROW_IN_PLACE=0 turns it off)"
            ),
            "remove model.kv_dtype from the manifest" + ("" if kinds else ", or unset KVGRAFT_GROW_IN_PLACE"),
        )


def _probe_layout(engine: Engine) -> list[tuple[str, int | None]]:
    """Which layers hold KV and of what kind, read from a one-token forward (refuses unsupported cache layers, and
    a model whose forward rejects a DynamicCache, naming it)."""
    cache = engine.new_cache()
    probe = engine.tokenizer.bos_token_id
    try:
        engine.forward(cache, [probe if probe is not None else 0], last_only=True)
    except (ValueError, TypeError, AttributeError, NotImplementedError, KeyError, IndexError) as e:
        model_type = getattr(engine.model.config, "model_type", None) or "?"
        raise UnsupportedModel(
            f"model type {clip(model_type, 60)} ({type(engine.model).__name__}) fails a one-token forward on "
            f"kvgraft's DynamicCache: {type(e).__name__}: {clip(str(e))}",
            "kvgraft deposits models whose cache is made of DynamicLayer / DynamicSlidingWindowLayer (models with a "
            "cache class of their own, linear or recurrent attention, are not supported)",
        ) from None
    return [(st.kind, st.sliding_window) for st in engine.capture(cache)]


def check_model_type(model_dir) -> None:
    """Refuse, by config.json's model_type and before any weight loads, an architecture kvgraft cannot deposit."""
    import json
    from pathlib import Path

    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return  # the model load reports an unreadable config
    configs = [cfg, cfg.get("text_config")] if isinstance(cfg, dict) else []
    types = {c.get("model_type") for c in configs if isinstance(c, dict)}
    for t in sorted(x for x in types if isinstance(x, str)):
        if t in UNSUPPORTED_MODEL_TYPES:
            raise UnsupportedModel(
                f"{model_dir}: model type {t!r} is not supported: {UNSUPPORTED_MODEL_TYPES[t]}",
                "use a model whose cache is made of DynamicLayer / DynamicSlidingWindowLayer",
            )


def check_text_length(text: str, positions: int, where: str | None = None) -> None:
    """Refuse, before tokenizing, a text that cannot fit ``positions`` tokens even at CHARS_PER_TOKEN characters a
    token (config/modelhash.py documents the bound): a 50 MB text would otherwise take gigabytes to tokenize."""
    if len(text) > positions * CHARS_PER_TOKEN:
        raise InputError(
            f"{where or 'text'}: {len(text):,} characters cannot fit the model's {positions:,} positions "
            f"(kvgraft refuses texts over {CHARS_PER_TOKEN} characters a position: "
            f"{positions * CHARS_PER_TOKEN:,})",
            "shorten or split the text",
        )
