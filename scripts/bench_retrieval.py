"""Library lookups at scale: exact hits and bm25 retrieval in a store of N verified entries, measured side by side
for a small and a large library in one run (these machines are shared and noisy: compare the ratio, not the times).

    python scripts/bench_retrieval.py [--sizes 10000 1000000] [--queries 200] [--k 1 4]

Entries are synthetic (a seeded Zipf-like vocabulary of 50,000 words; problems of 20-60 words, solutions of 40-160),
inserted through the store's own library writer in transactions of 10,000 rows. No model is needed: the library
index is plain SQLite (the library table, its problem-key index, and the FTS5 index over problems and solutions).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from kvgraft_cli.eval.problems import normalize_key
from kvgraft_cli.store.local import Store, problem_key

PIN = "ab" * 32
VOCAB = 50_000


def _words(rng: random.Random, n: int) -> str:
    # Zipf-like: a few very common words, a long tail of rare ones (as in real text).
    return " ".join(f"w{int(VOCAB ** rng.random())}" for _ in range(n))


def fill(store: Store, n: int, seed: int = 0) -> list[str]:
    """Insert n library entries; return a sample of their problem texts (the queries)."""
    rng = random.Random(seed)
    sample = []
    batch = 10_000
    for start in range(0, n, batch):
        with store._db:
            store._db.execute("BEGIN IMMEDIATE")
            for i in range(start, min(n, start + batch)):
                problem = _words(rng, rng.randint(20, 60))
                solution = _words(rng, rng.randint(40, 160)) + f" The answer is: {i}"
                sha = f"{i:064x}"
                store._add_library(sha, f"p{i}", PIN, 100, {"problem_key": problem_key(PIN, normalize_key(problem)),
                                                           "problem": problem, "solution": solution,
                                                           "answer": str(i)})
                if len(sample) < 2000 and rng.random() < 2000 / n:
                    sample.append(problem)
    return sample


def measure(store: Store, problems: list[str], queries: int, ks: list[int], seed: int = 1) -> dict[str, float]:
    rng = random.Random(seed)
    picks = [rng.choice(problems) for _ in range(queries)]
    out = {}
    t = []
    for p in picks:  # exact hits: the same problem text
        t0 = time.perf_counter()
        hit = store.library_exact(problem_key(PIN, normalize_key(p)))
        t.append(time.perf_counter() - t0)
        assert hit is not None
    out["exact hit"] = statistics.median(t)
    for k in ks:  # related: a new problem that shares half its words with a stored one
        t = []
        for p in picks:
            words = p.split()
            q = " ".join(words[: len(words) // 2]) + " " + _words(rng, len(words) // 2)
            t0 = time.perf_counter()
            store.library_search(q, PIN, k)
            t.append(time.perf_counter() - t0)
        out[f"bm25 top-{k}"] = statistics.median(t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 1_000_000])
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 4])
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            with Store(Path(tmp) / f"s{n}") as store:
                t0 = time.perf_counter()
                problems = fill(store, n)
                build = time.perf_counter() - t0
                db_mb = (Path(tmp) / f"s{n}" / "index.sqlite").stat().st_size / 1e6
                results[n] = measure(store, problems, args.queries, args.k)
                print(f"{n:>9,} entries: built in {build:.1f} s, index {db_mb:,.0f} MB; "
                      + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in results[n].items()), flush=True)
    small, large = min(results), max(results)
    if small != large:
        print(f"median lookup time, {large:,} vs {small:,} entries (x{large // small:,} the entries):")
        for what in results[small]:
            print(f"  {what}: {results[large][what] * 1e3:.2f} ms vs {results[small][what] * 1e3:.2f} ms = "
                  f"{results[large][what] / results[small][what]:.1f}x")


if __name__ == "__main__":
    main()
