"""Benchmark: batched decode steps (engine.decoding, LeanLlama.step) against one sequence a step, on a manifest's
model (default: the serve manifest, SmolLM2-135M q4 at 1 thread), side by side in one process.

For each batch size B: B sequences (prompts of 5 to 120 tokens) decode --steps steps together, and the same B
sequences decode the same steps one after another; the rows' logits are compared byte for byte with the lone
steps' (``same bits``). Printed per B: milliseconds a step, a row, decode tokens a second, and the throughput over
one sequence a step (interleaved rounds, the median, so a noisy machine's spikes fall out). What kvgraft serve's
and solve's ``--batch`` default (engine.decoding.DEFAULT_BATCH) rests on. Nothing of this runs in the test suite.

Usage:
    python benchmarks/bench_batch.py [-m manifests/smollm2-serve.yaml] [--sizes 1 2 4 8 16] [--steps 16] [--rounds 3]
        [--profile [N]]   (where the largest size's step goes: torch's profiler, the N busiest operators)
"""

from __future__ import annotations

import argparse
import statistics
import time

from harness import cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--manifest", default="manifests/smollm2-serve.yaml")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--profile",
        type=int,
        nargs="?",
        const=12,
        metavar="N",
        help="after the table, where a batched step's time goes at the largest size: torch's profiler over "
        "--steps steps, its N busiest operators by own CPU time (default 12)",
    )
    args = ap.parse_args()

    from kvgraft_cli.config.manifest import load_manifest
    from kvgraft_cli.engine.engine import load_engine

    manifest = load_manifest(args.manifest)
    engine = load_engine(manifest)  # pins the manifest's environment before torch loads
    import torch

    refusal = engine.batch_refusal
    print(
        f"{manifest.name} ({args.manifest}): {cpu()['model']}, {torch.get_num_threads()} threads, "
        f"ATen {torch.backends.cpu.get_cpu_capability()}, forward {engine.environment.get('forward')}"
    )
    if refusal:
        raise SystemExit(f"no batched step on this engine: {refusal}")
    lean = engine.lean
    lengths = [5, 17, 40, 63, 90, 120, 33, 8]

    def caches(n: int) -> list:
        return [engine.prefill([3 + (i * 7 + j) % 400 for j in range(lengths[i % 8])])[0] for i in range(n)]

    print(
        f"\n{'B':>3} {'ms/step':>9} {'ms/row':>8} {'tokens/s':>9} {'alone tok/s':>12} {'x alone':>8} {'same bits':>10}"
    )
    for b in args.sizes:
        together, alone, same = [], [], True
        for _ in range(args.rounds):
            with engine._infer():
                cs, ca = caches(b), caches(b)
                ids = [11 + i for i in range(b)]
                t0 = time.perf_counter()
                rows = []
                for _ in range(args.steps):
                    rows.append(lean.step(cs, ids).clone())
                together.append((time.perf_counter() - t0) / args.steps)
                t0 = time.perf_counter()
                lone = [[lean(c, [ids[i]])[-1].clone() for i, c in enumerate(ca)] for _ in range(args.steps)]
                alone.append((time.perf_counter() - t0) / args.steps)
                same = same and all(torch.equal(r[i], lone[s][i]) for s, r in enumerate(rows) for i in range(b))
        t, a = statistics.median(together), statistics.median(alone)
        print(
            f"{b:>3} {t * 1e3:>9.1f} {t / b * 1e3:>8.1f} {b / t:>9.1f} {b / a:>12.1f} {a / t:>7.2f}x "
            f"{'yes' if same else 'NO':>10}"
        )
    if args.profile:
        _profile(engine, lean, caches, max(args.sizes), args.steps, args.profile)


def _profile(engine, lean, caches, b: int, steps: int, top: int) -> None:
    """The busiest operators of ``steps`` batched steps of ``b`` rows, by own CPU time, each with its share."""
    from torch.profiler import ProfilerActivity, profile

    with engine._infer():
        cs, ids = caches(b), [11 + i for i in range(b)]
        lean.step(cs, ids)  # warm: the scratch buffers made
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                lean.step(cs, ids)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    print(f"\nwhere a step of {b} rows goes ({steps} steps profiled; own CPU time):")
    print(f"{'operator':<40} {'share':>6} {'calls/step':>11} {'us/call':>8}")
    for e in events[:top]:
        share = e.self_cpu_time_total / total
        print(f"{e.key:<40} {share:>6.1%} {e.count / steps:>11.0f} {e.self_cpu_time_total / e.count:>8.1f}")


if __name__ == "__main__":
    main()
