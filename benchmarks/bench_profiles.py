"""Benchmark: what the portable profile costs against the native one, and the invariant prefill schedule against
the single one, measured side by side in one run.

Kernel flags are fixed when torch is imported, so every measurement runs in its own child process; the parent
alternates profiles round by round (portable, native 1 thread, native N threads, portable, ...) so that a noisy
neighbour hits all of them alike, and reports the median over rounds of each child's median. Measured per prefix
length: prefill (the deposit's and a fresh computation's cost) and 16 greedy decode steps after it (what every
graft pays per generated token). With ``--schedules single invariant`` every profile also runs under the invariant
schedule (one token a forward, issue #13), and the table adds invariant / single per profile. Usage:
    python benchmarks/bench_profiles.py [--lengths 128 512] [--rounds 3] [--model smol|tiny]
                                     [--schedules single invariant] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _child(args) -> None:
    """One profile in this process: load the pinned engine, time prefill and decode, print JSON."""
    from kvgraft_cli.config.manifest import load_manifest
    from kvgraft_cli.engine.engine import load_engine

    eng = load_engine(load_manifest(args.child))
    import torch

    gen = torch.Generator().manual_seed(0)
    result = {"threads": torch.get_num_threads()}
    for n in args.lengths:
        ids = torch.randint(3, eng.model.config.vocab_size, (n,), generator=gen).tolist()
        pre, dec = [], []
        for _ in range(args.repeat + 1):  # the first run warms caches and is dropped
            t0 = time.perf_counter()
            cache, last = eng.prefill(ids)
            t1 = time.perf_counter()
            eng.greedy(cache, last, 16)
            t2 = time.perf_counter()
            pre.append(t1 - t0)
            dec.append((t2 - t1) / 16)
        result[str(n)] = {"prefill": statistics.median(pre[1:]), "decode": statistics.median(dec[1:])}
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--model", default="smol", choices=["smol", "tiny"])
    ap.add_argument("--schedules", nargs="+", default=["single"], choices=["single", "invariant"])
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest run end to end (tests/test_benchmarks.py): the embedded tiny model (nothing written), "
        "portable and native at 1 thread only, one round of one repeat (--lengths as given)",
    )
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    if args.smoke:
        args.model, args.rounds, args.repeat = "tiny", 1, 1

    from kvgraft_cli.config.manifest import BUILTIN_PREFIX, builtin_model_dir, dump_yaml, make_manifest
    from kvgraft_cli.config.modelhash import hash_model_dir
    from kvgraft_cli.config.profiles import environ_without_pins

    n_cpu = os.cpu_count() or 1
    profiles = [("portable", 1), ("native", 1)] + ([] if args.smoke else [("native", n_cpu)])
    configs = [(p, t, s) for s in args.schedules for p, t in profiles]
    env = environ_without_pins()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = BUILTIN_PREFIX + "tiny-gemma4" if args.smoke else str(tmp / "model")
        if not args.smoke:
            subprocess.run(
                [sys.executable, str(HERE / "bench_graft.py"), "--write-model", model, "--model", args.model],
                check=True,
                capture_output=True,
            )
        h = hash_model_dir(builtin_model_dir("tiny-gemma4") if args.smoke else tmp / "model")
        manifests = []
        for prof, threads, schedule in configs:
            path = tmp / f"{prof}-{threads}-{schedule}.yaml"
            path.write_text(
                dump_yaml(
                    make_manifest(
                        model,
                        h.model_sha256,
                        h.tokenizer_sha256,
                        profile=prof,
                        threads=threads,
                        schedule=schedule,
                    )
                )
            )
            manifests.append(path)
        runs: dict[int, list[dict]] = {i: [] for i in range(len(configs))}
        for r in range(args.rounds):
            for i, path in enumerate(manifests):
                p = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        str(path),
                        "--repeat",
                        str(args.repeat),
                        "--lengths",
                        *map(str, args.lengths),
                    ],
                    env=env,
                    check=True,
                    capture_output=True,
                    text=True,
                )
                runs[i].append(json.loads(p.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    def med(i, n, what):
        return statistics.median(run[str(n)][what] for run in runs[i])

    print(f"model {args.model}, float32, {args.rounds} rounds x median of {args.repeat}; seconds")
    k = len(profiles)
    for s, schedule in enumerate(args.schedules):
        names = [f"{p} {t}t" for p, t in profiles]
        for what in ("prefill", "decode"):
            print(f"\n{schedule} schedule, {what}{' (per token)' if what == 'decode' else ''}")
            print(
                f"{'tokens':>7} "
                + " ".join(f"{n:>13}" for n in names)
                + "".join(f" {'portable/native ' + str(t) + 't':>19}" for _, t in profiles[1:])
                + ("".join(f" {'inv/single ' + n:>22}" for n in names) if schedule != "single" else "")
            )
            for n in args.lengths:
                vals = [med(s * k + i, n, what) for i in range(k)]
                line = (
                    f"{n:>7} "
                    + " ".join(f"{v:>13.4f}" for v in vals)
                    + "".join(f" {vals[0] / v:>18.2f}x" for v in vals[1:])
                )
                if schedule != "single" and "single" in args.schedules:
                    base = args.schedules.index("single") * k
                    line += "".join(f" {v / med(base + i, n, what):>21.2f}x" for i, v in enumerate(vals))
                print(line)


if __name__ == "__main__":
    main()
