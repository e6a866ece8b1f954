"""What the avx2 profile's choices cost on this CPU, measured side by side in one run (issue #44).

The main job's manifest (`manifests/smollm2-math500-q4.yaml`: SmolLM2-135M-Instruct's 4-bit codes, the lean forward,
grouped attention) in copies that differ in the kernel pins (``runtime.env``: none, the ``native`` profile; or the
``avx2`` profile's) and in attention's products (``model.attn_products``: ``blas``, torch's matmul through MKL; or
``aten``, ATen's own mul and sum). Each copy runs in a child process of its own (kernel flags are fixed when torch is
imported): the first N tokens of MATH-500's worked solutions prefilled, then D tokens decoded greedily (a fixed
count, whatever the model says). The copies alternate round by round, so a noisy neighbour hits all alike. Reported
per copy and length: decode tokens per second (median over rounds), the ratio to the first copy, and the hash of the
decoded ids (the same every round; copies with one hash computed the same tokens). Under the avx2 pins the int4
product and attention's ATen products are kvgraft's C kernels' (kvgraft_cli/engine/ckernels.py) but in the last copy,
which runs ATen's own AVX2 kernels: the same ids, at ATen's 8 lanes and through its temporaries. --manifest takes
another q4 manifest with grouped attention instead. Usage:
    python benchmarks/bench_pins.py [--lengths 512 1024] [--decode 64] [--rounds 3] [--threads 1] [--manifest M]
                                    [--json OUT] [--smoke]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from harness import write_json

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "manifests" / "smollm2-math500-q4.yaml"
MATH = REPO / "data" / "math500" / "math500.jsonl"
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
# name -> (kernel pins, attention's products, KVGRAFT_CKERNELS): under the avx2 pins the int4 product and attention's
# ATen products run in kvgraft's C kernels (ATen's AVX2 bits at the CPU's widest vectors) unless told "aten" (ATen's
# own AVX2 kernels: the same bits)
COPIES = {
    "native, blas": ({}, "blas", "auto"),
    "native, aten": ({}, "aten", "auto"),
    "avx2, blas": (AVX2, "blas", "auto"),
    "avx2, aten": (AVX2, "aten", "auto"),
    "avx2, aten, ATen's own": (AVX2, "aten", "aten"),
}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def child(manifest: str, lengths: list[int], decode: int) -> None:
    """One copy in this process: prefill and a fixed-length greedy decode at each length, printed as JSON."""
    from kvgraft_cli.config.manifest import load_manifest
    from kvgraft_cli.engine.engine import load_engine, token_ids_sha256

    eng = load_engine(load_manifest(Path(manifest)))
    text = "\n\n".join(json.loads(x)["answer"] for x in MATH.read_text().splitlines()[:200])
    ids = eng.encode(text)
    out = {}
    with eng._infer():
        for n in lengths:
            cache, last = eng.prefill(ids[:n])
            got = []
            t0 = time.perf_counter()
            for _ in range(decode):
                nxt = int(last.argmax())
                got.append(nxt)
                last = eng.forward(cache, [nxt], last_only=True)[-1]
            out[str(n)] = {"decode_s": time.perf_counter() - t0, "ids": token_ids_sha256(got)}
    out["ckernels"] = eng.environment.get("ckernels")
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--manifest", type=Path, default=MANIFEST, help="the manifest copied (default: the main job's)")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest run end to end (tests/test_benchmarks.py): two of the copies (native, blas and avx2, "
        "aten), one round (--lengths and --decode as given)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.lengths, a.decode)
    copies = {k: COPIES[k] for k in ("native, blas", "avx2, aten")} if a.smoke else COPIES
    a.rounds = 1 if a.smoke else a.rounds
    base = yaml.safe_load(a.manifest.read_text())
    path = base["model"]["path"]
    if not path.startswith("package:") and not Path(path).is_absolute():
        base["model"]["path"] = str((a.manifest.resolve().parent / path).resolve())  # the copies live elsewhere
    folder = Path(tempfile.mkdtemp(prefix="bench-pins-"))
    paths = {}
    for name, (env, products, _) in copies.items():
        m = json.loads(json.dumps(base))
        m["runtime"]["threads"] = a.threads
        m["runtime"]["env"] = {k: env.get(k) for k in m["runtime"]["env"]}
        m["model"]["attn_products"] = products
        paths[name] = folder / (hashlib.sha256(name.encode()).hexdigest()[:8] + ".yaml")
        paths[name].write_text(yaml.safe_dump(m, sort_keys=False))
    pinned = {k for env, _, _ in COPIES.values() for k in env} | {"KVGRAFT_CKERNELS"}
    environ = {k: v for k, v in os.environ.items() if k not in pinned}
    runs: dict[str, list[dict]] = {n: [] for n in copies}
    for r in range(a.rounds):
        for name in copies:
            cmd = [sys.executable, __file__, "--child", str(paths[name]), "--lengths", *map(str, a.lengths),
                   "--decode", str(a.decode)]  # fmt: skip
            p = subprocess.run(
                cmd, capture_output=True, text=True, env={**environ, "KVGRAFT_CKERNELS": copies[name][2]}
            )
            if p.returncode != 0:
                raise SystemExit(f"{name}: rc={p.returncode}\n{p.stderr[-3000:]}")
            res = json.loads(p.stdout.strip().splitlines()[-1])
            runs[name].append(res)
            shown = ", ".join(f"{n}: {a.decode / res[str(n)]['decode_s']:.1f} tok/s" for n in a.lengths)
            print(f"round {r + 1} {name:<24} {shown} (C kernels: {res['ckernels']})", flush=True)
    first = next(iter(copies))
    print(
        f"\n{cpu_model()}, {os.cpu_count()} CPUs, {a.threads} thread(s), {a.decode} tokens decoded after N, "
        f"{a.rounds} rounds, {time.strftime('%Y-%m-%d')}"
    )
    table: dict = {}
    for n in a.lengths:
        print(f"\nN = {n}\n{'copy':<24} {'C':<7} {'tok/s':>7} {'vs ' + first:>16}  ids")
        ref = statistics.median(a.decode / x[str(n)]["decode_s"] for x in runs[first])
        for name in copies:
            rate = statistics.median(a.decode / x[str(n)]["decode_s"] for x in runs[name])
            ids = sorted({x[str(n)]["ids"][:12] for x in runs[name]})
            ck = runs[name][0]["ckernels"]
            table.setdefault(str(n), {})[name] = {"tokens_per_s": rate, "ratio": rate / ref, "ids": ids, "ckernels": ck}
            print(f"{name:<24} {ck or '-':<7} {rate:>7.1f} {rate / ref:>15.2f}x  {', '.join(ids)}")
    if a.json:
        write_json(a.json, {"cpu": cpu_model(), "threads": a.threads, "lengths": table}, **vars(a))


if __name__ == "__main__":
    main()
