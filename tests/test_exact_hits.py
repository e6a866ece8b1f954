"""Exact means exact (#26 §1), on every MATH-500 problem and without a model: the library holds all 500 problems
(index rows only), and

- no near duplicate (one number changed, a sign flipped, a variable renamed, a condition added or removed; at least
  2,000 variants) is an exact hit;
- every formatting variant the normalization covers (whitespace: runs, newlines, tabs, no-break and other Unicode
  spaces, CRLF, padding) is an exact hit on its own problem.

docs/RETRIEVAL.md says what the normalization does and why each step keeps the meaning."""

from __future__ import annotations

import json
import random

import pytest
from conftest import MATH500

from kvgraft_cli.eval.problems import normalize_key
from kvgraft_cli.library.retrieval import find
from kvgraft_cli.library.variants import near_duplicates, whitespace_variants
from kvgraft_cli.store.local import Store, problem_key

PIN = "ab" * 32


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """A store whose library holds the 500 MATH-500 problems with their worked solutions."""
    rows = [json.loads(line) for line in MATH500.read_text().splitlines() if line.strip()]
    problems = [r["question"] for r in rows]
    store = Store(tmp_path_factory.mktemp("exact") / "store")
    store._index_library_rows(
        PIN,
        [
            {
                "problem": q,
                "problem_key": problem_key(PIN, normalize_key(q)),
                "solution": r["answer"],
                "problem_id": f"m{i}",
            }
            for i, (q, r) in enumerate(zip(problems, rows))
        ],
    )
    yield store, problems
    store.close()


def test_no_near_duplicate_is_an_exact_hit(library):
    store, problems = library
    keys = {" ".join(p.split()) for p in problems}  # spelled out, not normalize_key: the test must not trust it
    rng = random.Random(26)
    made: dict[str, int] = {}
    served = []
    for i, p in enumerate(problems):
        for _ in range(2):  # two draws of each edit: other numbers, other signs, other letters, other sentences
            for name, v in near_duplicates(p, rng).items():
                if " ".join(v.split()) in keys:
                    continue  # the edit happened to spell another library problem: an exact hit would be right
                made[name] = made.get(name, 0) + 1
                found = find(store, v, PIN, k=1)
                if found.kind == "exact":
                    served.append((i, name, v[:80]))
    assert sum(made.values()) >= 2000 and all(n >= 200 for n in made.values()), made
    assert served == [], f"{len(served)} of {sum(made.values())} near duplicates served as exact, e.g. {served[:3]}"
    print("near duplicates per edit:", made)


def test_formatting_variants_are_exact_hits_on_their_own_problem(library):
    store, problems = library
    missed = []
    for i, p in enumerate(problems):
        for v in whitespace_variants(p):
            found = find(store, v, PIN, k=1)
            if found.kind != "exact" or found.hits[0].problem_id != f"m{i}":
                missed.append((i, repr(v[:60])))
    assert missed == [], f"{len(missed)} formatting variants missed, e.g. {missed[:3]}"


def test_an_exact_hit_needs_the_same_compute_pin(library):
    store, problems = library
    assert find(store, problems[0], PIN).kind == "exact"
    assert find(store, problems[0], "cd" * 32).kind == "none"
