"""The own-position probe: what happens when an artifact is grafted at an offset K != 0 instead of its own position.

A deposited cache holds the prefix at positions 0..n-1. Grafting it after K other tokens needs its keys moved to
positions K..K+n-1. Rotary models make that look free: RoPE rotates each key by its position, rotations compose,
so rotating every cached key once more by K gives, in exact arithmetic, the keys computed at K. In floating point
it does not: ``rot(rot(k, p), K)`` rounds differently from ``rot(k, p + K)``, and the difference flows through every
later layer. The probe measures that, per offset, against computing the prefix directly at K:

- ``re-rotated``: the artifact's keys rotated by K with the model's own rotary embedding and ``apply_rotary_pos_emb``
  (values are position-free and kept), then the suffix at positions K+n...
- ``reference``: the prefix prefilled at positions K..K+n-1 by the manifest's schedule, then the same suffix.
- ``unmoved``: the artifact grafted as it is, the suffix at K+n... (what a shift without re-rotation gives).

Offset 0 is the artifact's own position: the rotation by 0 is the identity (cos 1, sin 0) and the comparison is
the graft's exactness claim. Every other offset is approximate; the report says by how much.

Learned absolute positions (GPT-2) have no such transformation: a position vector is added to each token's input
embedding and then flows non-linearly through every layer into K and V. Nothing done to cached tensors moves a
prefix; for those models the probe reports only ``unmoved`` against ``reference`` and says why.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import asdict, dataclass, field

from ..engine.engine import Engine, tensor_sha256, token_ids_sha256
from ..errors import InputError, UnsupportedModel
from ..ledger import entries
from ..ledger.entries import Digest, ProbeEntry
from ..util.hashing import sha256_bytes
from .context import RunContext, engine_facts
from .graft import Loaded, check_suffixes, compare_logits, fit_artifact

DEFAULT_OFFSETS = (0, 1, 2, 3, 8, 64, 512)

LEARNED_NOTE = (
    "learned absolute positions: a position vector is added to each token's input embedding and flows non-linearly "
    "through every layer into K and V, so no transformation of the cached tensors moves a prefix to another "
    "position. A graft is defined only at its own position (offset 0); the rows compare the unmoved cache with the "
    "prefix computed at offset K."
)
ROTARY_NOTE = (
    "rotary positions: keys re-rotated by K with the model's own rotary embedding equal the keys computed at K in "
    "exact arithmetic only; in floating point they round differently, so only offset 0 (the identity) is exact."
)


@dataclass
class OffsetResult:
    """One offset, aggregated over the suffixes: the moved graft against the prefix computed at that offset."""

    offset: int
    samples: int
    sha_equal: int  # suffixes whose logits are byte-identical
    max_abs_diff: float
    max_kl: float
    argmax_agreement: float  # lowest share over suffixes
    unmoved_max_abs_diff: float | None = None  # rotary models: the graft shifted without re-rotation
    unmoved_argmax_agreement: float | None = None

    @property
    def exact(self) -> bool:
        return self.sha_equal == self.samples


@dataclass
class ProbeReport:
    """The probe over all offsets for one artifact."""

    artifact: str
    prefix_tokens: int
    positions: str  # "rotary" or "learned"
    method: str  # what the moved graft is: "re-rotated keys" or "unmoved cache"
    note: str
    offsets: list[OffsetResult] = field(default_factory=list)
    ledger_seq: int | None = None

    @property
    def exact_offsets(self) -> list[int]:
        return [o.offset for o in self.offsets if o.exact]

    @property
    def own_position_unique(self) -> bool:
        """Offset 0 is exact and no other offset is (the claim the probe exists to show)."""
        return self.exact_offsets == [0]

    def to_json(self) -> dict:
        return {
            "artifact": self.artifact,
            "prefix_tokens": self.prefix_tokens,
            "positions": self.positions,
            "method": self.method,
            "note": self.note,
            "exact_offsets": self.exact_offsets,
            "own_position_unique": self.own_position_unique,
            "ledger_seq": self.ledger_seq,
            "offsets": [asdict(o) for o in self.offsets],
        }


# Configs that mark some layers as position-free (SmolLM3, Llama-4: ``no_rope_layers``) or cache a mixed
# rotary/non-rotary key (DeepSeek MLA: ``qk_rope_head_dim``): re-rotating every cached key would be wrong there.
_MIXED_ROPE_FIELDS = ("no_rope_layers", "qk_rope_head_dim")
_MIXED_ROPE_TYPES = ("cohere2",)  # full-attention layers without RoPE


def _decoder(engine: Engine):
    """The text decoder (multimodal wrappers such as Gemma-3/4 ForConditionalGeneration hold it inside)."""
    get = getattr(engine.model, "get_decoder", None)
    dec = get() if callable(get) else None
    return dec if dec is not None else engine.model.base_model


def positions_kind(engine: Engine) -> str:
    """``rotary`` (a rotary embedding on the decoder) or ``learned`` (a position table such as GPT-2's ``wpe``).

    Anything else (ALiBi, no positions, layouts where only some layers rotate) is refused: the probe would mislabel
    it.
    """
    dec = _decoder(engine)
    cfg = engine.model.config.get_text_config(decoder=True)
    mixed = [f for f in _MIXED_ROPE_FIELDS if getattr(cfg, f, None) is not None]
    if mixed or getattr(cfg, "model_type", None) in _MIXED_ROPE_TYPES:
        raise UnsupportedModel(
            f"{type(engine.model).__name__}: not every cached key is rotary "
            f"({', '.join(mixed) or cfg.model_type}); the probe re-rotates uniform RoPE layouts only"
        )
    if getattr(dec, "rotary_emb", None) is not None:
        return "rotary"
    if any(getattr(dec, name, None) is not None for name in ("wpe", "embed_positions")):
        return "learned"
    raise UnsupportedModel(
        f"{type(engine.model).__name__} has neither a rotary embedding nor a learned position "
        "table; the probe cannot tell how it encodes positions"
    )


def rerotate(engine: Engine, cache, offset: int) -> None:
    """Rotate every cached key by ``offset`` positions in place, with the model's own rotary embedding.

    Refuses a model without one, rope types whose cos/sin carry an attention scaling (YaRN, LongRoPE: a second
    application is not a pure rotation), and cos/sin that do not fit the cached keys.
    """
    import torch

    dec = _decoder(engine)
    rotary = getattr(dec, "rotary_emb", None)
    if rotary is None:
        raise UnsupportedModel(f"{type(engine.model).__name__} has no rotary embedding; its keys cannot be re-rotated")
    apply = getattr(sys.modules[type(dec).__module__], "apply_rotary_pos_emb", None)
    if apply is None:
        raise UnsupportedModel(f"{type(dec).__module__} has no apply_rotary_pos_emb to re-rotate keys with")
    takes_pair = list(inspect.signature(apply).parameters)[:2] == ["q", "k"]
    takes_layer_type = "layer_type" in inspect.signature(rotary.forward).parameters
    layer_types = getattr(engine.model.config.get_text_config(decoder=True), "layer_types", None)
    if takes_layer_type and not layer_types:
        raise UnsupportedModel(f"{type(rotary).__name__} needs a layer type, but the config has no layer_types")
    with torch.inference_mode():
        for i, layer in enumerate(cache.layers):
            held = getattr(layer, "keys", None)
            if held is None or held.numel() == 0:
                continue  # a KV-sharing layer (holds nothing) or an unused one
            # A 16-bit cache (model.kv_dtype) is rotated in the model's dtype and rounded once, as a fresh key is
            keys = held.to(engine.model.dtype)
            args = (layer_types[i],) if takes_layer_type and layer_types else ()  # (no layer_types: refused above)
            pos = torch.tensor([[0, offset]], device=keys.device)
            cos, sin = rotary(keys, pos, *args)
            if cos.shape[-1] > keys.shape[-1] or keys.shape[-1] % 2:
                raise UnsupportedModel(
                    f"layer {i}: rotary dimension {cos.shape[-1]} does not fit cached keys of "
                    f"dimension {keys.shape[-1]}"
                )
            if not (torch.all(cos[0, 0] == 1) and torch.all(sin[0, 0] == 0)):
                raise UnsupportedModel(
                    f"layer {i}: the rotary embedding at position 0 is not the identity "
                    "(scaled rope); re-rotating its keys would not be a pure rotation"
                )
            n = keys.shape[-2]
            cos_k, sin_k = cos[:, 1:].expand(1, n, -1), sin[:, 1:].expand(1, n, -1)
            moved = (
                apply(keys, keys, cos_k, sin_k, unsqueeze_dim=1)[1]
                if takes_pair
                else apply(keys, cos_k, sin_k, unsqueeze_dim=1)
            )
            layer.keys = moved.to(held.dtype).contiguous()


def probe(
    ctx: RunContext, engine: Engine, ref: Loaded | str | None, offsets: list[int], samples: int, on_offset=None
) -> ProbeReport:
    """Graft the artifact at each offset, compare with the prefix computed there; append a ``probe`` ledger entry."""

    if not offsets or any(k < 0 for k in offsets) or 0 not in offsets:
        raise InputError(
            "offsets must be non-negative integers and include 0 (the artifact's own position, the reference point)",
            "e.g. --offsets 0,1,8,64",
        )
    if samples < 1:
        raise InputError("the probe needs at least one sample")
    loaded = fit_artifact(ref, ctx, engine)
    art = loaded.artifact
    if art.parent is not None:
        raise InputError(
            f"{loaded.source}: a chain link (it continues {art.parent[:16]}...); the probe moves a "
            "whole prefix, so give it a root artifact"
        )
    prefix = art.token_ids
    if len(prefix) < 2:
        # Position 0's key is unrotated, so a one-token prefix re-rotates exactly at every offset: nothing to probe.
        raise InputError(f"{loaded.source}: the probe needs a prefix of at least 2 tokens, this one has {len(prefix)}")
    kind = positions_kind(engine)
    suffixes = [
        engine.encode(engine.prompts.question_text(t)) for t in check_suffixes(ctx.manifest.runtime.seed, samples)
    ]
    limit = engine.max_positions
    longest = len(prefix) + max(len(s) for s in suffixes)
    too_far = [k for k in offsets if limit and k + longest > limit]
    if too_far:
        assert limit  # too_far is empty without a limit
        hint = f"use offsets up to {limit - longest}" if limit > longest else "use a shorter prefix"
        raise InputError(
            f"offsets {too_far} put the prefix and suffix ({longest} tokens) past the model's {limit} positions", hint
        )
    report = ProbeReport(
        loaded.sha256,
        len(prefix),
        kind,
        "re-rotated keys" if kind == "rotary" else "unmoved cache",
        ROTARY_NOTE if kind == "rotary" else LEARNED_NOTE,
    )
    ref_hashes = []
    for k in sorted(set(offsets)):
        row = OffsetResult(k, len(suffixes), 0, 0.0, 0.0, 1.0)
        if kind == "rotary":
            row.unmoved_max_abs_diff, row.unmoved_argmax_agreement = 0.0, 1.0
        for suffix in suffixes:
            reference, _ = engine.prefill(prefix, offset=k)
            want = engine.forward(reference, suffix, start=k + len(prefix))
            ref_hashes.append(tensor_sha256(want))
            moved = engine.restore(art.layers)
            if kind == "rotary":
                rerotate(engine, moved, k)
                unmoved = engine.restore(art.layers)
                u = engine.forward(unmoved, suffix, start=k + len(prefix))
                assert row.unmoved_max_abs_diff is not None and row.unmoved_argmax_agreement is not None  # set above
                row.unmoved_max_abs_diff = max(row.unmoved_max_abs_diff, _max_abs(want, u))
                row.unmoved_argmax_agreement = min(row.unmoved_argmax_agreement, compare_logits(want, u)[1])
            got = engine.forward(moved, suffix, start=k + len(prefix))
            kl, agree = compare_logits(want, got)
            row.sha_equal += int(ref_hashes[-1] == tensor_sha256(got))  # bytes, not torch.equal (NaN, -0.0)
            row.max_abs_diff = max(row.max_abs_diff, _max_abs(want, got))
            row.max_kl = max(row.max_kl, kl)
            row.argmax_agreement = min(row.argmax_agreement, agree)
        report.offsets.append(row)
        if on_offset:
            on_offset(row)
    entry = ProbeEntry(
        manifest=ctx.manifest_ref(),
        **engine_facts(engine),
        artifact=Digest(loaded.sha256),
        offsets=sorted(set(offsets)),
        samples=samples,
        suffixes=Digest(sha256_bytes("\n".join(token_ids_sha256(s) for s in suffixes).encode())),
        reference_logits=Digest(sha256_bytes("\n".join(ref_hashes).encode())),
        result={k: v for k, v in report.to_json().items() if k not in ("artifact", "ledger_seq")},
    )
    report.ledger_seq = entries.write(ctx.ledger, entry).seq
    return report


def _max_abs(a, b) -> float:
    return float((a.double() - b.double()).abs().max().item())
