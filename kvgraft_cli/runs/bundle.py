"""``kvgraft store export`` and ``kvgraft store import``: move artifacts between stores, byte for byte, with the
ledger lines that recorded them and RFC 6962 inclusion proofs against a (signed) checkpoint of the sender's ledger.

Export only reads: every exported artifact is re-hashed (Store.load_chain), and a chain link brings its parents.
Import checks everything before it writes anything to the store or the ledger (store/bundle.py: member types,
names, sizes and hashes, each object re-hashed as an artifact; here: the checkpoint and its signatures, every proof,
that each provenance line records its artifact, the compute pin, the index keys recomputed from the artifact's own
tokens, chain parents, and no clash with what the receiving store already maps); then it moves the staged objects
into place, indexes them and appends one ``import`` entry naming every artifact with its path, so `kvgraft verify`
re-hashes them and `kvgraft store gc` keeps them. docs/BUNDLE.md specifies the format.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ArtifactError, CheckFailed, InputError, IntegrityError
from ..eval.problems import normalize_key
from ..ledger import log as ledger
from ..ledger import merkle
from ..ledger.proofs import LedgerTree
from ..store import bundle as fmt
from ..store.local import link_key, prefix_key, problem_key
from ..util import jsonio
from ..util.hashing import digest, sha256_bytes, sha256_file
from .context import RunContext

DEFAULT_ORIGIN = "kvgraft-ledger"


def recorded_by(entry: Any) -> set[str]:
    """The artifacts a ledger entry records (puts on the record as stored): a deposit's ``outputs.artifact``, a
    solve's chain (``inputs.library.chain`` and ``new_links``), an import's ``outputs["artifact.<sha256>"]``."""
    if not isinstance(entry, dict):
        return set()
    kind, ins, outs = entry.get("kind"), entry.get("inputs"), entry.get("outputs")
    ins, outs = (ins if isinstance(ins, dict) else {}), (outs if isinstance(outs, dict) else {})
    found: list[Any] = []
    if kind == "deposit" and isinstance(outs.get("artifact"), dict):
        found.append(outs["artifact"].get("sha256"))
    elif kind == "solve" and isinstance(ins.get("library"), dict):
        for k in ("chain", "new_links"):
            v = ins["library"].get(k)
            found += v if isinstance(v, list) else []
    elif kind == "import":
        found += [d.get("sha256") for k, d in outs.items() if k.startswith("artifact.") and isinstance(d, dict)]
    return {s for s in found if isinstance(s, str)}


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


def export_bundle(ctx: RunContext, refs: list[str], output: Path, *, key: str | None = None,
                  origin: str = DEFAULT_ORIGIN) -> ExportReport:
    """Write the artifacts ``refs`` name (hash, unique prefix or problem id; none: every recorded artifact), with
    their chains' parents, to the bundle ``output``, with the first line of ``ctx.ledger`` recording each and its
    inclusion proof against a checkpoint of the whole ledger (signed with the signer ``key`` when given)."""
    from ..ledger.checkpoint import load_key, sign

    _local_only(ctx, "export from", "pull")
    signer = load_key(key) if key is not None else None  # a bad key is refused before any work
    tree = LedgerTree.read(ctx.ledger, complete=True)
    with ctx.open_store(create=False) as store:
        roots = [store.resolve(r, ctx.manifest.compute_sha256) for r in refs] if refs else \
            fmt.recorded_artifacts(store)
        if not roots:
            raise InputError(f"store {ctx.store} holds no recorded artifact to export",
                             "deposit first (`kvgraft deposit FILE.jsonl`)")
        wanted: dict[str, None] = {}  # insertion-ordered set: parents before their links
        for sha in roots:
            for link, _ in store.load_chain(sha):  # each re-hashed: a damaged object is never exported
                wanted.setdefault(link)
        first = _recording_lines(tree, set(wanted))
        unrecorded = [s for s in wanted if s not in first]
        if unrecorded:
            raise InputError(f"artifact {unrecorded[0][:16]}... is recorded by no line of ledger {ctx.ledger}, so "
                             "the bundle could not prove where it came from"
                             + (f" (and {len(unrecorded) - 1} more)" if len(unrecorded) > 1 else ""),
                             "pass the ledger that recorded it with --ledger, or deposit it again")
        rows = [fmt.listing_row(store, sha, first[sha]) for sha in sorted(wanted)]
        objects = {sha: store.object_path(sha) for sha in wanted}
        seqs = sorted(set(first[s] for s in wanted))
        cp = tree.checkpoint(origin)
        proofs = merkle.MerkleTree(tree.leaves)
        lines = []
        for s in seqs:
            proof = proofs.inclusion_proof(s, cp.size)
            merkle.verify_inclusion(s, cp.size, tree.leaves[s], proof, cp.root)  # never hand out a bad proof
            lines.append({"seq": s, "proof": [h.hex() for h in proof]})
        text = cp.body() if signer is None else sign(cp.body(), signer)
        listing = {"format": fmt.FORMAT, "version": fmt.VERSION, "artifacts": rows, "provenance": {"lines": lines}}
        raw_lines = b"".join(tree.lines[s] + b"\n" for s in seqs)
        sha = fmt.write_bundle(output, listing, objects, text.encode("utf-8"), raw_lines)
    arts = [{"sha256": r["sha256"], "problem_ids": [e["problem_id"] for e in r["entries"]],
             "file_bytes": r["file_bytes"], "recorded_by": r["recorded_by"]} for r in rows]
    return ExportReport(str(output), sha, Path(output).stat().st_size, arts, seqs,
                        {"origin": origin, "size": cp.size, "root": cp.root.hex(), "signed": signer is not None})


def _local_only(ctx: RunContext, doing: str, then: str) -> None:
    """Bundles are made from and into a local store (the store package's SQL reads and renames are local)."""
    remote = getattr(ctx, "remote", None)
    if remote:
        raise InputError(f"cannot {doing} remote store {remote} with a bundle",
                         f"use a local store (--store DIR), and `kvgraft store {then}` to sync it with {remote}")


def _recording_lines(tree: LedgerTree, wanted: set[str]) -> dict[str, int]:
    """The first line (0-based) that records each wanted artifact."""
    first: dict[str, int] = {}
    for i, raw in enumerate(tree.lines):
        try:
            entry = jsonio.loads(raw)
        except ValueError:  # `kvgraft verify` reports it; it records nothing
            continue
        for sha in recorded_by(entry) & wanted:
            first.setdefault(sha, i)
        if len(first) == len(wanted):
            break
    return first


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


def import_bundle(ctx: RunContext, bundle: Path, *, keys: list[str] | None = None,
                  keep_foreign: bool = False) -> ImportReport:
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
        _check_pins(staged, ctx.manifest.compute_sha256, keep_foreign)
        facts = fmt.check_objects(staged)
        _check_index_rows(staged, facts)
        _check_against_store(staged, ctx)
        return _write(ctx, staged, checkpoint, keep_foreign, Path(bundle))
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
            raise ArtifactError(f"{where}: {e.message}", "a --key import needs a checkpoint signed at export "
                                "(`kvgraft store export --key SIGNER.key`)") from None
    lines, tail = ledger.split_lines(staged.lines)
    listed = prov["lines"]
    lw = f"{src}: entry {fmt.LINES!r}"
    if tail or len(lines) != len(listed):
        raise ArtifactError(f"{lw} holds {len(lines)} complete lines{' and a torn tail' if tail else ''}, the "
                            f"listing proves {len(listed)}")
    entries: dict[int, dict] = {}
    for i, (raw, ln) in enumerate(zip(lines, listed)):
        at = f"{lw} line {i + 1} (ledger line {ln['seq'] + 1})"
        try:
            merkle.verify_inclusion(ln["seq"], cp.size, merkle.leaf_hash(raw), [bytes.fromhex(h) for h in ln["proof"]],
                                    cp.root)
        except CheckFailed as e:
            raise IntegrityError(f"{at}: not in the ledger the checkpoint commits to ({e.message})",
                                 "the line, its proof or the checkpoint was changed; fetch the bundle again") from None
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
            what = "is not among the provenance lines" if entry is None else \
                f"(kind {str(entry.get('kind'))[:40]!r}) does not record this artifact"
            raise ArtifactError(f"{src}: entry {a['path']!r}: its recording ledger line {a['recorded_by'] + 1} {what}")
        used.add(a["recorded_by"])
    if set(entries) - used:
        raise ArtifactError(f"{lw}: ledger line {min(set(entries) - used) + 1} records no artifact of the bundle")
    return {"sha256": sha256_bytes(staged.checkpoint), "origin": cp.origin, "size": cp.size, "root": cp.root.hex(),
            "signed_by": signed_by}


def _check_pins(staged: fmt.Staged, pin: str, keep_foreign: bool) -> None:
    """Refuse artifacts made under another compute pin unless they are to be kept for later (checked on the
    listing, before any object is re-hashed; check_objects then holds each artifact to its listed pin)."""
    foreign = [a for a in staged.artifacts if a["manifest_sha256"] != pin]
    if foreign and not keep_foreign:
        a = foreign[0]
        raise InputError(f"{staged.source}: entry {a['path']!r} was made under compute pin "
                         f"{a['manifest_sha256'][:16]}..., this manifest's is {pin[:16]}..."
                         + (f" ({len(foreign)} of {len(staged.artifacts)} artifacts are)" if len(foreign) > 1 else ""),
                         "import with the manifest they were made under, or pass --keep-foreign to store them for "
                         "later (no run of this manifest grafts them)")


def _check_index_rows(staged: fmt.Staged, facts: dict[str, fmt.ObjectFacts]) -> None:
    """Each index key must be the one the artifact's own tokens give under its pin, and a library row must be a
    verified root's with the key of its own problem text: a bundle cannot point a prefix at other bytes."""
    from ..engine.engine import token_ids_sha256

    for a in staged.artifacts:
        f, pin, where = facts[a["sha256"]], a["manifest_sha256"], f"{staged.source}: entry {a['path']!r}"
        ids = token_ids_sha256(f.token_ids)
        want = prefix_key(pin, ids) if f.parent is None else link_key(pin, f.parent, ids)
        for e in a["entries"]:
            if e["key"] != want:
                raise ArtifactError(f"{where}: index entry {e['problem_id'][:60]!r} has key {e['key'][:16]}..., the "
                                    f"artifact's tokens under its pin give {want[:16]}...")
        lib = a.get("library")
        if lib is None:
            continue
        if f.parent is not None or not any(e["verified"] for e in a["entries"]):
            raise ArtifactError(f"{where}: a library row belongs to a verified root artifact only")
        if lib["problem_key"] != problem_key(pin, normalize_key(lib["problem"])):
            raise ArtifactError(f"{where}: the library row's problem_key is not the key of its problem text")


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
                raise ArtifactError(f"{where}: a chain link whose parent {p[:16]}... is neither in the bundle nor in "
                                    f"store {ctx.store}", "export the link again: an export brings its parents")
            for e in a["entries"] if store else []:
                got = store.lookup_key(e["key"])
                if got is not None and got.artifact != a["sha256"]:
                    raise CheckFailed(f"{where}: store {ctx.store} maps the same prefix under the same pin "
                                      f"({e['problem_id'][:60]!r}) to artifact {got.artifact[:16]}...: the two "
                                      "machines did not compute the same bytes",
                                      "compare the two manifests' kernel flags and versions; import into another "
                                      "store to keep both")
    finally:
        if store is not None:
            store.close()


def _write(ctx: RunContext, staged: fmt.Staged, checkpoint: dict, keep_foreign: bool, bundle: Path) -> ImportReport:
    """Move the checked objects into the store, index them, and record the import (marking them recorded under the
    ledger's append lock). A failure here (disk full) leaves complete, indexed, unrecorded objects, as a failed
    deposit does (store/local.py)."""
    report = ImportReport(str(bundle), staged.sha256, str(ctx.store), str(ctx.ledger), checkpoint)
    outputs: dict[str, Any] = {}
    pin = ctx.manifest.compute_sha256
    with ctx.open_store() as store:
        for a in sorted(staged.artifacts, key=lambda a: (a["start_position"], a["sha256"])):
            sha, dest = a["sha256"], store.object_path(a["sha256"])
            status = "existing" if store.has_object(sha) else "imported"
            if status == "imported":
                fmt.place(staged.objects[sha], dest)
            for e in a["entries"]:
                store.index(sha, payload_bytes=a["payload_bytes"], key=e["key"], problem_id=e["problem_id"],
                            num_tokens=a["num_tokens"], model_sha256=a["model_sha256"],
                            manifest_sha256=a["manifest_sha256"], verified=e["verified"])
            lib = a.get("library")
            if lib is not None:
                store.add_to_library(sha, lib["problem_id"], a["manifest_sha256"], a["num_tokens"], lib)
            file_sha = a["file_sha256"] if status == "imported" else sha256_file(dest)
            outputs[f"artifact.{sha}"] = {**digest(sha), "path": ctx.rel(dest), "file_sha256": file_sha,
                                          "status": status, "compute_sha256": a["manifest_sha256"]}
            report.artifacts.append({"sha256": sha, "status": status, "foreign": a["manifest_sha256"] != pin,
                                     "problem_ids": [e["problem_id"] for e in a["entries"]],
                                     "file_sha256": file_sha, "path": str(dest)})
        entry = ctx.entry_base()
        entry.update(
            inputs={"bundle": {**digest(staged.sha256), "name": bundle.name, "bytes": staged.bytes},
                    "listing": digest(staged.listing_sha256),
                    "provenance": {**digest(sha256_bytes(staged.lines)),
                                   "lines": [ln["seq"] for ln in staged.listing["provenance"]["lines"]]},
                    "checkpoint": {**digest(checkpoint["sha256"]), **{k: v for k, v in checkpoint.items()
                                                                        if k != "sha256"}},
                    "settings": {"keep_foreign": keep_foreign}},
            outputs={**outputs, "counts": {s: sum(r["status"] == s for r in report.artifacts)
                                           for s in ("imported", "existing")}
                     | {"artifacts": len(report.artifacts), "foreign": sum(r["foreign"] for r in report.artifacts)}},
        )
        shas = [a["sha256"] for a in staged.artifacts]
        written = ledger.append(ctx.ledger, "import", entry, after=lambda _: store.mark_recorded(shas))
    report.ledger_seq = written["seq"]
    return report
