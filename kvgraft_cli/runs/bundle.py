"""``kvgraft store export`` and ``kvgraft store import``: move artifacts between stores, byte for byte, with the
ledger lines that recorded them and RFC 6962 inclusion proofs against a (signed) checkpoint of the sender's ledger.

Export only reads: every exported artifact is re-hashed (Store.load_chain), a chain link brings its parents, and
each listing row claims only what its recording line backs (:func:`backing`). Import checks everything before it
writes anything to the store or the ledger (store/bundle.py: member types, names, sizes and hashes, each object
re-hashed as an artifact; here: the checkpoint and its signatures, every proof, that each provenance line records
its artifact, the compute pin, the index keys recomputed from the artifact's own tokens, no two artifacts under one
key, the verified flags, problem ids and library rows held to the provenance lines and (library texts, by
tokenizing them) to the artifact's own tokens, chain parents, and no clash with what the receiving store already
maps); then it moves the staged objects into place, indexes them and appends one ``import`` entry naming every
artifact with its path and what was derived about it, so `kvgraft verify` re-hashes them, `kvgraft store gc` keeps
them and a later export is backed by it. docs/BUNDLE.md specifies the format.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ArtifactError, CheckFailed, InputError, IntegrityError
from ..eval.problems import Problem, normalize_key, verify_solution
from ..ledger import entries, merkle
from ..ledger import log as ledger
from ..ledger.entries import DepositEntry, Digest, Entry, EntryError, ImportEntry, SolveEntry
from ..ledger.proofs import LedgerTree
from ..store import bundle as fmt
from ..store.local import link_key, prefix_key, problem_key
from ..util import jsonio
from ..util.hashing import sha256_bytes, sha256_file
from .context import RunContext
from .owned import check_output

DEFAULT_ORIGIN = "kvgraft-ledger"


def typed(entry: Any) -> Entry | None:
    """A ledger line as its typed entry, or None for one that is not what its kind records (such a line backs
    nothing: `kvgraft verify` reports it)."""
    try:
        return entries.parse(entry)
    except EntryError:
        return None


def recorded_by(entry: Any) -> set[str]:
    """The artifacts a ledger entry records (puts on the record as stored): a deposit's ``outputs.artifact``, a
    solve's chain (``inputs.library.chain`` and ``new_links``), an import's ``outputs["artifact.<sha256>"]``."""
    e = typed(entry)
    found: list[Any] = []
    if isinstance(e, DepositEntry):
        found.append(e.artifact.sha256)
    elif isinstance(e, SolveEntry):
        for k in ("chain", "new_links"):
            v = e.library.get(k)
            found += v if isinstance(v, list) else []
    elif isinstance(e, ImportEntry):
        found += list(e.artifacts)
    return {s for s in found if isinstance(s, str)}


def plural(n: int, word: str) -> str:
    """``1 line``, ``2 lines``."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"


@dataclass(frozen=True)
class Backing:
    """What the ledger line that records an artifact says about it: whether it is verified, under which problem ids
    and against which reference answer. A bundle's listing may claim no more (docs/BUNDLE.md, rule 7)."""

    seq: int
    kind: str
    verified: bool
    status: str  # how the line puts it, for messages: "status 'wrong'", "no verification status", ...
    problem_ids: tuple[str, ...] | None  # None: the line names no problem for this artifact
    has_reference: bool
    reference: str | None

    @property
    def line(self) -> str:
        return f"its provenance (ledger line {self.seq + 1}, kind {self.kind[:40]!r})"


def backing(entry: dict, sha: str) -> Backing:
    """What ``entry`` (a ledger line that records ``sha``) says about it. A deposit line: its verification status,
    its record's id and its reference answer. An import line of this version: the verified flag, problem ids and
    reference its importer derived and recorded per artifact. Anything else (a solve line's chain, an older import
    line, a line that is not what its kind records): no verification, no problem id."""
    e = typed(entry)
    kind = str(entry.get("kind")) if isinstance(entry, dict) else "?"
    seq = e.seq if e is not None and type(e.seq) is int else -1
    if isinstance(e, DepositEntry):
        v, pid = e.verification, e.record.get("id")
        return Backing(
            seq,
            kind,
            v.status == "verified",
            f"status {v.status[:40]!r}",
            (pid,) if isinstance(pid, str) else None,
            True,
            v.reference if isinstance(v.reference, str) else None,
        )
    d = e.artifacts.get(sha) if isinstance(e, ImportEntry) else None
    if d is not None and isinstance(d.get("verified"), bool):
        pids = d.get("problem_ids")
        pids = tuple(pids) if isinstance(pids, list) and all(isinstance(p, str) for p in pids) else None
        ref = d.get("reference")
        return Backing(
            seq,
            kind,
            d.get("verified"),
            f"status {'verified' if d.get('verified') else 'unverified'!r}",
            pids,
            "reference" in d.facts,
            ref if isinstance(ref, str) else None,
        )
    return Backing(seq, kind, False, "no verification status", None, False, None)


def _id_backed(pid: str, b: Backing, parent: str | None) -> bool:
    """Whether an index row may carry ``pid``: one the line names, or for a chain link the form solve gives it
    (``<problem>@<parent's first 12 hex>``, so it can never take a deposited problem's plain id)."""
    if b.problem_ids is not None:
        return pid in b.problem_ids
    return parent is not None and pid.endswith("@" + parent[:12]) and len(pid) > 13


def _library_backed(lib: dict, b: Backing, parent: str | None) -> bool:
    return (
        b.verified
        and parent is None
        and b.problem_ids is not None
        and lib["problem_id"] in b.problem_ids
        and (not b.has_reference or lib.get("answer") == b.reference)
    )


def _supports(row: dict, b: Backing) -> bool:
    parent = row["parent_sha256"]
    return all(e["verified"] == b.verified and _id_backed(e["problem_id"], b, parent) for e in row["entries"]) and (
        row["library"] is None or _library_backed(row["library"], b, parent)
    )


def _conform(row: dict, b: Backing) -> dict:
    """A listing row that claims only what ``b`` backs: each entry's verified flag is the line's, a problem id the
    line does not name is replaced by the one it names (or the entry left out when it names none), and a library
    row the line does not back is left out."""
    parent, entries = row["parent_sha256"], []
    for e in row["entries"]:
        pid = e["problem_id"]
        if not _id_backed(pid, b, parent):
            if b.problem_ids is None or len(b.problem_ids) != 1:
                continue
            pid = b.problem_ids[0]
        entries.append({**e, "problem_id": pid, "verified": b.verified})
    lib = row["library"]
    return {**row, "entries": entries, "library": lib if lib is not None and _library_backed(lib, b, parent) else None}


# -- export --------------------------------------------------------------------------------------------------------


@dataclass
class ExportReport:
    """What an export wrote."""

    bundle: str
    sha256: str
    bytes: int
    artifacts: list[dict]
    lines: list[int]
    checkpoint: dict

    def to_json(self) -> dict:
        return asdict(self)


def export_bundle(
    ctx: RunContext, refs: list[str], output: Path, *, key: str | None = None, origin: str = DEFAULT_ORIGIN
) -> ExportReport:
    """Write the artifacts ``refs`` name (hash, unique prefix or problem id; none: every recorded artifact), with
    their chains' parents, to the bundle ``output``, with the first line of ``ctx.ledger`` recording each and its
    inclusion proof against a checkpoint of the whole ledger (signed with the signer ``key`` when given)."""
    from ..ledger.checkpoint import load_key, sign

    _local_only(ctx, "export from", "pull")
    # Never over the ledger or the store (#24.6), and into a folder that exists (#24.9): write_bundle creates none.
    check_output(output, "--output", ctx, folder_must_exist=True)
    signer = load_key(key) if key is not None else None  # a bad key is refused before any work
    tree = LedgerTree.read(ctx.ledger, complete=True)
    with ctx.open_store(create=False) as store:
        roots = (
            [store.resolve(r, ctx.manifest.machine_compute_sha256) for r in refs]
            if refs
            else fmt.recorded_artifacts(store)
        )
        if not roots:
            raise InputError(
                f"store {ctx.store} holds no recorded artifact to export",
                "deposit first (`kvgraft deposit FILE.jsonl`)",
            )
        wanted: dict[str, None] = {}  # insertion-ordered set: parents before their links
        for sha in roots:
            for link, _ in store.load_chain(sha):  # each re-hashed: a damaged object is never exported
                wanted.setdefault(link)
        rows = {sha: fmt.listing_row(store, sha, -1) for sha in sorted(wanted)}
        first = _recording_lines(tree, rows)
        unrecorded = [s for s in wanted if s not in first]
        if unrecorded:
            raise InputError(
                f"artifact {unrecorded[0][:16]}... is recorded by no line of ledger {ctx.ledger}, so "
                "the bundle could not prove where it came from"
                + (f" (and {len(unrecorded) - 1} more)" if len(unrecorded) > 1 else ""),
                "pass the ledger that recorded it with --ledger, or deposit it again",
            )
        listed = [dict(_conform(rows[sha], first[sha]), recorded_by=first[sha].seq) for sha in sorted(wanted)]
        objects = {sha: store.object_path(sha) for sha in wanted}
        seqs = sorted(set(first[s].seq for s in wanted))
        cp = tree.checkpoint(origin)
        proofs = merkle.MerkleTree(tree.leaves)
        lines = []
        for s in seqs:
            proof = proofs.inclusion_proof(s, cp.size)
            merkle.verify_inclusion(s, cp.size, tree.leaves[s], proof, cp.root)  # never hand out a bad proof
            lines.append({"seq": s, "proof": [h.hex() for h in proof]})
        text = cp.body() if signer is None else sign(cp.body(), signer)
        listing = {"format": fmt.FORMAT, "version": fmt.VERSION, "artifacts": listed, "provenance": {"lines": lines}}
        raw_lines = b"".join(tree.lines[s] + b"\n" for s in seqs)
        sha = fmt.write_bundle(output, listing, objects, text.encode("utf-8"), raw_lines)
    arts = [
        {
            "sha256": r["sha256"],
            "problem_ids": [e["problem_id"] for e in r["entries"]],
            "file_bytes": r["file_bytes"],
            "recorded_by": r["recorded_by"],
        }
        for r in listed
    ]
    return ExportReport(
        str(output),
        sha,
        Path(output).stat().st_size,
        arts,
        seqs,
        {"origin": origin, "size": cp.size, "root": cp.root.hex(), "signed": signer is not None},
    )


def _local_only(ctx: RunContext, doing: str, then: str) -> None:
    """Bundles are made from and into a local store (the store package's SQL reads and renames are local)."""
    remote = getattr(ctx, "remote", None)
    if remote:
        raise InputError(
            f"cannot {doing} remote store {remote} with a bundle",
            f"use a local store (--store DIR), and `kvgraft store {then}` to sync it with {remote}",
        )


def _recording_lines(tree: LedgerTree, rows: dict[str, dict]) -> dict[str, Backing]:
    """The line that records each wanted artifact (the keys of ``rows``, its listing rows): the first that backs
    everything its row says (verified flag, problem ids, library row), else the first that records it at all (the
    row is then conformed to it). Reads the ledger until every artifact has a backing line, at worst to its end."""
    first: dict[str, Backing] = {}
    chosen: dict[str, Backing] = {}
    for i, raw in enumerate(tree.lines):
        try:
            entry = jsonio.loads(raw)
        except ValueError:  # `kvgraft verify` reports it; it records nothing
            continue
        for sha in recorded_by(entry) & rows.keys():
            if sha in chosen:
                continue
            b = backing(dict(entry, seq=i), sha)
            first.setdefault(sha, b)
            if _supports(rows[sha], b):
                chosen[sha] = b
        if len(chosen) == len(rows):
            break
    return {**first, **chosen}


# -- import --------------------------------------------------------------------------------------------------------


@dataclass
class ImportReport:
    """What an import checked and wrote."""

    bundle: str
    sha256: str
    store: str
    ledger: str
    checkpoint: dict
    artifacts: list[dict] = field(default_factory=list)
    ledger_seq: int | None = None

    def to_json(self) -> dict:
        return asdict(self)


def import_bundle(
    ctx: RunContext, bundle: Path, *, keys: list[str] | None = None, keep_foreign: bool = False
) -> ImportReport:
    """Check the bundle completely, then add its artifacts to ``ctx.store`` byte for byte and append one ``import``
    entry to ``ctx.ledger``. ``keys``: verifier keys, one of which must have signed the checkpoint.
    ``keep_foreign``: also keep artifacts made under another compute pin (they are indexed under their own pin, so
    no run of this manifest serves them). Any refusal names the bundle entry and leaves store and ledger as they
    were."""
    from ..ledger.checkpoint import load_key

    _local_only(ctx, "import into", "push")
    verifiers = [load_key(k) for k in keys or []]
    ledger.check_appendable(ctx.ledger)
    objects_dir = ctx.store / "objects"
    # Staged inside the store when it exists (the final move is then a rename); nothing is left there either way.
    parent = objects_dir if objects_dir.is_dir() else (ctx.store.parent if ctx.store.parent.is_dir() else None)
    staging = Path(tempfile.mkdtemp(prefix=".kvgraft-import-", dir=parent))
    try:
        staged = fmt.read_bundle(bundle, staging)
        checkpoint = check_provenance(staged, verifiers)
        _check_pins(staged, ctx.manifest.machine_compute_sha256, keep_foreign)
        facts = fmt.check_objects(staged)
        _check_index_rows(staged, facts)
        derived = _check_claims(staged, facts, ctx.manifest)
        _check_against_store(staged, ctx)
        return _write(ctx, staged, checkpoint, keep_foreign, Path(bundle), derived)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def check_provenance(staged: fmt.Staged, verifiers: list[str]) -> dict:
    """Check the checkpoint (and its signature by one of ``verifiers``, when given), each provenance line's inclusion
    proof against it, and that the line each artifact names records that artifact. Returns what the import entry
    records about the checkpoint."""
    from ..ledger.checkpoint import Checkpoint, verify_note

    src, prov = staged.source, staged.listing["provenance"]
    where = f"{src}: entry {fmt.CHECKPOINT!r}"
    try:
        text = staged.checkpoint.decode("utf-8")
        cp = Checkpoint.parse(text)
    except UnicodeDecodeError:
        raise ArtifactError(f"{where}: not UTF-8") from None
    except InputError as e:
        raise ArtifactError(f"{where}: {e.message}", e.hint) from None
    signed_by: list[str] = []
    if verifiers:
        try:
            signed_by = verify_note(text, verifiers)
        except CheckFailed as e:
            raise IntegrityError(f"{where}: {e.message}", e.hint) from None
        except InputError as e:  # e.g. not signed at all
            raise ArtifactError(
                f"{where}: {e.message}",
                "a --key import needs a checkpoint signed at export (`kvgraft store export --key SIGNER.key`)",
            ) from None
    lines, tail = ledger.split_lines(staged.lines)
    listed = prov["lines"]
    lw = f"{src}: entry {fmt.LINES!r}"
    if tail or len(lines) != len(listed):
        raise ArtifactError(
            f"{lw} holds {plural(len(lines), 'complete line')}{' and a torn tail' if tail else ''}, "
            f"the listing proves {len(listed)}"
        )
    entries: dict[int, dict] = {}
    for i, (raw, ln) in enumerate(zip(lines, listed)):
        at = f"{lw} line {i + 1} (ledger line {ln['seq'] + 1})"
        try:
            merkle.verify_inclusion(
                ln["seq"], cp.size, merkle.leaf_hash(raw), [bytes.fromhex(h) for h in ln["proof"]], cp.root
            )
        except CheckFailed as e:
            raise IntegrityError(
                f"{at}: not in the ledger the checkpoint commits to ({e.message})",
                "the line, its proof or the checkpoint was changed; fetch the bundle again",
            ) from None
        try:
            entry = jsonio.loads(raw)
        except ValueError:
            entry = None
        if not isinstance(entry, dict) or entry.get("seq") != ln["seq"]:
            raise ArtifactError(f"{at}: not a ledger entry with seq {ln['seq']}")
        entries[ln["seq"]] = entry
    used = set()
    for a in staged.artifacts:
        entry = entries.get(a["recorded_by"])
        if entry is None or a["sha256"] not in recorded_by(entry):
            what = (
                "is not among the provenance lines"
                if entry is None
                else f"(kind {str(entry.get('kind'))[:40]!r}) does not record this artifact"
            )
            raise ArtifactError(f"{src}: entry {a['path']!r}: its recording ledger line {a['recorded_by'] + 1} {what}")
        used.add(a["recorded_by"])
    if set(entries) - used:
        raise ArtifactError(f"{lw}: ledger line {min(set(entries) - used) + 1} records no artifact of the bundle")
    staged.provenance = entries
    return {
        "sha256": sha256_bytes(staged.checkpoint),
        "origin": cp.origin,
        "size": cp.size,
        "root": cp.root.hex(),
        "signed_by": signed_by,
    }


def _check_pins(staged: fmt.Staged, pin: str, keep_foreign: bool) -> None:
    """Refuse artifacts made under another compute pin unless they are to be kept for later (checked on the
    listing, before any object is re-hashed; check_objects then holds each artifact to its listed pin)."""
    foreign = [a for a in staged.artifacts if a["manifest_sha256"] != pin]
    if foreign and not keep_foreign:
        a = foreign[0]
        raise InputError(
            f"{staged.source}: entry {a['path']!r} was made under compute pin "
            f"{a['manifest_sha256'][:16]}..., this manifest's is {pin[:16]}..."
            + (f" ({len(foreign)} of {len(staged.artifacts)} artifacts are)" if len(foreign) > 1 else ""),
            "import with the manifest they were made under, or pass --keep-foreign to store them for "
            "later (no run of this manifest grafts them)",
        )


def _check_index_rows(staged: fmt.Staged, facts: dict[str, fmt.ObjectFacts]) -> None:
    """Each index key must be the one the artifact's own tokens give under its pin (a bundle cannot point a prefix
    at other bytes), and no two listed artifacts may share one (same pin and tokens, different bytes: which one a
    run would graft must not depend on the listing's order)."""
    from ..engine.engine import token_ids_sha256

    owner: dict[str, str] = {}
    for a in staged.artifacts:
        f, pin, where = facts[a["sha256"]], a["manifest_sha256"], f"{staged.source}: entry {a['path']!r}"
        ids = token_ids_sha256(f.token_ids)
        want = prefix_key(pin, ids) if f.parent is None else link_key(pin, f.parent, ids)
        for e in a["entries"]:
            if e["key"] != want:
                raise ArtifactError(
                    f"{where}: index entry {e['problem_id'][:60]!r} has key {e['key'][:16]}..., the "
                    f"artifact's tokens under its pin give {want[:16]}..."
                )
            other = owner.setdefault(e["key"], a["path"])
            if other != a["path"]:
                first, second = sorted((other, a["path"]))
                raise CheckFailed(
                    f"{staged.source}: entry {first!r} and entry {second!r} hold the same index key "
                    f"{want[:16]}... (same pin and tokens) with different bytes: the machine that "
                    "made them did not compute the same bytes twice",
                    "import them into separate stores, or ask the sender which one to keep",
                )


@dataclass
class Derived:
    """What import derived for one artifact (and records in its import line, so a re-export is backed by it)."""

    verified: bool
    problem_ids: list[str]
    reference: str | None
    library: dict | None  # the row to add, checked; None: none
    library_note: str  # "imported", "none", "not imported (another pin)"


def _check_claims(staged: fmt.Staged, facts: dict[str, fmt.ObjectFacts], manifest) -> dict[str, Derived]:
    """Hold what the listing says about each artifact to its provenance line (docs/BUNDLE.md, rule 7): an index
    row's ``verified`` must be what the line says, its ``problem_id`` one the line names (a chain link's:
    ``<problem>@<parent>``); a library row needs a verified root, its problem id and reference answer must be the
    line's, its solution must verify against its answer, its problem_key must be its text's, and the prefix the
    receiving manifest renders from it must tokenize to exactly the artifact's token ids (the artifact being
    identity-checked, this binds the texts to the bytes). Library rows of foreign artifacts are not checked (their
    template is not known here) and not imported."""
    pin, derived, tok = manifest.machine_compute_sha256, {}, None
    for a in staged.artifacts:
        f, where = facts[a["sha256"]], f"{staged.source}: entry {a['path']!r}"
        b = backing(staged.provenance[a["recorded_by"]], a["sha256"])
        for e in a["entries"]:
            pid = e["problem_id"][:60]
            if e["verified"] != b.verified:
                raise ArtifactError(
                    f"{where}: index row {pid!r} says verified {str(e['verified']).lower()}, {b.line} says {b.status}",
                    _CLAIM_HINT,
                )
            if not _id_backed(e["problem_id"], b, f.parent):
                if b.problem_ids is not None:
                    said = f"is not the record id {', '.join(repr(x[:60]) for x in b.problem_ids)} that {b.line} names"
                elif f.parent is not None:
                    said = f"is not a chain link's <problem>@{f.parent[:12]}"
                else:
                    said = f"is on a root artifact, and {b.line} names no problem id for it"
                raise ArtifactError(f"{where}: index row problem id {pid!r} {said}", _CLAIM_HINT)
        d = Derived(
            b.verified, [e["problem_id"] for e in a["entries"]], b.reference if b.verified else None, None, "none"
        )
        lib = a.get("library")
        if lib is not None:
            if not b.verified or f.parent is not None:
                raise ArtifactError(
                    f"{where}: a library row belongs to a verified root artifact only; "
                    f"{b.line} says {b.status}" + (" and it is a chain link" if f.parent else ""),
                    _CLAIM_HINT,
                )
            if lib["problem_id"] not in (b.problem_ids or ()):
                raise ArtifactError(
                    f"{where}: the library row's problem id {lib['problem_id'][:60]!r} is not the "
                    f"record id {b.line} names",
                    _CLAIM_HINT,
                )
            if not _library_backed(lib, b, f.parent):
                raise ArtifactError(
                    f"{where}: the library row's answer {str(lib.get('answer'))[:40]!r} is not the "
                    f"reference answer {str(b.reference)[:40]!r} {b.line} records",
                    _CLAIM_HINT,
                )
            if lib["problem_key"] != problem_key(a["manifest_sha256"], normalize_key(lib["problem"])):
                raise ArtifactError(f"{where}: the library row's problem_key is not the key of its problem text")
            p = Problem(0, lib["problem_id"], lib["problem"], lib["solution"], lib.get("answer"), "")
            verdict = verify_solution(p)
            if verdict.status != "verified":
                raise ArtifactError(
                    f"{where}: the library row's solution does not verify ({verdict.status}: {verdict.reason[:120]})",
                    _CLAIM_HINT,
                )
            if a["manifest_sha256"] != pin:
                d.library_note = "not imported (another pin)"
            else:
                tok = tok or _prefix_tokenizer(manifest)
                _check_texts_bind(tok, p, f, where)
                d.library, d.library_note = lib, "imported"
        derived[a["sha256"]] = d
    return derived


_CLAIM_HINT = (
    "a listing may claim only what its provenance lines record; ask the sender for a fresh export "
    "(`kvgraft store export`)"
)


def _check_texts_bind(tok, p: Problem, f: fmt.ObjectFacts, where: str) -> None:
    """The library row's prefix, rendered with the receiving manifest's template as deposit renders it, must
    tokenize to exactly the artifact's token ids."""
    try:
        ids = tok.prefix_ids(tok.prompts.root_text(p.fields()), where=where)
    except InputError as e:
        raise ArtifactError(
            f"{where}: the library row's texts cannot be this artifact's prefix ({e.message})", _CLAIM_HINT
        ) from None
    if ids != f.token_ids:
        at = next((i for i, (x, y) in enumerate(zip(ids, f.token_ids)) if x != y), min(len(ids), len(f.token_ids)))
        raise ArtifactError(
            f"{where}: the library row's problem and solution do not tokenize to the artifact's "
            f"tokens ({len(ids):,} tokens against {len(f.token_ids):,}, first difference at token "
            f"{at:,}): its texts belong to another prefix",
            _CLAIM_HINT,
        )


def _prefix_tokenizer(manifest):
    """Just what tokenizing a prefix needs (engine.Engine.prefix_ids): the manifest, the tokenizer and the model's
    config for its position limit, loaded from the model folder without its weights. The tokenizer files must hash
    to the manifest's pinned tokenizer_sha256, or the binding would be checked against another tokenizer."""
    from types import SimpleNamespace

    from ..config.modelhash import tokenizer_sha256
    from ..engine.engine import Engine
    from ..engine.gguf import materialize

    materialize(manifest)
    model_dir = manifest.model_dir
    want = manifest.model.tokenizer_sha256
    try:
        got, why = tokenizer_sha256(model_dir), "no tokenizer files"
    except OSError as e:
        got, why = None, str(e)
    if got != want:
        raise CheckFailed(
            f"cannot check the bundle's library rows against their artifacts: the tokenizer in "
            f"{model_dir} "
            + (f"hashes to {got[:16]}..." if got else f"is not readable ({why})")
            + f", the manifest pins {want[:16]}...",
            "import where the manifest's model is installed (its tokenizer files are what is read)",
        )
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    transformers.utils.logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    # A tokenizer-only engine: an import reads no weights, so there are no model hashes or drift to carry.
    return Engine(manifest, SimpleNamespace(config=config), tokenizer, None, None, None, {})  # type: ignore[arg-type]


def _check_against_store(staged: fmt.Staged, ctx: RunContext) -> None:
    """A link's parent must come with the bundle or be in the store already; and no prefix the receiving store
    already maps to an artifact may be mapped to another one."""
    have = {a["sha256"] for a in staged.artifacts}
    store = ctx.open_store(create=False) if (ctx.store / "index.sqlite").is_file() else None
    try:
        for a in staged.artifacts:
            where = f"{staged.source}: entry {a['path']!r}"
            p = a["parent_sha256"]
            if p is not None and p not in have and not (store and store.has_object(p)):
                raise ArtifactError(
                    f"{where}: a chain link whose parent {p[:16]}... is neither in the bundle nor in store {ctx.store}",
                    "export the link again: an export brings its parents",
                )
            for e in a["entries"] if store else []:
                assert store is not None  # (the loop runs only with a store)
                got = store.lookup_key(e["key"])
                if got is not None and got.artifact != a["sha256"]:
                    raise CheckFailed(
                        f"{where}: store {ctx.store} maps the same prefix under the same pin "
                        f"({e['problem_id'][:60]!r}) to artifact {got.artifact[:16]}...: the two "
                        "machines did not compute the same bytes",
                        "compare the two manifests' kernel flags and versions; import into another store to keep both",
                    )
    finally:
        if store is not None:
            store.close()


def _write(
    ctx: RunContext, staged: fmt.Staged, checkpoint: dict, keep_foreign: bool, bundle: Path, derived: dict[str, Derived]
) -> ImportReport:
    """Move the checked objects into the store, index them, and record the import (marking them recorded under the
    ledger's append lock). A failure here (disk full) leaves complete, indexed, unrecorded objects, as a failed
    deposit does (store/local.py)."""
    report = ImportReport(str(bundle), staged.sha256, str(ctx.store), str(ctx.ledger), checkpoint)
    arts: dict[str, Digest] = {}
    pin = ctx.manifest.machine_compute_sha256
    with ctx.open_store() as store:
        for a in sorted(staged.artifacts, key=lambda a: (a["start_position"], a["sha256"])):
            sha, dest = a["sha256"], store.object_path(a["sha256"])
            status = "existing" if store.has_object(sha) else "imported"
            if status == "imported":
                fmt.place(staged.objects[sha], dest)
            d = derived[sha]
            for e in a["entries"]:  # each checked against the provenance line (_check_claims)
                store.index(
                    sha,
                    payload_bytes=a["payload_bytes"],
                    key=e["key"],
                    problem_id=e["problem_id"],
                    num_tokens=a["num_tokens"],
                    model_sha256=a["model_sha256"],
                    manifest_sha256=a["manifest_sha256"],
                    verified=d.verified,
                )
            if d.library is not None:
                store.add_to_library(sha, d.library["problem_id"], a["manifest_sha256"], a["num_tokens"], d.library)
            file_sha = a["file_sha256"] if status == "imported" else sha256_file(dest)
            # What was derived is recorded, so a later export of this store is backed by this line.
            arts[sha] = Digest.of(
                sha,
                ctx.rel(dest),
                file_sha256=file_sha,
                status=status,
                compute_sha256=a["manifest_sha256"],
                verified=d.verified,
                problem_ids=d.problem_ids,
                **({"reference": d.reference} if d.verified else {}),
            )
            report.artifacts.append(
                {
                    "sha256": sha,
                    "status": status,
                    "foreign": a["manifest_sha256"] != pin,
                    "problem_ids": d.problem_ids,
                    "verified": d.verified,
                    "library": d.library_note,
                    "file_sha256": file_sha,
                    "path": str(dest),
                }
            )
        entry = ImportEntry(
            manifest=ctx.manifest_ref(),
            bundle=Digest.of(staged.sha256, name=bundle.name, bytes=staged.bytes),
            listing=Digest(staged.listing_sha256),
            provenance=Digest.of(
                sha256_bytes(staged.lines), lines=[ln["seq"] for ln in staged.listing["provenance"]["lines"]]
            ),
            checkpoint=Digest.of(checkpoint["sha256"], **{k: v for k, v in checkpoint.items() if k != "sha256"}),
            settings={"keep_foreign": keep_foreign},
            counts={s: sum(r["status"] == s for r in report.artifacts) for s in ("imported", "existing")}
            | {"artifacts": len(report.artifacts), "foreign": sum(r["foreign"] for r in report.artifacts)},
            artifacts=arts,
        )
        shas = [a["sha256"] for a in staged.artifacts]
        written = entries.write(ctx.ledger, entry, after=lambda _: store.mark_recorded(shas))
    report.ledger_seq = written.seq
    return report
