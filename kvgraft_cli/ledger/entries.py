"""Ledger entries, typed: one frozen class per kind, each with ``to_json`` (the body a writer appends) and
``from_json`` (what a reader gets back, or :class:`EntryError` naming the field that is not what the kind records).

Every command that writes a line builds one of these; every reader (the verifier, replay, the report, ``ledger
log``, bundles) parses lines into them. The line's bytes are what they always were: each class says where each field
lives (the entry's top level, ``inputs`` or ``outputs``) under the name it always had, and members a class does not
model (a newer kvgraft's, say) are kept in ``extra`` and written back, so ``from_json(d).to_json() == d`` for every
line kvgraft writes (tests/test_ledger_entries.py checks it on the reference ledger and on a ledger of every kind).

No torch, no engine: the torch-free verifier (audit/) reads ledgers through these types too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, ClassVar, TypeVar

from ..errors import LedgerError
from . import kinds
from . import log as ledger_log

INPUTS, OUTPUTS, TOP = "inputs", "outputs", ""
WRITTEN = ("seq", "prev", "kind", "time")  # what the append adds (ledger.log.append)


class EntryError(LedgerError):
    """A ledger line whose fields are not what its kind records (a missing or mistyped field, named)."""


def _kind_name(value: Any) -> str:
    return {str: "a string", int: "an integer", bool: "a boolean", dict: "an object", list: "an array"}.get(
        value, getattr(value, "WHAT", str(value))
    )


@dataclass(frozen=True)
class Digest:
    """A self-describing digest, as the ledger records every input and output: ``sha256``, the ``path`` of the file
    it hashes where there is one, and the facts beside it a kind records (``count``, ``id``, ``line``, ``dtype``...)."""

    WHAT: ClassVar[str] = "a digest (an object with a sha256 string)"

    sha256: str
    path: str | None = None
    facts: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, sha256: str, path: str | None = None, **facts: Any) -> Digest:
        return cls(sha256, path, facts)

    def get(self, name: str, default: Any = None) -> Any:
        """A fact recorded beside the hash (``path`` and ``sha256`` included)."""
        if name in ("sha256", "path"):
            return getattr(self, name)
        return self.facts.get(name, default)

    def to_json(self) -> dict[str, Any]:
        return {"sha256": self.sha256, **({"path": self.path} if self.path is not None else {}), **self.facts}

    @classmethod
    def from_json(cls, value: Any, where: str) -> Digest:
        if not isinstance(value, dict) or not isinstance(value.get("sha256"), str):
            raise EntryError(f"{where} is not a digest (an object with a sha256 string)")
        path = value.get("path")
        if path is not None and not isinstance(path, str):
            raise EntryError(f"{where}.path is not a string")
        # (a "path": null stays a fact, so the line reads back as it was)
        facts = {k: v for k, v in value.items() if k != "sha256" and not (k == "path" and path is not None)}
        return cls(value["sha256"], path, facts)


@dataclass(frozen=True)
class ManifestRef:
    """The manifest a run used: where it came from, its file's hash, its compute pin, and the path verify re-hashes
    (absent for the built-in manifests); ``more``: members a newer kvgraft writes, kept."""

    WHAT: ClassVar[str] = "a manifest reference (source, sha256, compute_sha256)"

    source: str
    sha256: str
    compute_sha256: str
    path: str | None = None
    more: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = {"source": self.source, "sha256": self.sha256, "compute_sha256": self.compute_sha256}
        return out | ({"path": self.path} if self.path is not None else {}) | dict(self.more)

    @classmethod
    def from_json(cls, value: Any, where: str) -> ManifestRef:
        if not isinstance(value, dict):
            raise EntryError(f"{where} is not an object")
        for k in ("source", "sha256", "compute_sha256"):
            if not isinstance(value.get(k), str):
                raise EntryError(f"{where}.{k} is not a string")
        path = value.get("path")
        if path is not None and not isinstance(path, str):
            raise EntryError(f"{where}.path is not a string")
        known = {"source", "sha256", "compute_sha256"} | ({"path"} if path is not None else set())
        more = {k: v for k, v in value.items() if k not in known}
        return cls(value["source"], value["sha256"], value["compute_sha256"], path, more)


VERDICT = ("reason", "extracted", "reference")


@dataclass(frozen=True)
class Verification:
    """How a deposited solution was judged: ``status`` (``verified`` or not) and the facts beside it, as recorded:
    ``reason``, ``extracted`` and ``reference`` (the answer it was checked against), and any member a newer kvgraft
    writes."""

    WHAT: ClassVar[str] = "a verification (an object with a status string)"

    status: str
    facts: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(
        cls, status: str, reason: str | None = None, extracted: str | None = None, reference: str | None = None
    ) -> Verification:
        """The verification a deposit writes: every one of its facts, null where there is none."""
        return cls(status, {"reason": reason, "extracted": extracted, "reference": reference})

    @property
    def reason(self) -> Any:
        return self.facts.get("reason")

    @property
    def extracted(self) -> Any:
        return self.facts.get("extracted")

    @property
    def reference(self) -> Any:
        return self.facts.get("reference")

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, **self.facts}

    @classmethod
    def from_json(cls, value: Any, where: str) -> Verification:
        if not isinstance(value, dict) or not isinstance(value.get("status"), str):
            raise EntryError(f"{where} is not an object with a status string")
        return cls(value["status"], {k: v for k, v in value.items() if k != "status"})


def _at(place: str, typ: Any, optional: bool = False) -> Any:
    """A field of an entry: where it lives (TOP, INPUTS or OUTPUTS), what it holds (a JSON type, or a class with
    ``from_json``; a tuple: any of them, None for null), and whether a line may lack it (then None, left out)."""
    meta = {"at": place, "as": typ, "optional": optional}
    return field(default=None, metadata=meta) if optional else field(default=MISSING, metadata=meta)


def inp(typ: Any, optional: bool = False) -> Any:
    return _at(INPUTS, typ, optional)


def out(typ: Any, optional: bool = False) -> Any:
    return _at(OUTPUTS, typ, optional)


def top(typ: Any, optional: bool = False) -> Any:
    return _at(TOP, typ, optional)


def _dump(value: Any) -> Any:
    return value.to_json() if hasattr(value, "to_json") else value


def _load(typ: Any, value: Any, where: str) -> Any:
    options = typ if isinstance(typ, tuple) else (typ,)
    for t in options:
        if t is None and value is None:
            return None
        if t is Any:
            return value
        if hasattr(t, "from_json") and isinstance(value, dict):
            return t.from_json(value, where)
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t in (str, bool, dict, list) and isinstance(value, t):
            return value
    wanted = " or ".join("null" if t is None else _kind_name(t) for t in options)
    raise EntryError(f"{where} is not {wanted}")


E = TypeVar("E", bound="Entry")


@dataclass(frozen=True, kw_only=True)
class Entry:
    """What every entry carries: the manifest and, for runs with an engine, its environment, model and drift; once
    written, ``seq``, ``prev`` and ``time``. Subclasses add their kind's fields; ``extra`` keeps members no class
    models ({place: {name: value}}), so a line reads back to its own bytes."""

    KIND: ClassVar[str] = ""

    manifest: ManifestRef | None = top(ManifestRef, optional=True)
    environment: dict | None = top(dict, optional=True)
    model: Digest | None = top(Digest, optional=True)  # the model hash; tokenizer_sha256 beside it
    drift: list | None = top(list, optional=True)
    seq: int | None = None
    prev: str | None = None
    time: str | None = None
    extra: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.KIND

    @property
    def line_seq(self) -> int:
        """The seq of an entry read from a ledger or just written to one (LedgerError for one not written)."""
        if self.seq is None:
            raise LedgerError(f"a {self.kind} entry not written to a ledger has no seq")
        return self.seq

    @property
    def lineno(self) -> int:
        """The line's 1-based number in its ledger (0 for an entry not written yet)."""
        return self.seq + 1 if self.seq is not None else 0

    @classmethod
    def _places(cls) -> set[str]:
        return {f.metadata["at"] for f in fields(cls) if "at" in f.metadata}

    def to_json(self) -> dict[str, Any]:
        """The line's JSON object (the body to append, or the whole line once written: seq, prev, kind, time)."""
        parts: dict[str, dict[str, Any]] = {TOP: {}, INPUTS: {}, OUTPUTS: {}}
        for f in fields(self):
            if "at" not in f.metadata:
                continue
            value = getattr(self, f.name)
            if value is None and f.metadata["optional"]:
                continue
            parts[f.metadata["at"]][f.name] = _dump(value)
        body = parts[TOP]
        places = self._places()
        required = {f.metadata["at"] for f in fields(self) if "at" in f.metadata and not f.metadata["optional"]}
        for place in (INPUTS, OUTPUTS):
            members = parts[place] | dict(self.extra.get(place, {}))
            # (a place whose every field is optional is written when it holds something: a line without it reads
            # back without it)
            if place in places and (members or place in required):
                body[place] = members
        body.update(self.extra.get(TOP, {}))
        if self.seq is not None:
            body.update(seq=self.seq, prev=self.prev, kind=self.kind, time=self.time)
        return body

    @classmethod
    def from_json(cls: type[E], value: Any, where: str = "entry") -> E:
        """The entry a line holds, or EntryError naming the first field that is not what this kind records."""
        if not isinstance(value, dict):
            raise EntryError(f"{where} is not a JSON object")
        places = cls._places()
        src: dict[str, dict[str, Any]] = {TOP: value}
        for place in (INPUTS, OUTPUTS):
            if place in places:
                got = value.get(place, {})
                if not isinstance(got, dict):
                    raise EntryError(f"{where}: {place} is not an object")
                src[place] = got
        kwargs: dict[str, Any] = {}
        used: dict[str, set[str]] = {TOP: set(WRITTEN) | (places - {TOP}), INPUTS: set(), OUTPUTS: set()}
        for f in fields(cls):
            if "at" not in f.metadata:
                continue
            place = f.metadata["at"]
            name = f"{place}.{f.name}" if place else f.name
            if f.name not in src[place]:
                if f.metadata["optional"]:
                    continue
                raise EntryError(f"{where}: a {cls.KIND or value.get('kind')} entry without {name}")
            kwargs[f.name] = _load(f.metadata["as"], src[place][f.name], f"{where}: {name}")
            used[place].add(f.name)
        # seq, prev, kind and time: the written line's, when it has all four as the append writes them; else
        # whatever of them it has is kept as it is (a line of another writer, read back to its own bytes)
        seq, prev, time = value.get("seq"), value.get("prev"), value.get("time")
        whole = (
            type(seq) is int
            and (prev is None or isinstance(prev, str))
            and isinstance(time, str)
            and all(k in value for k in WRITTEN)
        )
        if not whole:
            used[TOP] -= set(WRITTEN)
        extra = {p: rest for p, d in src.items() if (rest := {k: v for k, v in d.items() if k not in used[p]})}
        written = {"seq": seq, "prev": prev, "time": time} if whole else {}
        return cls._make(value, kwargs, extra, written, where)

    @classmethod
    def _make(cls: type[E], value: dict, kwargs: dict, extra: dict, written: dict, where: str) -> E:
        return cls(**kwargs, **written, extra=extra)

    def written_as(self: E, seq: int, prev: str | None, time: str) -> E:
        return replace(self, seq=seq, prev=prev, time=time)

    # The digests `ledger log` shows: what a reader copies to look further (an artifact to inspect or graft, a
    # records or outputs file to check, a prereg to replay).
    SHOWN: ClassVar[tuple[str, ...]] = ()

    def shown_digests(self) -> dict[str, str]:
        """name -> sha256 of the digests :attr:`SHOWN` names (for a kind no class models: every output digest)."""
        if not self.SHOWN:
            outs = self.extra.get(TOP, {}).get(OUTPUTS)
            members = outs.items() if isinstance(outs, dict) else ()
            return {k: d["sha256"] for k, d in members if isinstance(d, dict) and isinstance(d.get("sha256"), str)}
        return {k: d.sha256 for k in self.SHOWN if isinstance(d := getattr(self, k, None), Digest)}

    def summary(self) -> str:
        """One phrase saying what the entry did (``ledger log``'s "what" column)."""
        return ""


@dataclass(frozen=True, kw_only=True)
class OtherEntry(Entry):
    """A line of a kind no class here models (a test's, a newer kvgraft's): everything but the common part in
    ``extra``."""

    other_kind: Any = ""  # as the line holds it (a hostile line's may be no string)

    @property
    def kind(self) -> Any:
        return self.other_kind

    @classmethod
    def _make(cls, value: dict, kwargs: dict, extra: dict, written: dict, where: str) -> OtherEntry:
        return cls(**kwargs, **written, extra=extra, other_kind=value.get("kind"))


# -- the kinds (kinds.py names them; the schema says which fields each must carry) --------------------------------


@dataclass(frozen=True, kw_only=True)
class DepositEntry(Entry):
    """A problem's prefix prefilled, stored and recorded (``kvgraft deposit``, ``solve --deposit-verified``)."""

    KIND = kinds.DEPOSIT
    problems_file: Digest = inp(Digest)
    record: Digest = inp(Digest)  # the problem's line: id, line
    token_ids: Digest = inp(Digest)  # the prefix: count
    settings: dict | None = inp(dict, optional=True)
    artifact: Digest = out(Digest)  # path, payload_bytes (absent when the store already held it)
    logits: Digest = out(Digest)  # dtype, position
    verification: Verification = top(Verification)
    status: str | None = top(str, optional=True)  # deposited | existing: decided under the append lock

    SHOWN = ("artifact", "logits")

    def summary(self) -> str:
        verified = f", {self.verification.status}" if self.verification.status else ""
        return f"{self.record.get('id')}: {self.status or ''}{verified}"


@dataclass(frozen=True, kw_only=True)
class GraftEntry(Entry):
    """An artifact (or chain) restored and decoded after (``kvgraft graft``)."""

    KIND = kinds.GRAFT
    artifact: Digest = inp(Digest)
    chain: list | None = inp(list, optional=True)  # a chain link's links, root first
    suffix_ids: Digest = inp(Digest)
    suffix_logits: Digest = out(Digest)
    generated_ids: Digest = out(Digest)  # ids
    decode_logits: Digest = out(Digest)

    SHOWN = ("artifact", "generated_ids")

    def summary(self) -> str:
        ids = self.generated_ids.get("ids")
        return f"{len(ids)} tokens generated" if isinstance(ids, list) else ""


@dataclass(frozen=True, kw_only=True)
class GraftCheckEntry(Entry):
    """Graft against fresh, byte for byte (``kvgraft graft --check``)."""

    KIND = kinds.GRAFT_CHECK
    artifact: Digest = inp(Digest)
    chain: list | None = inp(list, optional=True)
    samples: int = inp(int)
    max_new_tokens: int = inp(int)
    suffixes: Digest = inp(Digest)
    fresh_logits: Digest = out(Digest)
    result: dict = out(dict)

    SHOWN = ("artifact", "fresh_logits")

    def summary(self) -> str:
        r = self.result
        return (
            f"{'PASS' if r.get('passed') else 'FAIL'} {r.get('sha_equal')}/{r.get('samples')} SHA-equal, "
            f"{r.get('prefix_tokens')} prefix tokens"
        )


@dataclass(frozen=True, kw_only=True)
class ProbeEntry(Entry):
    """An artifact grafted at other positions (``kvgraft probe``)."""

    KIND = kinds.PROBE
    artifact: Digest = inp(Digest)
    offsets: list = inp(list)
    samples: int = inp(int)
    suffixes: Digest = inp(Digest)
    reference_logits: Digest = out(Digest)
    result: dict = out(dict)

    SHOWN = ("artifact", "reference_logits")

    def summary(self) -> str:
        return f"exact offsets {self.result['exact_offsets']}" if "exact_offsets" in self.result else ""


@dataclass(frozen=True, kw_only=True)
class ScoreEntry(Entry):
    """An outputs file graded (``kvgraft score``): the files, the settings that decide the grade, the result."""

    KIND = kinds.SCORE
    outputs: Digest | None = inp(Digest, optional=True)
    answers: Digest | None = inp(Digest, optional=True)
    settings: dict | None = inp(dict, optional=True)
    records: Digest | None = out(Digest, optional=True)
    result: dict | None = out(dict, optional=True)

    SHOWN = ("records",)

    def summary(self) -> str:
        r = self.result or {}
        n = r.get("n", r.get("problems"))
        return f"{r.get('correct')}/{n} correct" if n is not None else ""


@dataclass(frozen=True, kw_only=True)
class SolveEntry(Entry):
    """One problem answered, with or without the library (``kvgraft solve``)."""

    KIND = kinds.SOLVE
    problems_file: Digest = inp(Digest)
    record: Digest = inp(Digest)  # id, line
    query_ids: Digest = inp(Digest)  # count
    library: dict = inp(dict)  # hit, artifacts, chain, scores, new_links
    settings: dict = inp(dict)
    query_logits: Digest = out(Digest)
    generated_ids: Digest = out(Digest)  # count
    output: Digest = out(Digest)
    costs: dict = out(dict)

    SHOWN = ("output", "generated_ids")

    def summary(self) -> str:
        return f"{self.record.get('id')}: {self.library.get('hit')} hit, {self.generated_ids.get('count')} tokens"


@dataclass(frozen=True, kw_only=True)
class SolveOutputsEntry(Entry):
    """A solve run's outputs file, once every problem is recorded."""

    KIND = kinds.SOLVE_OUTPUTS
    problems_file: Digest = inp(Digest)
    settings: dict = inp(dict)
    outputs: Digest = out(Digest)
    totals: dict = out(dict)
    mode: str = top(str)  # library | baseline

    SHOWN = ("outputs",)

    def summary(self) -> str:
        t = self.totals
        return f"{self.mode}: {t.get('correct')}/{t.get('scored')} correct of {t.get('problems')} problems"


@dataclass(frozen=True, kw_only=True)
class ServeEntry(Entry):
    """One request ``kvgraft serve`` answered."""

    KIND = kinds.SERVE
    request: Digest = inp(Digest)  # endpoint, log, tenant
    prompt_ids: Digest = inp(Digest)  # count
    library: dict = inp(dict)  # hit, artifacts, chain
    prompt_cache: dict = inp(dict)  # store, chunk, chunks, deposited, refused
    settings: dict = inp(dict)
    first_logits: Digest | None = out(Digest, optional=True)  # absent when nothing was decoded
    generated_ids: Digest = out(Digest)
    output: Digest = out(Digest)
    finish_reason: str = out(str)
    costs: dict = out(dict)

    SHOWN = ("first_logits", "generated_ids", "output")

    def summary(self) -> str:
        return f"{self.library.get('hit')} hit, {self.generated_ids.get('count')} tokens, {self.finish_reason}"


@dataclass(frozen=True, kw_only=True)
class RegisterEntry(Entry):
    """A pre-registration's hash, before anything ran (``kvgraft replay --register``)."""

    KIND = kinds.REGISTER
    prereg: Digest = inp(Digest)
    name: str = inp(str)
    runs: list = inp(list)
    targets: list = inp(list)

    SHOWN = ("prereg",)

    def summary(self) -> str:
        return f"prereg {self.name} ({self.prereg.path})"


@dataclass(frozen=True, kw_only=True)
class ReplayEntry(Entry):
    """A pre-registration replayed and compared (``kvgraft replay``)."""

    KIND = kinds.REPLAY
    prereg: Digest = inp(Digest)
    target: str = inp(str)
    registration: Digest = inp(Digest)  # seq
    passed: bool = out(bool)
    matched: int = out(int)
    mismatched: int = out(int)
    comparisons: list = out(list)
    kernels: str | None = out(str, optional=True)  # "computed on other kernels (X here, Y there)", when they differ

    SHOWN = ("prereg",)

    def summary(self) -> str:
        return (
            f"{'PASS' if self.passed else 'FAIL'} {self.matched} matched, {self.mismatched} "
            f"mismatched (target {self.target})"
        )


@dataclass(frozen=True, kw_only=True)
class ReplayServedEntry(Entry):
    """A served ledger computed again (``kvgraft replay --served``)."""

    KIND = kinds.REPLAY_SERVED
    served: dict = inp(dict)  # ledger, lines_sha256, first_seq, last_seq, count
    matched: int = out(int)
    mismatched: int = out(int)

    SHOWN = ()

    def summary(self) -> str:
        return f"{self.matched} matched, {self.mismatched} mismatched ({self.served.get('count')} served lines)"


ARTIFACT_PREFIX = "artifact."  # an import's outputs: one "artifact.<sha256>" digest per artifact


@dataclass(frozen=True, kw_only=True)
class ImportEntry(Entry):
    """A bundle's artifacts stored here (``kvgraft store import``): one output per artifact, named by its hash."""

    KIND = kinds.IMPORT
    bundle: Digest = inp(Digest)  # name, bytes
    listing: Digest = inp(Digest)
    provenance: Digest = inp(Digest)  # lines
    checkpoint: Digest = inp(Digest)  # the bundle's signed checkpoint
    settings: dict = inp(dict)
    counts: dict = out(dict)
    artifacts: Mapping[str, Digest] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        body = super().to_json()
        body[OUTPUTS].update({ARTIFACT_PREFIX + sha: d.to_json() for sha, d in self.artifacts.items()})
        return body

    @classmethod
    def _make(cls, value: dict, kwargs: dict, extra: dict, written: dict, where: str) -> ImportEntry:
        outs = dict(extra.get(OUTPUTS, {}))
        arts = {}
        for k in [k for k in outs if k.startswith(ARTIFACT_PREFIX)]:
            try:
                arts[k[len(ARTIFACT_PREFIX) :]] = Digest.from_json(outs[k], f"{where}: outputs.{k}")
            except EntryError:
                continue  # not a digest: kept as it is, recording nothing
            del outs[k]
        extra = {p: d for p, d in ({**extra, OUTPUTS: outs}).items() if d}
        return cls(**kwargs, **written, extra=extra, artifacts=arts)

    SHOWN = ("bundle",)  # and one "artifact.<sha256>" output per artifact (ledger log --json)

    def summary(self) -> str:
        c = self.counts
        return (
            f"bundle {self.bundle.get('name')}: {c.get('imported')} imported, {c.get('existing')} "
            f"already stored, {c.get('foreign')} of another pin"
        )


KINDS: dict[str, type[Entry]] = {
    c.KIND: c
    for c in (
        DepositEntry,
        GraftEntry,
        GraftCheckEntry,
        ProbeEntry,
        ScoreEntry,
        SolveEntry,
        SolveOutputsEntry,
        ServeEntry,
        RegisterEntry,
        ReplayEntry,
        ReplayServedEntry,
        ImportEntry,
    )
}


def parse(value: Any, where: str = "entry") -> Entry:
    """A line's JSON object as its kind's class (OtherEntry for a kind none models), or EntryError."""
    if not isinstance(value, dict):
        raise EntryError(f"{where} is not a JSON object")
    k = value.get("kind")
    cls = KINDS.get(k, OtherEntry) if isinstance(k, str) else OtherEntry  # (a hostile line's kind may be unhashable)
    return cls.from_json(value, where)


def parse_as(cls: type[E], value: Any, where: str = "entry") -> E:
    """A line that must be of ``cls``'s kind (EntryError otherwise)."""
    if not isinstance(value, dict) or value.get("kind") != cls.KIND:
        raise EntryError(f"{where} is not a {cls.KIND} entry")
    return cls.from_json(value, where)


def write(
    path: Any,
    entry: E,
    finalize: Callable[[E], E] | None = None,
    after: Callable[[E], None] | None = None,
) -> E:
    """Append ``entry`` to the ledger at ``path`` (ledger.log.append: one canonical line under the append lock) and
    return it as written (seq, prev, time; non-integer numbers as the strings the line holds).

    ``finalize`` runs under the lock just before the line is written and returns the entry to write instead (a
    deposit's ``status``, which depends on what earlier lines recorded); ``after`` runs under the same lock once the
    line is written."""
    cls = type(entry)

    def body_of(e: E) -> dict[str, Any]:
        # The types must describe the line completely: one that would not read back as itself is refused before
        # anything is written (a field no class models, a digest whose facts shadow its path...).
        body = e.to_json()
        try:
            same = cls.from_json(body).to_json() == body
        except EntryError as x:
            raise EntryError(f"a {e.kind} entry that would not read back: {x.message}") from None
        if not same:
            raise EntryError(f"a {e.kind} entry that would not read back as written")
        return body

    def fin(body: dict[str, Any]) -> None:
        assert finalize is not None
        body.clear()
        body.update(body_of(finalize(entry)))

    def done(line: dict[str, Any]) -> None:
        assert after is not None
        after(cls.from_json(line))

    # (with ``finalize`` the entry written is the one it returns: that one is checked, under the lock)
    body = entry.to_json() if finalize else body_of(entry)
    line = ledger_log.append(path, entry.kind, body, finalize=fin if finalize else None, after=done if after else None)
    return cls.from_json(line)


def read(path: Any, kinds_wanted: tuple[type[E], ...] | None = None, start: int = 0) -> list[E]:
    """The complete lines of a ledger from line ``start`` (0-based) on, typed (ledger.log.read; no verification:
    that is `kvgraft verify`); ``kinds_wanted``: only lines of those classes. EntryError names the file and line of
    a line that is not what its kind records."""
    names = None if kinds_wanted is None else {c.KIND for c in kinds_wanted}
    lines = ledger_log.read(path)
    # Only the lines of the kinds asked for are parsed: a malformed line of another kind is no reader's business
    return [
        parse(e, f"{path}:{i + 1}")  # type: ignore[misc]
        for i, e in enumerate(lines)
        if i >= start and (names is None or (isinstance(k := e.get("kind"), str) and k in names))
    ]


def named_files(line: Any, hashed: bool = True) -> list[tuple[str, Any]]:
    """The files a line names, whatever its kind and however malformed the rest (the schema's rule: every input and
    output is a digest; one with a ``path`` names a file): ``(field, {"path", "sha256", ...})`` for the manifest and
    each such member of ``inputs`` and ``outputs``. What `kvgraft verify` re-hashes; ``hashed=False``: a path
    without a sha256 string too (what `kvgraft report -o` must not overwrite)."""
    found: list[tuple[str, Any]] = []
    if not isinstance(line, dict):
        return found
    m = line.get("manifest")

    def names(d: Any) -> bool:
        return (
            isinstance(d, dict) and isinstance(d.get("path"), str) and (not hashed or isinstance(d.get("sha256"), str))
        )

    if names(m):
        found.append(("manifest", m))
    for place in (INPUTS, OUTPUTS):
        members = line.get(place)
        if not isinstance(members, dict):  # a schema finding already; no crash on "inputs": [1]
            continue
        found += [(f"{place}.{name}", d) for name, d in members.items() if names(d)]
    return found
