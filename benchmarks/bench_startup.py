"""Start-up time of the kvgraft CLI: wall seconds of `kvgraft --help`, `kvgraft verify ledger/reference.jsonl` and
`kvgraft graft -n 4` on the embedded tiny model, median of --rounds runs each.

    python benchmarks/bench_startup.py                          # this checkout
    python benchmarks/bench_startup.py --compare /path/to/old    # and an older checkout, alternated run by run

A checkout is a folder holding the ``kvgraft_cli`` package; each command runs as ``python -m kvgraft_cli`` with that
folder first on PYTHONPATH, so both run in this environment (same torch, transformers, typer). The store the graft
reads is deposited once, by this checkout, in a temporary folder. Nothing is printed but the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PINS = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"}


def run(tree: Path, args: list[str], cwd: Path) -> float:
    env = {**os.environ, **PINS, "PYTHONPATH": str(tree)}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "kvgraft_cli", *args], cwd=cwd, env=env, capture_output=True)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"{tree}: kvgraft {' '.join(args)} exited {p.returncode}:\n{p.stderr.decode(errors='replace')}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--compare", type=Path, help="an older checkout to time side by side")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest run end to end (tests/test_benchmarks.py): one round, no warm-up run",
    )
    a = ap.parse_args()
    a.rounds = 1 if a.smoke else a.rounds
    trees = {"this checkout": REPO}
    if a.compare:
        trees = {"compared": a.compare.resolve(), **trees}
    commands = {
        "kvgraft --help": ["--help"],
        "kvgraft verify ledger/reference.jsonl": ["verify", str(REPO / "ledger" / "reference.jsonl")],
        "kvgraft graft -n 4 (tiny model)": ["graft", "-n", "4"],
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        run(REPO, ["deposit", str(REPO / "examples" / "problems.jsonl"), "--limit", "1"], work)
        times: dict[tuple[str, str], list[float]] = {}
        for label, args in commands.items():
            if not a.smoke:
                run(REPO, args, work)  # warm the file cache once
            for _ in range(a.rounds):
                for name, tree in trees.items():  # alternated: both see the same machine load
                    times.setdefault((label, name), []).append(run(tree, args, work))
    names = list(trees)
    print("| command | " + " | ".join(f"{n} (s)" for n in names) + " |")
    print("|---|" + "---:|" * len(names))
    for label in commands:
        cells = [f"{statistics.median(times[(label, n)]):.2f}" for n in names]
        print(f"| `{label}` | " + " | ".join(cells) + " |")
    print(f"\n(median of {a.rounds} runs each, {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
