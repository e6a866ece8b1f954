"""What the library holds for a problem, under one compute pin: an exact hit (the same normalized problem text was
deposited and verified), else the top-k related verified solutions, ranked by bm25 over problems with bounded work
(store/search.py). docs/RETRIEVAL.md: what the normalization does, and the recall and cost measured up to 1M entries."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..eval.problems import normalize_key
from ..store.local import LibraryHit, Store, problem_key


@dataclass
class Found:
    """The library's answer for one problem: ``kind`` is exact, related or none; ``hits`` best first."""

    kind: str
    hits: list[LibraryHit] = field(default_factory=list)


def find(store: Store, problem: str, manifest_sha256: str, k: int = 1, min_score: float | None = None) -> Found:
    """Look a problem up: exact hit first, else up to ``k`` related solutions (relevance -bm25 >= ``min_score``)."""
    exact = store.library_exact(problem_key(manifest_sha256, normalize_key(problem)))
    if exact is not None:
        return Found("exact", [exact])
    related = store.library_search(problem, manifest_sha256, k, min_score)
    return Found("related", related) if related else Found("none")
