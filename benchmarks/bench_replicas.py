"""Benchmark: `kvgraft serve` with its one engine in process against `--replicas N` (engines in Ray actors behind
the same endpoint), on the real model (manifests/smollm2-serve.yaml: SmolLM2-135M-Instruct, q4, 1 thread an
engine), one workload sent by --clients concurrent clients over plain HTTP.

Setup: a fresh folder (--dir, else a new temporary one); ``kvgraft deposit`` of the first --recurring MATH-500
problems (the library), copied into each configuration's own store, so every server starts from the same store and
no prompt cache. Requests, interleaved: each library question as one user turn (an exact hit: the final answer under
the manifest's answer budget) and --new MATH-500 problems past them (plain, max_tokens --max-tokens), each asked once,
not streamed. Configurations, one after the other: ``one`` (the engine in the serve process), then ``replicas K`` for
each K of --replicas (a local Ray instance on loopback; each replica one engine of runtime.threads).

Printed per configuration: start-up seconds, the workload's wall seconds, requests/s and completion tokens/s, and
its throughput over ``one``'s; and whether every response (text, first-token logits hash, generated-ids hash) is
the same in every configuration. Machines are shared and noisy: compare the ratios of one run. Nothing of this runs in
the test suite. Needs the README's first install and Ray (``pip install 'kvgraft[ray]'``).
Usage:
    python benchmarks/bench_replicas.py [--recurring 8] [--new 8] [--max-tokens 32] [--clients 4] [--replicas 1 2]
                                     [--dir DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import fresh_dir, write_json

REPO = Path(__file__).resolve().parents[1]
PROBLEMS = REPO / "data" / "math500" / "math500.jsonl"
READY_S = 600


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--manifest", type=Path, default=REPO / "manifests" / "smollm2-serve.yaml")
    ap.add_argument("--recurring", type=int, default=8, help="library questions deposited and asked (exact hits)")
    ap.add_argument("--new", type=int, default=8, help="new MATH-500 questions asked (plain)")
    ap.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every request")
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients")
    ap.add_argument(
        "--replicas", type=int, nargs="*", default=[1, 2], help="replica counts to run after `one` (none: `one` alone)"
    )
    ap.add_argument("--dir", type=Path, help="the benchmark's folder (must not exist; default: a new temporary one)")
    ap.add_argument("--json", type=Path, help="write every response's record and the summary here")
    args = ap.parse_args()
    work = fresh_dir(args.dir, "bench-replicas-")
    manifest = args.manifest.resolve()
    model = _model_name(manifest)
    print(f"folder: {work}")
    print(
        f"manifest: {manifest.relative_to(REPO) if manifest.is_relative_to(REPO) else manifest} ({model}); "
        f"{args.clients} clients; {args.recurring} library questions + {args.new} new, max_tokens {args.max_tokens}"
    )
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs", flush=True)
    _deposit(manifest, args.recurring, work)
    rows = [json.loads(x) for x in PROBLEMS.read_text().splitlines()]
    questions = []
    for i in range(max(args.recurring, args.new)):
        if i < args.recurring:
            questions.append(("library", rows[i]["question"]))
        if i < args.new:
            questions.append(("new", rows[args.recurring + i]["question"]))
    configs = [("one", None)] + [(f"replicas {k}", k) for k in args.replicas]
    results: dict[str, dict] = {}
    for name, replicas in configs:
        results[name] = _run_config(name, replicas, manifest, model, questions, args, work)
        r = results[name]
        print(
            f"{name:>11}: start {r['start_s']:.1f} s, workload {r['wall_s']:.1f} s, {r['requests_per_s']:.2f} req/s, "
            f"{r['tokens_per_s']:.1f} completion tokens/s, {r['exact_hits']} exact hits, {r['errors']} errors",
            flush=True,
        )
    base = results["one"]
    print("\nthroughput over `one` (the same workload, one run):")
    for name, r in results.items():
        print(f"  {name:>11}: {r['requests_per_s'] / base['requests_per_s']:.2f}x requests/s")
    same = _compare(results)
    print(f"\nresponses identical in every configuration (text, first-token logits, generated ids): {same}")
    if args.json:
        write_json(args.json, results, **(vars(args) | {"dir": str(work)}))


def _model_name(manifest: Path) -> str:
    import yaml

    return yaml.safe_load(manifest.read_text())["name"]


def _kvgraft() -> str:
    return str(Path(sys.executable).with_name("kvgraft"))


def _deposit(manifest: Path, n: int, work: Path) -> None:
    cmd = [_kvgraft(), "deposit", str(PROBLEMS), "-m", str(manifest), "--store", str(work / "store")]
    cmd += ["--ledger", str(work / "deposit.jsonl"), "--limit", str(n)]
    with (work / "deposit.log").open("w") as log:
        if subprocess.run(cmd, cwd=work, stdout=log, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"kvgraft deposit failed; see {work / 'deposit.log'}")


def _run_config(name, replicas, manifest, model, questions, args, work: Path) -> dict:
    """Start the server on a copy of the deposited store, send the workload, stop it (SIGTERM)."""
    folder = work / name.replace(" ", "-")
    folder.mkdir()
    shutil.copytree(work / "store", folder / "store")
    shutil.copy(work / "deposit.jsonl", folder / "ledger.jsonl")  # the store's artifacts are recorded there
    cmd = [_kvgraft(), "serve", "-m", str(manifest), "--store", "store", "--ledger", "ledger.jsonl", "--port", "0"]
    cmd += ["--warm", "0", "--queue", "256"] + (["--replicas", str(replicas)] if replicas else [])
    t0 = time.perf_counter()
    with (folder / "serve.log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=folder, stdout=subprocess.PIPE, stderr=log, text=True)
        port = _wait_listening(proc, folder)
        start_s = time.perf_counter() - t0
        try:

            def ask(q: tuple[str, str]) -> dict:
                body = {"model": model, "messages": [{"role": "user", "content": q[1]}], "max_tokens": args.max_tokens}
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
                t = time.perf_counter()
                conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
                resp = conn.getresponse()
                data = json.loads(resp.read())
                conn.close()
                if resp.status != 200:
                    return {"kind": q[0], "status": resp.status, "error": data}
                return {
                    "kind": q[0],
                    "status": 200,
                    "seconds": time.perf_counter() - t,
                    "text": data["choices"][0]["message"]["content"],
                    "completion_tokens": data["usage"]["completion_tokens"],
                    "hit": data["kvgraft"]["hit"],
                    "first_logits_sha256": data["kvgraft"]["first_logits_sha256"],
                    "generated_ids_sha256": data["kvgraft"]["generated_ids_sha256"],
                }

            t1 = time.perf_counter()
            with ThreadPoolExecutor(args.clients) as pool:
                records = list(pool.map(ask, questions))
            wall = time.perf_counter() - t1
        finally:
            proc.terminate()
            proc.wait(120)
    ok = [r for r in records if r["status"] == 200]
    return {
        "start_s": start_s,
        "wall_s": wall,
        "requests_per_s": len(ok) / wall,
        "tokens_per_s": sum(r["completion_tokens"] for r in ok) / wall,
        "errors": len(records) - len(ok),
        "exact_hits": sum(r.get("hit") == "exact" for r in ok),
        "records": records,
    }


def _wait_listening(proc: subprocess.Popen, folder: Path) -> int:
    deadline = time.monotonic() + READY_S
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("listening on "):
            return int(line.split()[-1].rsplit(":", 1)[1])
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise SystemExit(f"kvgraft serve did not start; see {folder / 'serve.log'}")


def _compare(results: dict[str, dict]) -> str:
    keys = ("text", "first_logits_sha256", "generated_ids_sha256")
    sigs = {name: [tuple(r.get(k) for k in keys) for r in res["records"]] for name, res in results.items()}
    first = next(iter(sigs.values()))
    n = len(first)
    same = sum(all(s[i] == first[i] for s in sigs.values()) for i in range(n))
    return f"{same}/{n}"


if __name__ == "__main__":
    main()
