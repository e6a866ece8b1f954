"""Library lookups on real text at 10,000 to 1,000,000 entries (#26): recall, latency and the work each query does,
measured in one run.

    nice -n 10 python benchmarks/bench_retrieval.py [--sizes 10000 100000 1000000] [--k 4]
                                                 [--cache /tmp/kvgraft-bench-retrieval]

The library: 400 MATH-500 problems (data/math500, with their worked solutions; 100 more are held out as problems not
in the library) inserted at random positions among filler up to N entries. A filler problem is one sentence from each
of two or three library problems, every number redrawn and 30% of the words swapped for words drawn from the
problems' own vocabulary (library/variants.py): it reads like a problem and shares words and whole sentences with the
sources, so finding the source is not easy by construction. Its solution is two sentences of a library solution with
the numbers redrawn. Rows go in through Store._index_library_rows (index rows only: no model, no objects). A built
library is kept under --cache and reused (the 1,000,000-entry one takes minutes and ~2 GB); --rebuild starts over.

Queries, each through the same path as `kvgraft solve` (retrieval.find):
- formatting variants of each library problem (a whitespace respelling): must be exact hits on the source;
- near duplicates, every number changed (a variable renamed where the problem has no number): must never be exact;
  top-1 and top-k = the source;
- the held-out problems: what comes back and its relevance (-bm25), against the relevance at which near duplicates
  find their source: the evidence for `--min-score`.
Work per related lookup is counted by SQLite itself (statements via set_trace_callback, VM steps via the progress
handler) and by the search (index rows read, problems ranked). Latency: p50/p99 of wall time per lookup.
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import re
import shutil
import statistics
import time
from pathlib import Path

from kvgraft_cli.eval.problems import normalize_key
from kvgraft_cli.library.variants import change_all_numbers, filler, rename_variable, sentences, whitespace_variants
from kvgraft_cli.store.local import Store, problem_key

REPO = Path(__file__).resolve().parents[1]
PIN = "ab" * 32
HELD_OUT = 100
BATCH = 10_000
VERSION = "v3"  # of the library a cache holds: bump when fill() changes


def corpus(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(library problems, held-out problems) of MATH-500, split by a seeded draw."""
    rows = [json.loads(x) for x in (REPO / "data/math500/math500.jsonl").read_text().splitlines() if x.strip()]
    for i, r in enumerate(rows):
        r["id"] = f"m{i}"
    held = set(random.Random(seed).sample(range(len(rows)), HELD_OUT))
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def fill(store: Store, n: int, library: list[dict], seed: int = 0) -> None:
    """Index ``library`` at random positions among filler, n entries in all, in transactions of BATCH rows."""
    rng = random.Random(seed)
    pool = [sentences(r["question"]) for r in library]
    vocabulary = [w for r in library for w in re.findall(r"[A-Za-z]{2,}", r["question"])]
    solutions = [sentences(r["answer"])[:2] for r in library]
    slots = dict(zip(rng.sample(range(n), len(library)), library))
    for start in range(0, n, BATCH):
        rows = []
        for i in range(start, min(n, start + BATCH)):
            src = slots.get(i)
            if src is not None:
                rows.append(
                    {
                        "problem": src["question"],
                        "solution": src["answer"],
                        "problem_id": src["id"],
                        "problem_key": problem_key(PIN, normalize_key(src["question"])),
                    }
                )
                continue
            sol = " ".join(rng.choice(solutions))
            text = filler(pool, vocabulary, rng)
            rows.append(
                {
                    "problem": text,
                    "problem_key": problem_key(PIN, normalize_key(text)),
                    "problem_id": f"f{i}",
                    "solution": change_all_numbers(sol, rng) or sol,
                }
            )
        store._index_library_rows(PIN, rows, grams=False)
    with store._db:  # the sequence index in one sorted bulk load, as a store from before it is migrated
        store._db.execute("BEGIN IMMEDIATE")
        store._fill_grams()


def open_library(cache: Path, n: int, library: list[dict], rebuild: bool) -> tuple[Store, float | None]:
    """The n-entry library, built into ``cache`` unless a complete one is there; (store, build seconds or None)."""
    path = cache / f"library-{n}-{VERSION}"
    done = path / "complete"
    if rebuild or not done.exists():
        shutil.rmtree(path, ignore_errors=True)
        t0 = time.perf_counter()
        with Store(path) as s:
            fill(s, n, library)
        done.write_text(str(time.perf_counter() - t0))
    return Store(path, create=False), (None if not done.exists() else float(done.read_text()))


class Counter:
    """SQLite's own count of a lookup's work: statements started and VM instructions (in steps of STEP)."""

    STEP = 100

    def __init__(self, store: Store):
        self.statements = self.steps = 0
        store._db.set_trace_callback(self._statement)
        store._db.set_progress_handler(self._step, self.STEP)

    def _statement(self, _sql: str) -> None:
        self.statements += 1

    def _step(self) -> int:
        self.steps += self.STEP
        return 0

    def reset(self) -> tuple[int, int]:
        out = (self.statements, self.steps)
        self.statements = self.steps = 0
        return out


def lookup(store: Store, text: str, k: int, work_cls):
    """retrieval.find's two steps, with the search's own work record when this store's search keeps one."""
    exact = store.library_exact(problem_key(PIN, normalize_key(text)))
    if exact is not None:
        return "exact", [exact], None
    work = work_cls() if work_cls else None
    hits = store.library_search(text, PIN, k, work=work) if work_cls else store.library_search(text, PIN, k)
    return ("related" if hits else "none"), hits, work


def _masked(text: str) -> list[str]:
    """The words of ``text`` with every number as 0: equal for two texts that differ only in their numbers."""
    return ["0" if w.isdigit() else w for w in re.findall(r"[^\W_]+", text.lower())]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def measure(store: Store, library: list[dict], held: list[dict], k: int, seed: int = 1) -> dict:
    """Every query kind over every library / held-out problem; figures as a dict."""
    rng = random.Random(seed)
    work_cls = None
    if "work" in inspect.signature(store.library_search).parameters:
        from kvgraft_cli.store.search import Work as work_cls
    counter = Counter(store)
    out: dict = {
        "formatting": [0, 0],
        "near": {"n": 0, "exact": 0, "top1": 0, "topk": 0, "none": 0, "twin": 0},
        "held_none": 0,
    }
    for key in (
        "t_exact",
        "t_related",
        "statements",
        "steps",
        "own",
        "rows_read",
        "rows_ranked",
        "near_rel",
        "near_wrong_rel",
        "held_rel",
    ):
        out[key] = []
    for j, r in enumerate(library):
        v = whitespace_variants(r["question"])[j % 7]
        t0 = time.perf_counter()
        kind, hits, _ = lookup(store, v, k, work_cls)
        out["t_exact"].append(time.perf_counter() - t0)
        out["formatting"][0] += kind == "exact" and hits[0].problem_id == r["id"]
        out["formatting"][1] += 1
    counter.reset()
    for queries, role in ((library, "near"), (held, "held")):
        for r in queries:
            q = r["question"]
            if role == "near":
                q = change_all_numbers(q, rng) or rename_variable(q, rng) or q + " Assume $x > 0$."
            counter.reset()
            t0 = time.perf_counter()
            kind, hits, work = lookup(store, q, k, work_cls)
            dt = time.perf_counter() - t0
            statements, steps = counter.reset()
            if kind != "exact":
                out["t_related"].append(dt)
                out["statements"].append(statements)
                out["steps"].append(steps)
                if work is not None:
                    out["own"].append(work.statements)
                    out["rows_read"].append(work.rows_read)
                    out["rows_ranked"].append(work.rows_ranked)
            if role == "near":
                near = out["near"]
                near["n"] += 1
                near["exact"] += kind == "exact"
                near["none"] += kind == "none"
                ids = [h.problem_id for h in hits]
                near["top1"] += bool(ids) and ids[0] == r["id"] and kind != "exact"
                near["topk"] += r["id"] in ids and kind != "exact"
                if ids and ids[0] != r["id"] and kind != "exact" and _masked(hits[0].problem) == _masked(r["question"]):
                    near["twin"] += 1  # top-1 is a filler with the source's very words, other numbers
                if ids and kind != "exact":
                    (out["near_rel"] if ids[0] == r["id"] else out["near_wrong_rel"]).append(-hits[0].score)
            else:
                if hits and kind != "exact":
                    out["held_rel"].append(-hits[0].score)
                else:
                    out["held_none"] += 1
    store._db.set_trace_callback(None)
    store._db.set_progress_handler(None, 0)
    return out


def report(n: int, build: float | None, db_mb: float, m: dict, k: int) -> None:
    near = m["near"]
    t_rel = m["t_related"]
    t_ex = m["t_exact"]
    print(f"\n== {n:,} entries (index {db_mb:,.0f} MB" + (f", built in {build:.0f} s" if build else "") + ")")
    print(f"formatting variants exact on their source: {m['formatting'][0]}/{m['formatting'][1]}")
    print(
        f"near duplicates ({near['n']}): exact hits {near['exact']}, top-1 = source {near['top1']} "
        f"({100 * near['top1'] / near['n']:.1f}%), top-{k} contains source {near['topk']} "
        f"({100 * near['topk'] / near['n']:.1f}%), nothing found {near['none']}; top-1 a filler with the source's "
        f"very words and other numbers (indistinguishable by construction) {near['twin']}, so top-1 = source or "
        f"its twin {100 * (near['top1'] + near['twin']) / near['n']:.1f}%"
    )
    print(
        f"latency, exact lookups: p50 {pct(t_ex, 0.5) * 1e3:.2f} ms, p99 {pct(t_ex, 0.99) * 1e3:.2f} ms; "
        f"related lookups ({len(t_rel)}): p50 {pct(t_rel, 0.5) * 1e3:.2f} ms, p99 {pct(t_rel, 0.99) * 1e3:.2f} ms, "
        f"max {max(t_rel) * 1e3:.2f} ms"
    )
    print(
        "work per related lookup: "
        + (f"statements of its own max {max(m['own'])}; " if m["own"] else "")
        + f"statements SQLite ran, FTS5's own included, max {max(m['statements'])} (mean "
        f"{statistics.mean(m['statements']):.1f}); VM steps max {max(m['steps']):,} (p50 {pct(m['steps'], 0.5):,.0f})"
        + (
            f"; index rows read max {max(m['rows_read']):,} (p50 {pct(m['rows_read'], 0.5):,.0f}); "
            f"problems ranked max {max(m['rows_ranked'])}"
            if m["rows_read"]
            else ""
        )
    )
    nr, wr, hr = m["near_rel"], m["near_wrong_rel"], m["held_rel"]
    print(
        "relevance (-bm25) of the top hit: near duplicates on their source p1 {:.1f} p5 {:.1f} p50 {:.1f}; "
        "on another entry p50 {:.1f} (n={}); held-out problems p50 {:.1f} p95 {:.1f} p99 {:.1f} max {:.1f} "
        "(n={}, nothing found {})".format(
            pct(nr, 0.01),
            pct(nr, 0.05),
            pct(nr, 0.5),
            pct(wr, 0.5),
            len(wr),
            pct(hr, 0.5),
            pct(hr, 0.95),
            pct(hr, 0.99),
            max(hr or [float("nan")]),
            len(hr),
            m["held_none"],
        )
    )
    for t in (5, 10, 15, 20, 25, 30, 40):
        kept = sum(x >= t for x in nr) / max(1, near["n"])
        out_ = (sum(x < t for x in hr) + m["held_none"]) / max(1, len(hr) + m["held_none"])
        print(
            f"  --min-score {t}: near duplicates still served their source {100 * kept:.1f}%, "
            f"held-out problems given nothing {100 * out_:.1f}%"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/kvgraft-bench-retrieval"))
    ap.add_argument("--rebuild", action="store_true")
    args = ap.parse_args()
    library, held = corpus()
    for n in args.sizes:
        store, build = open_library(args.cache, n, library, args.rebuild)
        with store:
            db_mb = (store.root / "index.sqlite").stat().st_size / 1e6
            segments = store._db.execute("SELECT count(DISTINCT segid) FROM library_fts_idx").fetchone()[0]
            print(f"\n{n:,} entries: FTS5 index segments {segments}", end="")
            report(n, build, db_mb, measure(store, library, held, args.k), args.k)


if __name__ == "__main__":
    main()
