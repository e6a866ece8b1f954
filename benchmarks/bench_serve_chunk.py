"""Which prompt-cache chunk for `kvgraft serve` (docs/SERVE.md)? The cost of a cold prompt computed in chunks of C
tokens (the chunked schedule) against one forward (single), and what a warm request with a shared prefix still
computes: the part of the last shared chunk the cache cannot hold plus the question. Interleaved rounds, medians.

The real model (manifests/smollm2-serve.yaml with its schedule replaced, or --manifest; the configuration it names is printed; the model cache must hold its conversion:
any command on that manifest makes it). Usage:
    python benchmarks/bench_serve_chunk.py [--tokens 2048] [--chunks 32 64 128 256] [--question 40] [--repeat 3]
                                           [--manifest M]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="the shared prefix's tokens")
    ap.add_argument("--chunks", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--question", type=int, default=40, help="tokens after the shared prefix")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--manifest", type=Path, default=REPO / "manifests" / "smollm2-serve.yaml")
    a = ap.parse_args()
    import yaml

    from kvgraft_cli.config.manifest import load_manifest
    from kvgraft_cli.engine.engine import load_engine, pin_environment

    base = yaml.safe_load(a.manifest.read_text())
    path = base["model"]["path"]
    if not path.startswith("package:") and not Path(path).is_absolute():
        base["model"]["path"] = str((a.manifest.resolve().parent / path).resolve())  # the copies live elsewhere
    tmp = Path(tempfile.gettempdir()) / "kvgraft-bench-serve-chunk"
    tmp.mkdir(exist_ok=True)

    def manifest(schedule: str, chunk: int | None):
        data = copy.deepcopy(base)
        data["prefill"] = {"schedule": schedule, "chunk_size": chunk}
        path = tmp / f"{schedule}-{chunk}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return load_manifest(path)

    single = manifest("single", None)
    pin_environment(single)
    engine = load_engine(single)
    rows = [json.loads(x) for x in (REPO / "data" / "math500" / "math500.jsonl").read_text().splitlines()]
    text = "\n\n".join(r["answer"] for r in rows[200:300])
    ids = engine.encode(text)[: a.tokens + a.question]
    configs = [("single", None)] + [("chunked", c) for c in a.chunks]
    cold: dict[str, list[float]] = {}
    warm: dict[str, list[float]] = {}
    for _ in range(a.repeat):
        for schedule, chunk in configs:
            name = f"{schedule} {chunk or ''}".strip()
            engine.manifest = manifest(schedule, chunk)
            t0 = time.perf_counter()
            engine.prefill(ids)
            cold.setdefault(name, []).append(time.perf_counter() - t0)
            if chunk:  # a warm request: the full chunks of the shared prefix restored, the rest computed
                done = (a.tokens // chunk) * chunk
                cache, _ = engine.prefill(ids[:done])
                t0 = time.perf_counter()
                for start in range(done, len(ids), chunk):
                    engine.forward(cache, ids[start : start + chunk], last_only=True)
                warm.setdefault(name, []).append(time.perf_counter() - t0)
    m = base["model"]
    print(f"{base['name']} ({a.manifest}: {m['dtype']}, weights {m.get('weights', 'dequantized')}, "
          f"{m['attn_implementation']} attention, {engine.environment.get('forward')} forward, "
          f"profile {'native' if base['runtime']['env'].get('ATEN_CPU_CAPABILITY') is None else 'portable'}, "
          f"{base['runtime']['threads']} thread(s)), "
          f"{a.tokens}-token shared prefix + {a.question}-token question, median of {a.repeat}")  # fmt: skip
    print(f"{'schedule':<14}{'cold prompt s':>14}{'vs single':>11}{'warm computes':>15}{'warm s':>9}")
    ref = statistics.median(cold["single"])
    for schedule, chunk in configs:
        name = f"{schedule} {chunk or ''}".strip()
        c = statistics.median(cold[name])
        w = f"{statistics.median(warm[name]):9.3f}" if name in warm else f"{'':>9}"
        left = (len(ids) - (a.tokens // chunk) * chunk) if chunk else len(ids)
        print(f"{name:<14}{c:14.3f}{c / ref:10.2f}x{left:15d}{w}")


if __name__ == "__main__":
    main()
