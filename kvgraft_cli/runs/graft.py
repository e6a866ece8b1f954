"""``kvgraft graft``: restore an artifact into a fresh cache at its own position and continue it; ``--check``
proves the restored cache gives byte-identical logits to a fresh computation under the same prefill schedule."""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..artifacts import format as kvg
from ..engine.engine import Engine, tensor_sha256, token_ids_sha256
from ..engine.growcache import room_for
from ..errors import InputError, KvgraftError, ModelMismatch
from ..ledger import entries
from ..ledger.entries import Digest, GraftCheckEntry, GraftEntry
from ..store.local import check_chain
from ..util.hashing import sha256_bytes
from .context import RunContext, engine_facts

# Query texts for --check samples; each sample also gets a seeded random tail so every suffix differs.
CHECK_QUERIES = (
    "What is the final answer?",
    "Check the last step of the solution.",
    "Explain the key idea in one sentence.",
    "Is there a shorter way?",
    "Which theorem was used?",
    "Restate the problem.",
    "What would change if the numbers doubled?",
    "Give the answer as a decimal.",
)
_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 +-=()^*/,.?"
# Tokens `graft --check` decodes per sample unless -n says otherwise: a budget of its own, not the manifest's
# decode.max_new_tokens, which is an answer budget (512 in a chat manifest, tens of minutes a sample on a real model).
# The check compares the logits of the suffix and of every decode step, fresh against grafted; 16 steps past the
# suffix already run the grafted cache through the decode path, growing it token by token. The ledger entry records
# the number used (inputs.max_new_tokens), and a replay decodes that many.
CHECK_MAX_NEW_TOKENS = 16


@dataclass
class Loaded:
    """An artifact read from the store (re-hashed) or from a file, and checked against the engine. A chain link
    comes with the links it continues: ``chain`` is root first and ends with ``artifact``."""

    sha256: str
    artifact: kvg.Artifact
    source: str
    chain: list[tuple[str, kvg.Artifact]] = field(default_factory=list)
    # How the identity was checked: "store" (read from the store under its identity, re-hashed), "file name" (a
    # .kvg file named <identity>.kvg, re-hashed), "store object" (a .kvg file under another name whose payload hash
    # the store also holds), "file" (a .kvg file under another name: the identity is the file's own payload hash,
    # checked against nothing recorded).
    identity: str = "store"

    def __post_init__(self) -> None:
        if not self.chain:
            self.chain = [(self.sha256, self.artifact)]

    @property
    def artifacts(self) -> list[kvg.Artifact]:
        return [a for _, a in self.chain]

    def release(self) -> None:
        """Drop this object's references to the artifacts' tensors (token ids and metadata stay), once a cache
        holds them: the cache is then their only owner. It grows into the room they were read with (open_artifact;
        on the CPU), or its first update copies each layer and frees the old one as it goes, so a graft's peak
        memory is one copy of the KV, not two. The artifacts themselves are left untouched (another holder, such as
        the verified LRU, keeps them whole)."""
        self.chain = [(sha, kvg.Artifact(a.token_ids, [], a.meta)) for sha, a in self.chain]
        self.artifact = self.chain[-1][1]

    @property
    def token_ids(self) -> list[int]:
        """Every token of the chain, root first: the prefix the grafted cache holds."""
        return [t for a in self.artifacts for t in a.token_ids]


def open_artifact(ctx: RunContext, ref: str | None) -> Loaded:
    """Resolve ``ref`` (hash, hash prefix, problem id, .kvg path, or None for the latest) and read it, re-hashed.
    Needs no engine, so a bad reference or a damaged file is reported before the model loads."""
    if ref is not None and ref.endswith(".kvg") and Path(ref).is_file():
        stem = Path(ref).name[: -len(".kvg")]
        expected = stem if re.fullmatch(r"[0-9a-f]{64}", stem) else None
        _refuse_past_positions(ctx, Path(ref), expected)
        sha, art = _open_file(ctx, Path(ref), expected)
        identity = "file name" if expected else _identity_in_store(ctx, sha)
        if art.parent is None:
            return Loaded(sha, art, ref, identity=identity)
        with ctx.open_store(create=False) as store:  # a link's parents come from the store
            parents = store.load_chain(art.parent, remember=False, device=ctx.manifest.runtime.device)
        chain = parents + [(sha, art)]
        check_chain(chain, ref)
        return Loaded(sha, art, ref, chain, identity=identity)
    with ctx.open_store(create=False) as store:
        sha = store.resolve(ref, ctx.manifest.machine_compute_sha256)
        # Not remembered: graft, probe and replay hold the Loaded artifact as long as they need it; a graft then
        # hands its tensors to the cache alone (Loaded.release), which grows into the room they were read with.
        device = ctx.manifest.runtime.device
        chain = store.load_chain(sha, remember=False, device=device, room=room_for(device))
        return Loaded(sha, chain[-1][1], str(store.object_path(sha)), chain)


def _refuse_past_positions(ctx: RunContext, path: Path, expected: str | None) -> None:
    """Refuse, from its header alone, a file whose tokens end past the model's positions (config.json, no model
    loaded), before its payload is read: a small file can declare gigabytes of cache (#24.9). A file from the
    store was checked when it was deposited or imported. A file named by its hash (``expected``) is judged against
    it (artifacts.verdict), so a damaged one exits 1 here as it does grafted by that hash."""
    from ..artifacts.inspect import read_info
    from ..artifacts.verdict import judged
    from ..config.modelhash import context_window

    limit = context_window(ctx.manifest.model_dir)
    if not limit:
        return
    with judged(path, expected):
        info = read_info(path)  # the header alone, checked as a graft checks it (layout.check_header)
        n, end = info.num_tokens, info.start_position + info.num_tokens
        if end > limit:
            raise ModelMismatch(
                f"{path}: its header declares {n:,} tokens, ending at position {end:,}, past the model's "
                f"{limit:,} positions",
                "graft an artifact deposited for this model and manifest",
            )


def _open_file(ctx: RunContext, path: Path, expected: str | None) -> tuple[str, kvg.Artifact]:
    """A .kvg file read for this run's device: on a GPU straight into device memory through pinned staging,
    verified on the way (artifacts.device_restore); on the CPU by kvg.open_file."""
    device = ctx.manifest.runtime.device
    if device == "cpu":
        return kvg.open_file(path, expected, room_for(device))
    from ..artifacts.device_restore import open_file_on_device

    return open_file_on_device(path, device, expected_sha256=expected)


def _identity_in_store(ctx: RunContext, sha: str) -> str:
    """For a .kvg file not named by its identity: "store object" when the store holds an object of the same
    payload hash (the file is a copy of a recorded artifact), else "file" (nothing recorded names it)."""
    try:
        with ctx.open_store(create=False) as store:
            return "store object" if store.has_object(sha) else "file"
    except KvgraftError:  # no store here: nothing to check it against
        return "file"


def fit_artifact(loaded: Loaded | str | None, ctx: RunContext, engine: Engine) -> Loaded:
    """Open the artifact if given a reference, then refuse it unless it fits the engine."""
    if not isinstance(loaded, Loaded):
        loaded = open_artifact(ctx, loaded)
    for sha, art in loaded.chain:
        kvg.check_compatible(
            art.meta,
            engine.compatibility(art.start),
            f"{loaded.source} (link {sha[:16]}...)" if len(loaded.chain) > 1 else loaded.source,
        )
    return loaded


def prefill_chain(engine: Engine, chain: list[kvg.Artifact]):
    """The fresh side of a chain: each link's tokens prefilled on the cache of the links before it, by the
    manifest's schedule, exactly as the links were deposited. Returns (cache, last-position logits)."""
    cache = last = None
    for art in chain:
        cache, last = engine.prefill(art.token_ids, cache=cache)
    return cache, last


@dataclass
class GraftResult:
    """A graft-and-continue run."""

    artifact: str
    prefix_tokens: int
    query: str
    generated_ids: list[int]
    text: str
    ledger_seq: int
    identity: str = "store"  # how its identity was checked (Loaded.identity); "file": against nothing recorded


def graft_generate(
    ctx: RunContext, engine: Engine, ref: Loaded | str | None, query: str, max_new_tokens: int
) -> GraftResult:
    """Restore the artifact, run the rendered query, greedy-decode up to ``max_new_tokens`` (stops at EOS)."""
    loaded = fit_artifact(ref, ctx, engine)
    suffix = engine.encode(engine.prompts.question_text(query), where="--query")
    limit = engine.max_positions
    if limit and len(loaded.token_ids) + len(suffix) > limit:
        raise InputError(
            f"--query: {len(loaded.token_ids):,} prefix tokens + {len(suffix):,} query tokens exceed the "
            f"model's {limit:,} positions",
            "shorten the query",
        )
    cache = engine.restore_chain(loaded.artifacts)
    loaded.release()
    logits = engine.forward(cache, suffix)
    gen, steps = engine.greedy(cache, logits[-1], max_new_tokens, stop_at_eos=True)
    entry = GraftEntry(
        manifest=ctx.manifest_ref(),
        **engine_facts(engine),
        artifact=Digest(loaded.sha256),
        chain=_chain_input(loaded),
        suffix_ids=Digest.of(token_ids_sha256(suffix), count=len(suffix)),
        suffix_logits=Digest(tensor_sha256(logits)),
        generated_ids=Digest.of(token_ids_sha256(gen), ids=gen),
        decode_logits=Digest(tensor_sha256(steps)),
    )
    written = entries.write(ctx.ledger, entry)
    return GraftResult(
        loaded.sha256, len(loaded.token_ids), query, gen, engine.decode_text(gen), written.line_seq, loaded.identity
    )


@dataclass
class SampleResult:
    """One suffix, computed fresh and after a graft."""

    index: int
    suffix_tokens: int
    sha_equal: bool
    fresh_sha256: str
    graft_sha256: str
    max_kl: float
    argmax_agreement: float
    generated_equal: bool


@dataclass
class CheckReport:
    """Graft-vs-fresh comparison over N suffixes."""

    artifact: str
    prefix_tokens: int
    schedule: dict
    deposit_reproduced: bool  # a fresh prefill here gives the artifact's exact bytes
    logits_reproduced: bool  # ... and the recorded last-position logits hash
    single_pass_max_abs_diff: float  # fresh two-step vs one forward over prefix+suffix (informative, not a check)
    single_pass_sha_equal: bool = False  # ... the same bytes (the invariant schedule's promise)
    batched_max_abs_diff: float | None = None  # invariant schedule: vs one batched call of the model's own kernels
    samples: list[SampleResult] = field(default_factory=list)
    ledger_seq: int | None = None
    fresh_logits_sha256: str = ""  # SHA-256 over the per-sample fresh logits hashes (what a replay compares)
    identity: str = "store"  # how the artifact's identity was checked (Loaded.identity); not in the ledger entry

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def sha_equal(self) -> int:
        return sum(s.sha_equal for s in self.samples)

    @property
    def max_kl(self) -> float:
        return max((s.max_kl for s in self.samples), default=0.0)

    @property
    def argmax_agreement(self) -> float:
        return min((s.argmax_agreement for s in self.samples), default=1.0)

    @property
    def passed(self) -> bool:
        # Under the invariant schedule the single forward over prefix+suffix is promised byte-equal too.
        single = self.single_pass_sha_equal or self.schedule.get("schedule") != "invariant"
        return (
            self.deposit_reproduced
            and self.logits_reproduced
            and self.sha_equal == self.n
            and all(s.generated_equal for s in self.samples)
            and self.max_kl == 0.0
            and single
        )

    def summary(self) -> dict:
        return {
            "artifact": self.artifact,
            "prefix_tokens": self.prefix_tokens,
            "schedule": self.schedule,
            "samples": self.n,
            "sha_equal": self.sha_equal,
            "max_kl": self.max_kl,
            "argmax_agreement": self.argmax_agreement,
            "generated_equal": sum(s.generated_equal for s in self.samples),
            "deposit_reproduced": self.deposit_reproduced,
            "logits_reproduced": self.logits_reproduced,
            "single_pass_max_abs_diff": self.single_pass_max_abs_diff,
            "passed": self.passed,
            "ledger_seq": self.ledger_seq,
        }

    def to_json(self) -> dict:
        # The single-pass bytes check and the batched comparison are reported, not recorded in the ledger entry
        # (its result keeps the fields earlier entries have).
        return {
            **self.summary(),
            "identity": self.identity,
            "fresh_logits_sha256": self.fresh_logits_sha256,
            "single_pass_sha_equal": self.single_pass_sha_equal,
            "batched_max_abs_diff": self.batched_max_abs_diff,
            "per_sample": [asdict(s) for s in self.samples],
        }


def max_abs_diff(a, b) -> float:
    """Largest |a - b| over two logits tensors, in float64."""
    return float((a.double() - b.double()).abs().max().item())


def check_suffixes(seed: int, n: int) -> list[str]:
    """N different query texts, the same for a given seed on every machine."""
    out = []
    for i in range(n):
        rng = random.Random(f"kvgraft-check:{seed}:{i}")
        tail = "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(1, 24)))
        out.append(f"{CHECK_QUERIES[i % len(CHECK_QUERIES)]} {tail}")
    return out


def compare_logits(fresh, grafted) -> tuple[float, float]:
    """(largest KL(fresh || graft) over positions, computed in float64; share of positions with equal argmax)."""
    import torch

    if fresh.numel() == 0:
        return 0.0, 1.0
    lp = torch.log_softmax(fresh.double(), dim=-1)
    lq = torch.log_softmax(grafted.double(), dim=-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    agree = (fresh.argmax(-1) == grafted.argmax(-1)).double().mean().item()
    return float(kl.max().item()), agree


def graft_check(
    ctx: RunContext,
    engine: Engine,
    ref: Loaded | str | None,
    samples: int,
    max_new_tokens: int = CHECK_MAX_NEW_TOKENS,
    on_sample=None,
) -> CheckReport:
    """Compare graft against fresh computation for ``samples`` suffixes, each followed by ``max_new_tokens`` greedy
    decode steps (default :data:`CHECK_MAX_NEW_TOKENS`, not the manifest's answer budget); append a ``graft-check``
    ledger entry recording that number."""
    import torch

    loaded = fit_artifact(ref, ctx, engine)
    art, links = loaded.artifact, loaded.artifacts
    prefix = loaded.token_ids
    fresh_cache, last = prefill_chain(engine, links)
    reproduced_payload = kvg.encode(
        art.token_ids,
        engine.capture(fresh_cache, art.start),
        engine.artifact_meta(tensor_sha256(last), art.start, art.parent),
    )
    report = CheckReport(
        loaded.sha256,
        len(prefix),
        ctx.manifest.prefill.as_written(),
        deposit_reproduced=kvg.same_cache(reproduced_payload, loaded.sha256),
        logits_reproduced=tensor_sha256(last) == art.meta["logits_sha256"],
        single_pass_max_abs_diff=0.0,
        identity=loaded.identity,
    )
    del fresh_cache, reproduced_payload
    fresh_hashes, suffix_hashes = [], []
    for i, text in enumerate(check_suffixes(ctx.manifest.runtime.seed, samples)):
        suffix = engine.encode(engine.prompts.question_text(text))
        # Fresh: prefill the prefix from scratch by the manifest's schedule (a chain: link by link, each on the
        # cache of the ones before, as it was deposited), then the suffix, then decode.
        cache_f, _ = prefill_chain(engine, links)
        logits_f = engine.forward(cache_f, suffix)
        gen_f, steps_f = engine.greedy(cache_f, logits_f[-1], max_new_tokens)
        # Graft: a fresh cache filled from the artifact, then the same suffix and decode.
        cache_g = engine.restore_chain(links)
        logits_g = engine.forward(cache_g, suffix)
        gen_g, steps_g = engine.greedy(cache_g, logits_g[-1], max_new_tokens)
        all_f, all_g = torch.cat([logits_f, steps_f]), torch.cat([logits_g, steps_g])
        kl, agree = compare_logits(all_f, all_g)
        sf, sg = tensor_sha256(all_f), tensor_sha256(all_g)
        if i == 0:
            one = engine.single_pass(prefix + suffix, len(suffix))
            report.single_pass_max_abs_diff = max_abs_diff(one, logits_f)
            report.single_pass_sha_equal = tensor_sha256(one) == tensor_sha256(logits_f)
            if engine.invariant:
                report.batched_max_abs_diff = max_abs_diff(engine.batched_pass(prefix + suffix, len(suffix)), logits_f)
        # Equal means equal bytes (torch.equal would call identical NaNs unequal and -0.0 equal to 0.0).
        s = SampleResult(i, len(suffix), sf == sg, sf, sg, kl, agree, gen_f == gen_g)
        report.samples.append(s)
        fresh_hashes.append(sf)
        suffix_hashes.append(token_ids_sha256(suffix))
        if on_sample:
            on_sample(s)
    report.fresh_logits_sha256 = sha256_bytes("\n".join(fresh_hashes).encode())
    entry = GraftCheckEntry(
        manifest=ctx.manifest_ref(),
        **engine_facts(engine),
        artifact=Digest(loaded.sha256),
        chain=_chain_input(loaded),
        samples=samples,
        max_new_tokens=max_new_tokens,
        suffixes=Digest(sha256_bytes("\n".join(suffix_hashes).encode())),
        fresh_logits=Digest(report.fresh_logits_sha256),
        result={k: v for k, v in report.summary().items() if k not in ("artifact", "ledger_seq")},
    )
    report.ledger_seq = entries.write(ctx.ledger, entry).line_seq
    return report


def _chain_input(loaded: Loaded) -> list[str] | None:
    """For a chain link: the links it continues, root first (a root artifact records nothing extra)."""
    if len(loaded.chain) == 1:
        return None
    return [sha for sha, _ in loaded.chain]
