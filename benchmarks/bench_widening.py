"""Widening the library: does a store 100x larger cost more per problem? Stores of ~30,000, ~300,000 and
>= 3,000,000 stored tokens (91.6x the embedded model's 32,768-position window), filled with real deposits of the
embedded model, measured side by side in one run (these machines are shared and noisy: compare the ratios, not the
times). For the same query set, in every store:

  retrieval    library.retrieval.find (exact hit by problem key, else FTS5 bm25), as `kvgraft solve` calls it
  graft        library.chain.build_chain (Store.load: read the object, re-hash it against its identity, parse; and
               the compatibility check) + engine.restore_chain, as solve grafts a hit. Measured COLD: the in-process
               verified cache (store.local.VERIFIED) is off (KVGRAFT_VERIFIED_CACHE=0) and cleared, so every graft
               reads and re-hashes its object (the OS page cache is warm: one untimed pass first)
  solve RSS    the peak RSS of a fresh `kvgraft solve QUERIES --json --k 1` process over the same queries (os.wait4's
               ru_maxrss of that child alone), and its total wall time
  stats        `kvgraft store stats --json`: stored tokens and tokens / context window

Usage:
    python benchmarks/bench_widening.py --store-root /work/widening-store [--reuse] [--fill-only]
                                     [--sizes 30000 300000 3000000] [--queries 50] [--repeat 10] [--solve-repeat 3]

The fill: problems generated from a seed (a running sum, a polynomial by Horner's rule, a product modulo m; each
statement and worked solution 1,000-1,400 characters, the tokenizer is byte-level: about a token a character)
with real MATH problems mixed in (every 7th problem, from data/math500/math500.jsonl when present, those whose
worked solution states a final answer). Every solution is checked by kvgraft's own verify_solution; each store is
the first problems of the same deposit order until it holds its size in tokens, deposited by runs.deposit.deposit
(the default manifest, one engine, chunks of --chunk problems written under STORE_ROOT/problem-chunks/ so each
ledger line names a file that is there). Each store has its own ledger (STORE_ROOT/sN.ledger.jsonl). An interrupted
fill resumes with --reuse (a store's entries are the first problems of the order); --reuse with full stores only
measures. Queries: half exact hits (problems of the smallest store, so in every store), half new problems of the
same families (related hits).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import write_json

# Cold grafts: the verified cache off in this process and in every child (set before kvgraft reads it).
os.environ["KVGRAFT_VERIFIED_CACHE"] = "0"

REPO = Path(__file__).resolve().parent.parent
MATH500 = REPO / "data" / "math500" / "math500.jsonl"
MATH500_EVERY = 7  # every 7th problem of the order is a MATH problem (while there are unused ones)

CONTEXTS = [
    ("A bakery counts the loaves of bread sold each day", "daily loaf counts", "number of loaves"),
    (
        "A weather station logs the rainfall in millimetres for each storm",
        "rainfall readings",
        "rainfall in millimetres",
    ),
    ("A warehouse weighs each crate that arrives, in kilograms", "crate weights", "weight in kilograms"),
    ("A library records how many books are returned at each branch", "returned-book counts", "number of books"),
    (
        "A cyclist notes the distance ridden on each training day, in kilometres",
        "daily distances",
        "distance in kilometres",
    ),
    ("An orchard picks apples from each row of trees", "apples picked per row", "number of apples"),
    ("A school tallies the votes cast in each classroom", "classroom vote tallies", "number of votes"),
    (
        "A power meter reports the energy used each hour, in watt-hours",
        "hourly energy readings",
        "energy in watt-hours",
    ),
    ("A ferry counts the passengers on each crossing", "passenger counts", "number of passengers"),
    ("A beekeeper harvests honey from each hive, in grams", "honey yields", "honey in grams"),
    ("A shop records the coins in each till drawer", "coin counts", "number of coins"),
    ("A survey team measures the length of each fence segment, in metres", "segment lengths", "length in metres"),
    ("A hospital logs the minutes each patient waits", "waiting times", "waiting time in minutes"),
    ("A printer counts the pages printed by each office", "page counts", "number of pages"),
    ("A farm weighs the milk from each cow, in litres", "milk yields", "milk in litres"),
    ("A museum counts the visitors entering each gallery", "gallery visitor counts", "number of visitors"),
]


def _sum_problem(rng: random.Random, target: int) -> tuple[str, str, str]:
    subject, items, quantity = rng.choice(CONTEXTS)
    nums: list[int] = []
    while True:
        nums.append(rng.randint(10, 9999))
        problem = f"{subject}. The {items}, in order, are: {', '.join(map(str, nums))}. What is the total {quantity}?"
        steps, total = [f"Start with the first value, {nums[0]}."], nums[0]
        for x in nums[1:]:
            steps.append(f"{total} + {x} = {total + x}.")
            total += x
        solution = (
            f"We add the {items} one at a time, keeping a running total.\n"
            + "\n".join(steps)
            + f"\nThe total {quantity} is $\\boxed{{{total}}}$.\nThe answer is: {total}"
        )
        if len(problem) + len(solution) >= target:
            return problem, solution, str(total)


def _horner_problem(rng: random.Random, target: int) -> tuple[str, str, str]:
    x = rng.randint(2, 9)
    coeffs: list[int] = []
    while True:
        coeffs.append(rng.randint(-9, 9) or 1)
        deg = len(coeffs) - 1
        terms = " + ".join(f"({c}) x^{{{deg - i}}}" for i, c in enumerate(coeffs))
        problem = f"Let $p(x) = {terms}$. Compute $p({x})$ exactly, using Horner's rule."
        r, steps = coeffs[0], [f"Start with the leading coefficient: $r = {coeffs[0]}$."]
        for c in coeffs[1:]:
            steps.append(f"Multiply by {x} and add {c}: $r = {r} \\cdot {x} + ({c}) = {r * x + c}$.")
            r = r * x + c
        solution = (
            "Horner's rule evaluates the polynomial from the leading coefficient down.\n"
            + "\n".join(steps)
            + f"\nSo $p({x}) = \\boxed{{{r}}}$.\nThe answer is: {r}"
        )
        if len(problem) + len(solution) >= target or len(coeffs) > 400:
            return problem, solution, str(r)


def _modprod_problem(rng: random.Random, target: int) -> tuple[str, str, str]:
    m = rng.choice([97, 101, 103, 107, 109, 113, 127, 131, 137, 139, 149, 151, 997, 1009])
    nums: list[int] = []
    while True:
        nums.append(rng.randint(2, 999))
        product = " \\cdot ".join(map(str, nums))
        problem = f"What is the remainder when the product ${product}$ is divided by {m}?"
        r, steps = nums[0] % m, [f"Start with ${nums[0]} \\equiv {nums[0] % m} \\pmod{{{m}}}$."]
        for x in nums[1:]:
            steps.append(f"Multiply by {x}: ${r} \\cdot {x} = {r * x} \\equiv {r * x % m} \\pmod{{{m}}}$.")
            r = r * x % m
        solution = (
            f"Reduce modulo {m} after every multiplication.\n"
            + "\n".join(steps)
            + f"\nThe remainder is $\\boxed{{{r}}}$.\nThe answer is: {r}"
        )
        if len(problem) + len(solution) >= target:
            return problem, solution, str(r)


FAMILIES = [("sum", _sum_problem), ("horner", _horner_problem), ("modprod", _modprod_problem)]


class Problems:
    """The deposit order: problem i is the same for a seed, whatever else is asked for."""

    def __init__(self, seed: int, chars: tuple[int, int], math500: Path | None):
        self.seed, self.chars = seed, chars
        self.math: list[dict] = []
        if math500 is not None and math500.is_file():
            from kvgraft_cli.eval import answers

            rows = [json.loads(line) for line in math500.read_text().splitlines() if line.strip()]
            order = list(range(len(rows)))
            random.Random(f"{seed}:math500").shuffle(order)
            for j in order:
                q, a = rows[j]["question"], rows[j]["answer"]
                ans = answers.extract(a)
                if ans is not None and q.strip():
                    self.math.append({"id": f"math500-{j}", "problem": q, "solution": a, "answer": ans})

    def __call__(self, i: int) -> dict:
        if i % MATH500_EVERY == 3 and i // MATH500_EVERY < len(self.math):
            return self.math[i // MATH500_EVERY]
        rng = random.Random(f"{self.seed}:{i}")
        name, make = FAMILIES[rng.randrange(len(FAMILIES))]
        problem, solution, answer = make(rng, rng.randint(*self.chars))
        return {"id": f"w{self.seed}-{i}-{name}", "problem": problem, "solution": solution, "answer": answer}


def _verified(rec: dict) -> bool:
    from kvgraft_cli.eval.problems import Problem, verify_solution

    p = Problem(0, rec["id"], rec["problem"], rec["solution"], rec["answer"], "")
    return verify_solution(p).status == "verified"


def _store_paths(root: Path, size: int) -> tuple[Path, Path]:
    return root / f"s{size}", root / f"s{size}.ledger.jsonl"


def _store_tokens_entries(store: Path) -> tuple[int, int]:
    from kvgraft_cli.store.local import Store

    if not (store / "index.sqlite").is_file():
        return 0, 0
    with Store(store, create=False) as s:
        st = s.stats()
    return st["tokens"], st["entries"]


def fill(root: Path, sizes: list[int], problems: Problems, chunk: int) -> dict:
    """Deposit the first problems of the order into each store until it holds its size in tokens (resuming a
    partial store). Returns per store: seconds, tokens and artifacts deposited now."""
    from kvgraft_cli.config.manifest import load_manifest
    from kvgraft_cli.engine.engine import load_engine
    from kvgraft_cli.eval.problems import Problem
    from kvgraft_cli.runs.context import RunContext
    from kvgraft_cli.runs.deposit import deposit, render_prefix

    manifest = load_manifest(None)
    engine = None
    template = manifest.prompt.prefix
    chunks_dir = root / "problem-chunks"
    chunks_dir.mkdir(parents=True, exist_ok=True)
    done_info, projected = {}, False
    for size in sorted(sizes):
        store, ledger = _store_paths(root, size)
        tokens, i = _store_tokens_entries(store)
        if tokens >= size:
            print(f"store {store}: {tokens:,} tokens in {i:,} artifacts, full (reused)", flush=True)
            continue
        if engine is None:
            engine = load_engine(manifest)
        ctx = RunContext.make(manifest, store, ledger)
        t0, tok0, n0 = time.perf_counter(), tokens, i
        while tokens < size:
            # The next chunk: whole problems until the store would hold its size (token counts made as deposit will).
            batch, need = [], size - tokens
            while len(batch) < chunk and need > 0:
                rec = problems(i + len(batch))
                if not _verified(rec):  # never happens for generated problems; MATH ones were filtered
                    raise SystemExit(f"problem {rec['id']} does not verify")
                p = Problem(0, rec["id"], rec["problem"], rec["solution"], rec["answer"], "")
                need -= len(engine.prefix_ids(render_prefix(template, p), where=rec["id"]))
                batch.append(rec)
            path = chunks_dir / f"s{size}-{i:06d}.jsonl"
            path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in batch))
            report = deposit(ctx, path, engine=engine)
            t = report.totals()
            if t["deposited"] + t["existing"] != len(batch):
                raise SystemExit(f"{path}: {t} (expected {len(batch)} deposited)")
            i += len(batch)
            tokens += t["tokens"]
            el = time.perf_counter() - t0
            rate = (tokens - tok0) / el
            print(
                f"  s{size}: {i:,} artifacts, {tokens:,} tokens, {el:.0f} s, {rate:,.0f} tokens/s; "
                f"this store done in ~{(size - tokens) / rate / 60:.1f} min",
                flush=True,
            )
            if not projected:  # the first batch's rate: what the whole fill will take
                rest = sum(max(0, s - _store_tokens_entries(_store_paths(root, s)[0])[0]) for s in sizes)
                print(
                    f"  projected: {rest:,} tokens still to deposit in all stores at {rate:,.0f} tokens/s "
                    f"= ~{rest / rate / 60:.0f} min",
                    flush=True,
                )
                projected = True
        done_info[size] = {"seconds": time.perf_counter() - t0, "tokens": tokens - tok0, "artifacts": i - n0}
        print(
            f"store {store}: {tokens:,} tokens in {i:,} artifacts ({tokens - tok0:,} deposited now in "
            f"{done_info[size]['seconds']:.0f} s)",
            flush=True,
        )
    return done_info


def make_queries(root: Path, sizes: list[int], problems: Problems, n: int, seed: int) -> Path:
    """Half exact hits (problems the smallest store holds: so every store does), half new problems (related)."""
    from kvgraft_cli.store.local import Store

    small, _ = _store_paths(root, min(sizes))
    with Store(small, create=False) as s:
        held = sorted({e.problem_id for e in s.entries()})
    rng = random.Random(f"{seed}:queries")
    by_id = {}
    i = 0
    while len(by_id) < len(held):  # the problems of the smallest store, by their ids
        rec = problems(i)
        if rec["id"] in held:
            by_id[rec["id"]] = rec
        i += 1
    n_exact = min(n // 2, len(held))
    exact = [by_id[pid] for pid in rng.sample(held, n_exact)]
    related = []
    j = 0
    while len(related) < n - n_exact:
        # New problems of the same families (index far past any fill), never MATH ones (those are in the fill).
        rec = problems(10_000_000 + 7 * j)  # 10,000,000 % 7 != 3: never a MATH slot
        related.append(rec)
        j += 1
    path = root / f"queries-{n}.jsonl"
    lines = [{"id": f"exact-{k}", "problem": r["problem"], "answer": r["answer"]} for k, r in enumerate(exact)]
    lines += [{"id": f"related-{k}", "problem": r["problem"], "answer": r["answer"]} for k, r in enumerate(related)]
    rng.shuffle(lines)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in lines))
    return path


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def measure_inprocess(stores: dict[int, Path], queries: list[dict], repeat: int) -> dict:
    """Retrieval and cold graft times, every query in every store, interleaved (store order rotated per query)."""
    from kvgraft_cli.config.manifest import load_manifest
    from kvgraft_cli.engine.engine import load_engine
    from kvgraft_cli.library.chain import build_chain
    from kvgraft_cli.library.retrieval import find
    from kvgraft_cli.store.local import VERIFIED, Store

    manifest = load_manifest(None)
    engine = load_engine(manifest)
    pin = manifest.compute_sha256
    opened = {n: Store(p, create=False) for n, p in stores.items()}
    sizes = sorted(opened)
    res = {
        n: {
            "retrieval": [],
            "retrieval_exact": [],
            "retrieval_related": [],
            "graft_exact": [],
            "graft_related_per_1k": [],
            "kinds": {},
        }
        for n in sizes
    }
    try:
        for r in range(repeat + 1):  # round 0 warms the OS page cache and SQLite's; not timed
            # Each pass: every lookup first (as bench_retrieval.py times them), then every graft of what was found.
            found = {}
            for qi, q in enumerate(queries):
                for n in sizes[(qi + r) % len(sizes) :] + sizes[: (qi + r) % len(sizes)]:
                    t0 = time.perf_counter()
                    f = find(opened[n], q["problem"], pin, 1)
                    t_find = time.perf_counter() - t0
                    if not f.hits:
                        raise SystemExit(f"query {q['id']}: nothing found in store s{n}")
                    found[qi, n] = f
                    if r == 0:
                        res[n]["kinds"][f.kind] = res[n]["kinds"].get(f.kind, 0) + 1
                    else:
                        res[n]["retrieval"].append(t_find)
                        res[n][f"retrieval_{f.kind}"].append(t_find)
            for qi in range(len(queries)):
                for n in sizes[(qi + r) % len(sizes) :] + sizes[: (qi + r) % len(sizes)]:
                    f = found[qi, n]
                    VERIFIED.clear()
                    t0 = time.perf_counter()
                    chain = build_chain(opened[n], engine, f.hits[:1])
                    engine.restore_chain(chain.artifacts)
                    t_graft = time.perf_counter() - t0
                    if r == 0:
                        continue
                    if f.kind == "exact":
                        res[n]["graft_exact"].append(t_graft)
                    else:
                        res[n]["graft_related_per_1k"].append(t_graft / f.hits[0].num_tokens * 1000)
    finally:
        for s in opened.values():
            s.close()
    return res


def _kvgraft() -> list[str]:
    exe = Path(sys.executable).with_name("kvgraft")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "kvgraft_cli"]


def solve_rss(store: Path, queries: Path, tmp: Path) -> tuple[int, float]:
    """Peak RSS (bytes) and summed per-problem wall time of one fresh `kvgraft solve` process."""
    out = tmp / "solve.out.json"
    with open(out, "wb") as fo:
        cmd = _kvgraft() + [
            "solve",
            str(queries),
            "--store",
            str(store),
            "--ledger",
            str(tmp / "solve.ledger.jsonl"),
            "--outputs",
            str(tmp / "solve.outputs.jsonl"),
            "--force",
            "--k",
            "1",
            "--json",
        ]
        p = subprocess.Popen(cmd, stdout=fo, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(p.pid, 0)
        err = p.stderr.read().decode(errors="replace")
        p.stderr.close()
        p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"kvgraft solve on {store} failed ({p.returncode}): {err[-2000:]}")
    totals = json.loads(out.read_text())["library"]["totals"]
    (tmp / "solve.ledger.jsonl").unlink(missing_ok=True)
    return usage.ru_maxrss * 1024, float(totals.get("wall_s") or 0.0)


def fts_segments(store: Path) -> int:
    """How many segments the library's FTS5 index is in (every term lookup visits each one)."""
    import sqlite3

    db = sqlite3.connect(f"file:{store / 'index.sqlite'}?mode=ro", uri=True)
    try:
        return db.execute("SELECT count(DISTINCT segid) FROM library_fts_idx").fetchone()[0]
    finally:
        db.close()


def store_stats(store: Path) -> dict:
    r = subprocess.run(
        _kvgraft() + ["store", "stats", "--store", str(store), "--json"], check=True, capture_output=True, text=True
    )
    return json.loads(r.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--store-root",
        type=Path,
        default=None,
        help="folder holding the stores (default: a temporary one, removed at the end)",
    )
    ap.add_argument("--reuse", action="store_true", help="use (and complete) the stores already in --store-root")
    ap.add_argument("--fill-only", action="store_true", help="fill the stores, measure nothing")
    ap.add_argument("--sizes", type=int, nargs="+", default=[30_000, 300_000, 3_000_000], help="store sizes in tokens")
    ap.add_argument("--queries", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=10, help="timed passes over the queries (retrieval, graft)")
    ap.add_argument("--solve-repeat", type=int, default=3, help="fresh solve processes per store (peak RSS: median)")
    ap.add_argument(
        "--chars",
        type=int,
        nargs=2,
        default=[1000, 1400],
        metavar=("MIN", "MAX"),
        help="statement + solution length of generated problems, in characters",
    )
    ap.add_argument("--chunk", type=int, default=100, help="problems per deposit run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--math500", type=Path, default=MATH500, help="real MATH problems to mix in ('' for none)")
    ap.add_argument("--json-out", type=Path, default=None, help="also write the figures as JSON")
    args = ap.parse_args()
    sizes = sorted(set(args.sizes))

    tmpdir = tempfile.TemporaryDirectory() if args.store_root is None else None
    root = Path(tmpdir.name) if tmpdir else args.store_root
    if root.exists() and any(root.iterdir()) and not args.reuse:
        raise SystemExit(f"{root} is not empty: pass --reuse to use (and complete) the stores there")
    root.mkdir(parents=True, exist_ok=True)
    problems = Problems(args.seed, tuple(args.chars), args.math500 if str(args.math500) else None)
    t0 = time.perf_counter()
    filled = fill(root, sizes, problems, args.chunk)
    fill_s = time.perf_counter() - t0
    du = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    print(f"fill: {fill_s:.0f} s this run; {root} holds {du / 1e9:.2f} GB", flush=True)
    if args.fill_only:
        return

    stores = {n: _store_paths(root, n)[0] for n in sizes}
    qpath = make_queries(root, sizes, problems, args.queries, args.seed)
    queries = [json.loads(line) for line in qpath.read_text().splitlines()]
    stats = {n: store_stats(p) for n, p in stores.items()}
    res = measure_inprocess(stores, queries, args.repeat)
    rss: dict[int, list[int]] = {n: [] for n in sizes}
    wall: dict[int, list[float]] = {n: [] for n in sizes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.solve_repeat):
            for n in sizes[r % len(sizes) :] + sizes[: r % len(sizes)]:
                peak, w = solve_rss(stores[n], qpath, Path(tmp))
                rss[n].append(peak)
                wall[n].append(w)

    rows = {}
    for n in sizes:
        x = res[n]
        rows[n] = {
            "tokens": stats[n]["tokens"],
            "artifacts": stats[n]["objects"],
            "library": stats[n]["library_entries"],
            "tokens_per_window": stats[n]["tokens_per_window"],
            "file_bytes": stats[n]["file_bytes"],
            "hits": x["kinds"],
            "retrieval_p50_ms": statistics.median(x["retrieval"]) * 1e3,
            "retrieval_p95_ms": _pct(x["retrieval"], 0.95) * 1e3,
            "retrieval_exact_p50_ms": statistics.median(x["retrieval_exact"]) * 1e3,
            "retrieval_related_p50_ms": statistics.median(x["retrieval_related"]) * 1e3,
            "graft_p50_ms": statistics.median(x["graft_exact"]) * 1e3 if x["graft_exact"] else float("nan"),
            "graft_related_ms_per_1k": (
                statistics.median(x["graft_related_per_1k"]) * 1e3 if x["graft_related_per_1k"] else float("nan")
            ),
            "solve_peak_rss_mb": statistics.median(rss[n]) / 2**20,
            "solve_wall_s": statistics.median(wall[n]),
            "fts_segments": fts_segments(stores[n]),
        }
    small, large = rows[sizes[0]], rows[sizes[-1]]
    ratio_keys = [
        "retrieval_exact_p50_ms",
        "retrieval_related_p50_ms",
        "retrieval_p95_ms",
        "graft_p50_ms",
        "graft_related_ms_per_1k",
        "solve_peak_rss_mb",
        "solve_wall_s",
        "fts_segments",
    ]
    ratios = {k: large[k] / small[k] if small[k] else float("nan") for k in ratio_keys}

    print(
        f"\n{len(queries)} queries ({small['hits']}), {args.repeat} timed passes, {args.solve_repeat} solve "
        f"processes per store; cold grafts (KVGRAFT_VERIFIED_CACHE=0)"
    )
    print(
        "| store tokens | artifacts | tokens / window | retrieval p50, exact hits | retrieval p50, related | "
        "retrieval p95 | graft p50 (exact hits) | graft, related (per 1k tokens) | solve peak RSS | solve wall "
        "| FTS5 segments |"
    )
    print("|" + "---:|" * 11)
    for n in sizes:
        r = rows[n]
        print(
            f"| {r['tokens']:,} | {r['artifacts']:,} | {r['tokens_per_window']:.2f}x "
            f"| {r['retrieval_exact_p50_ms']:.3f} ms | {r['retrieval_related_p50_ms']:.3f} ms "
            f"| {r['retrieval_p95_ms']:.3f} ms | {r['graft_p50_ms']:.2f} ms | {r['graft_related_ms_per_1k']:.2f} ms "
            f"| {r['solve_peak_rss_mb']:.1f} MiB | {r['solve_wall_s']:.2f} s | {r['fts_segments']} |"
        )
    print(
        f"| **ratio {large['tokens'] / small['tokens']:.0f}x tokens** | | | "
        + " | ".join(f"**{ratios[k]:.3f}**" for k in ratio_keys)
        + " |"
    )
    over = [
        k
        for k in ("retrieval_exact_p50_ms", "retrieval_related_p50_ms", "graft_p50_ms", "solve_peak_rss_mb")
        if not ratios[k] <= 1.05
    ]
    print(
        f"goal (ratio <= 1.05 for retrieval p50, graft p50, solve peak RSS; >= 90x the window): "
        f"{'MET' if not over and large['tokens_per_window'] >= 90 else 'NOT MET: ' + ', '.join(over)}"
        f"{'' if large['tokens_per_window'] >= 90 else ' (tokens/window < 90)'}"
    )
    if args.json_out:
        write_json(
            args.json_out,
            {
                "sizes": sizes,
                "rows": rows,
                "ratios": ratios,
                "fill": filled,
                "fill_s": fill_s,
                "disk_bytes": du,
                "queries": str(qpath),
            },
            **vars(args),
        )
    if tmpdir:
        tmpdir.cleanup()


if __name__ == "__main__":
    main()
