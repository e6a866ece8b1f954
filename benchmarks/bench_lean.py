"""Benchmark: engine.lean's forward against transformers' on the same loaded q4 model, side by side in one process.

The main job's manifest (manifests/smollm2-math500-q4.yaml: SmolLM2-135M-Instruct, its Q4_1 codes kept, grouped
attention, native profile, 1 thread). One engine; each round prefills the first N tokens of MATH-500's worked
solutions through each forward in turn, then decodes greedily, and checks that both gave the same logits bytes and
tokens. Prints the medians and the ratio; a profile of one lean decode step with --profile.

Usage: python benchmarks/bench_lean.py [--lengths 512 2048] [--decode 32] [--rounds 5] [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--manifest", type=Path, default=REPO / "manifests" / "smollm2-math500-q4.yaml")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()

    from bench_graft import _real_ids

    from kvgraft_cli.config.manifest import load_manifest
    from kvgraft_cli.engine.engine import load_engine, tensor_sha256

    eng = load_engine(load_manifest(args.manifest))
    lean = eng.lean
    if lean is None:
        sys.exit("the lean forward is not in force for this manifest (engine.environment['forward'])")
    import torch

    print(f"{eng.manifest.name}: torch {torch.__version__}, threads {torch.get_num_threads()}")
    for n in args.lengths:
        ids = _real_ids(eng, n)
        times: dict[str, dict[str, list[float]]] = {k: {"prefill": [], "decode": []} for k in ("transformers", "lean")}
        outs: dict[str, set] = {"transformers": set(), "lean": set()}
        for _ in range(args.rounds):
            for name in ("transformers", "lean"):
                eng.lean = lean if name == "lean" else None
                t0 = time.perf_counter()
                cache, last = eng.prefill(ids)
                t1 = time.perf_counter()
                tokens, steps = eng.greedy(cache, last, args.decode)
                t2 = time.perf_counter()
                times[name]["prefill"].append(t1 - t0)
                times[name]["decode"].append(args.decode / (t2 - t1))
                outs[name].add((tensor_sha256(last), tensor_sha256(steps), tuple(tokens)))
        same = outs["transformers"] == outs["lean"] and len(outs["lean"]) == 1
        med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in times.items()}
        print(
            f"{n:>6} tokens: prefill {med['transformers']['prefill']:.2f} s -> {med['lean']['prefill']:.2f} s "
            f"({med['transformers']['prefill'] / med['lean']['prefill']:.2f}x); decode "
            f"{med['transformers']['decode']:.1f} -> {med['lean']['decode']:.1f} tokens/s "
            f"({med['lean']['decode'] / med['transformers']['decode']:.2f}x); same bytes and tokens: "
            f"{'yes' if same else 'NO'}"
        )
    if args.profile:
        from torch.profiler import profile

        eng.lean = lean
        cache, last = eng.prefill(_real_ids(eng, args.lengths[0]))
        with profile() as prof:
            eng.greedy(cache, last, 10)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
