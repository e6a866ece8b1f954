"""Several solutions in one context, still exact: chains of artifacts.

A cache prefilled from ``A`` and then ``B`` is not ``A``'s artifact followed by ``B``'s artifact computed on its
own: ``B`` would sit at the wrong positions and would not have attended to ``A``. A chain link is ``B`` prefilled
on ``A``'s cache, in place: its artifact names ``A`` as its parent, starts at ``A``'s length and holds only its own
segment of each full layer (and the window state of each sliding layer). Restoring the chain fills one cache with
the root's and then each link's layers. Links are content-addressed and indexed by (parent, segment), so a chain
that recurs is restored from the store without a single prefill token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..artifacts import format as kvg
from ..engine.engine import Engine, tensor_sha256, token_ids_sha256
from ..errors import IntegrityError
from ..store.local import LibraryHit, Store, check_chain, link_key


@dataclass
class Chain:
    """A chain's links, root first, each (identity, artifact); what building it cost."""

    links: list[tuple[str, kvg.Artifact]] = field(default_factory=list)
    prefilled_tokens: int = 0  # tokens prefilled now for links the store did not have
    new_links: list[tuple[str, str]] = field(default_factory=list)  # (index key, identity) deposited now

    @property
    def shas(self) -> list[str]:
        return [sha for sha, _ in self.links]

    @property
    def artifacts(self) -> list[kvg.Artifact]:
        return [a for _, a in self.links]

    @property
    def num_tokens(self) -> int:
        return sum(a.num_tokens for a in self.artifacts)


def hit_fields(hit: LibraryHit) -> dict[str, str]:
    """A library entry's values for the prompt templates' placeholders."""
    return {"id": hit.problem_id, "problem": hit.problem, "solution": hit.solution, "answer": hit.answer or ""}


def segment_ids(engine: Engine, hit: LibraryHit) -> list[int]:
    """A link's tokens: a library entry rendered as a later part of the context (engine.prompts), without BOS."""
    return engine.encode(engine.prompts.link_text(hit_fields(hit)))


def _check_bound(hit: LibraryHit, sha: str, art: kvg.Artifact, ids: list[int], parent: str | None) -> None:
    """Refuse an index row that names an artifact other than the one its text makes. The bytes always re-hash to
    their identity, but which identity a library row or link key names is only a label (an edited index, a lying
    remote batch): grafting it would put another problem's solution in the context while the ledger says this one."""
    if art.token_ids != ids or art.parent != parent:
        raise IntegrityError(
            f"the library entry {hit.problem_id!r} names artifact {sha[:16]}..., which holds other tokens than its "
            f"problem and solution render to{' after its parent' if parent else ''}: the store's index was altered",
            "rebuild the index from trusted deposits (or re-import a checked bundle); docs/REMOTE.md for remote stores",
        )


def build_chain(store: Store, engine: Engine, hits: list[LibraryHit], level: int = 3) -> Chain:
    """The chain of ``hits`` in order (the first is a root artifact from the library), depositing each missing link
    once. Every artifact read from the store is re-hashed; every link is checked to follow the one before."""
    chain = Chain()
    manifest_sha = engine.manifest.machine_compute_sha256
    for hit in hits:
        if not chain.links:
            _, root = store.load(hit.artifact)
            kvg.check_compatible(root.meta, engine.compatibility(0), hit.artifact)
            _check_bound(hit, hit.artifact, root, engine.prefix_ids(engine.prompts.root_text(hit_fields(hit))), None)
            chain.links.append((hit.artifact, root))
            continue
        parent = chain.links[-1][0]
        ids = segment_ids(engine, hit)
        key = link_key(manifest_sha, parent, token_ids_sha256(ids))
        existing = store.lookup_key(key)
        if existing is not None and store.has_object(existing.artifact):
            _, art = store.load(existing.artifact)
            _check_bound(hit, existing.artifact, art, ids, parent)
            chain.links.append((existing.artifact, art))
            continue
        start = chain.num_tokens
        cache, last = engine.prefill(ids, cache=engine.restore_chain(chain.artifacts))
        payload = kvg.encode(
            ids, engine.capture(cache, start), engine.artifact_meta(tensor_sha256(last), start, parent)
        )
        sha = kvg.payload_identity(payload)
        store.put(
            sha,
            payload,
            key=key,
            problem_id=f"{hit.problem_id}@{parent[:12]}",
            num_tokens=len(ids),
            model_sha256=engine.hashes.model_sha256,
            manifest_sha256=manifest_sha,
            verified=True,
            level=level,
        )
        chain.links.append((sha, kvg.decode(payload, sha)))  # sha was computed from these bytes just above
        chain.prefilled_tokens += len(ids)
        chain.new_links.append((key, sha))
    check_chain(chain.links, str(store.root))
    for sha, art in chain.links[1:]:
        kvg.check_compatible(art.meta, engine.compatibility(art.start), sha)
    return chain
