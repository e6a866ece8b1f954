"""Benchmark: what a deposit costs beyond the prefill it cannot avoid, over a batch of real MATH-500 problems.

Builds a random-weight model from a config (no download; SmolLM-135M's shape, as bench_graft.py and
bench_restore.py do), then for each of the first --problems verified MATH-500 problems (data/math500/math500.jsonl,
read in place; problem + worked solution as the prefix, as `kvgraft deposit` renders it) measures, side by side in
this one process and alternating problem by problem:

  prefill   engine.prefill of the prefix alone: the work a deposit cannot avoid
  deposit   runs.deposit.deposit_one end to end: the same prefill, then capture the cache, encode the canonical
            payload, hash it, write the object file (raw codec; fsynced), index it, append and fsync the ledger line

and, on the same prefilled cache, each stage a deposit adds (capture + encode the payload, SHA-256, write + fsync the
raw file, a ledger append + fsync). Prints per problem and for the batch deposit / prefill = (prefill + stages) /
prefill (issue #10's goal: at most 1.10x), and the end-to-end ratio (noisier: two prefills' noise).
Usage:
    python benchmarks/bench_deposit.py [--problems 8] [--profile native|portable] [--dtype float32|bfloat16] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MATH500 = REPO / "data" / "math500" / "math500.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", type=int, default=8)
    ap.add_argument("--profile", default="native", choices=["portable", "native"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--math500", type=Path, default=MATH500)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest run end to end (tests/test_benchmarks.py): one problem on the embedded tiny model (its "
        "own manifest: --profile and --dtype do not apply), nothing drawn or written first",
    )
    args = ap.parse_args()

    from kvgraft_cli.config.manifest import dump_yaml, load_manifest, make_manifest
    from kvgraft_cli.config.modelhash import hash_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.smoke:
            manifest = load_manifest(None)
            args.problems, args.profile, args.dtype = 1, "portable", manifest.model.dtype  # the embedded manifest's
            _run(manifest, args, tmp)
            return
        subprocess.run(
            [sys.executable, str(REPO / "benchmarks" / "bench_restore.py"), "--write-model", str(tmp / "model")],
            check=True,
            capture_output=True,
        )
        h = hash_model_dir(tmp / "model")
        data = make_manifest(
            str(tmp / "model"), h.model_sha256, h.tokenizer_sha256, profile=args.profile, device="cpu", dtype=args.dtype
        )
        (tmp / "m.yaml").write_text(dump_yaml(data))
        _run(load_manifest(tmp / "m.yaml"), args, tmp)


def _problems(path: Path, n: int, out: Path) -> Path:
    """The first n MATH-500 problems whose worked solution states a final answer, as a problems file."""
    from kvgraft_cli.eval import answers

    rows = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        ref = answers.extract(r["answer"])
        if ref is not None:
            rows.append({"id": f"math-{len(rows)}", "problem": r["question"], "solution": r["answer"], "answer": ref})
        if len(rows) == n:
            break
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def _run(manifest, args, tmp: Path) -> None:
    from kvgraft_cli.artifacts import format as kvg
    from kvgraft_cli.engine.engine import load_engine, tensor_sha256
    from kvgraft_cli.eval.problems import read_problems, verify_solution
    from kvgraft_cli.ledger import entries
    from kvgraft_cli.ledger.entries import DepositEntry, Digest, Verification
    from kvgraft_cli.runs.context import RunContext
    from kvgraft_cli.runs.deposit import DepositReport, deposit_one, prefix_job
    from kvgraft_cli.util.hashing import sha256_file

    eng = load_engine(manifest)  # pins the manifest's environment before torch is imported
    import torch

    path = _problems(args.math500, args.problems, tmp / "problems.jsonl")
    problems = [p for p in read_problems(path, manifest.input.as_written()) if verify_solution(p).status == "verified"]
    ctx = RunContext.make(manifest, tmp / "store", tmp / "ledger.jsonl")
    report = DepositReport(str(path), sha256_file(path), ctx.store_name, str(ctx.ledger), manifest.source)
    settings = {"mapping": manifest.input.as_written(), "limit": None, "allow_unverified": False}
    print(
        f"## {args.dtype}, {type(eng.model).__name__} "
        f"{sum(p.numel() for p in eng.model.parameters()) / 1e6:.0f}M, profile {args.profile}, "
        f"{torch.get_num_threads()} threads; {len(problems)} verified MATH-500 problems"
    )
    eng.prefill(prefix_job(ctx, eng, problems[0], where=str(path))[:64])  # warm-up
    rows = []
    with ctx.open_store(codec="raw") as store:
        for i, p in enumerate(problems):
            ids = prefix_job(ctx, eng, p, where=str(path))
            t0 = time.perf_counter()
            cache, last = eng.prefill(ids)
            t_prefill = time.perf_counter() - t0
            # What a deposit adds to that prefill, stage by stage, on this very cache (into a scratch folder).
            t0 = time.perf_counter()
            payload = kvg.encode(ids, eng.capture(cache), eng.artifact_meta(tensor_sha256(last)))
            t_encode = time.perf_counter() - t0
            t0 = time.perf_counter()
            sha = kvg.payload_identity(payload)
            t_hash = time.perf_counter() - t0
            t0 = time.perf_counter()
            kvg.write_file(tmp / "scratch" / f"{i}-{sha}.kvg", payload, 3, "raw")
            t_write = time.perf_counter() - t0
            t0 = time.perf_counter()
            # A deposit line of the real one's shape (its other digests placeholders), appended and fsynced.
            line = DepositEntry(
                manifest=ctx.manifest_ref(),
                problems_file=Digest(report.input_sha256, str(path)),
                record=Digest.of(p.record_sha256, id=p.id, line=p.line),
                token_ids=Digest.of(sha, count=len(ids)),
                artifact=Digest(sha, f"scratch/{i}-{sha}.kvg"),
                logits=Digest(sha),
                verification=Verification.of("verified"),
            )
            entries.write(tmp / "scratch-ledger.jsonl", line)
            t_append = time.perf_counter() - t0
            del cache, last, payload
            # And the real thing end to end (its own prefill included): noisier, since it holds two prefills' noise.
            t0 = time.perf_counter()
            r = deposit_one(ctx, eng, store, report, p, verify_solution(p), False, 3, settings, ids)
            t_deposit = time.perf_counter() - t0
            rows.append((p.id, len(ids), r.file_bytes, t_prefill, t_encode, t_hash, t_write, t_append, t_deposit))

    print(
        f"{'problem':10} {'tokens':>7} {'file MB':>8} {'prefill s':>10} {'encode':>8} {'sha256':>8} {'write':>8} "
        f"{'ledger':>8} {'stages':>7} {'deposit s':>10} {'e2e':>6}"
    )
    for pid, n, size, tp, te, th, tw, ta, td in rows:
        extra = te + th + tw + ta
        print(
            f"{pid:10} {n:>7} {size / 1e6:>8.1f} {tp:>10.3f} {te:>8.3f} {th:>8.3f} {tw:>8.3f} {ta:>8.3f} "
            f"{(tp + extra) / tp:>7.3f} {td:>10.3f} {td / tp:>6.3f}"
        )
    sp = sum(r[3] for r in rows)
    extra = sum(sum(r[4:8]) for r in rows)
    sd = sum(r[8] for r in rows)
    print(
        f"batch: {sum(r[1] for r in rows)} tokens, {sum(r[2] for r in rows) / 1e6:.1f} MB written; prefill "
        f"{sp:.3f} s, a deposit's own stages {extra:.3f} s: deposit / prefill = {(sp + extra) / sp:.3f} by stages "
        f"(goal <= 1.10), {sd / sp:.3f} end to end (two prefills' noise)"
    )


if __name__ == "__main__":
    main()
