"""Benchmark `kvgraft verify`: a 100,000-entry ledger and about 1 GB of artifacts, side by side with sha256sum.

Prints entries/s for the line checks (canonical form, schema, chain, Merkle root), the artifact re-hash speed
(payload SHA-256 through zstd, two threads) against `sha256sum` over the same files (ratio; goal >= 0.8), and the
time of a second run that takes verified files from the cache. Usage:
    python benchmarks/bench_verify.py [--entries 100000] [--artifact-mb 1024] [--files 64]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path


def build(tmp: Path, n_entries: int, total_mb: int, n_files: int) -> Path:
    import hashlib

    import numpy as np

    from kvgraft_cli.artifacts import format as kvg
    from kvgraft_cli.ledger.entries import DepositEntry, Digest, ManifestRef, Verification
    from kvgraft_cli.util.hashing import canonical_json, sha256_bytes

    rng = np.random.default_rng(0)
    per = total_mb * (1 << 20) // n_files
    refs = []
    for _ in range(n_files):
        # float32 "KV" of realistic entropy: random normals (compress about like real float32 caches, ~1.08x).
        payload = rng.standard_normal(per // 4, dtype=np.float32).tobytes()
        sha = sha256_bytes(payload)
        path = tmp / "store" / "objects" / sha[:2] / f"{sha}.kvg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(kvg.compress(payload))
        refs.append((f"store/objects/{sha[:2]}/{sha}.kvg", sha))
    env = {"torch": "2.13.0+cpu", "transformers": "5.24.0", "threads": 1, "env": {"MKL_CBWR": "COMPATIBLE"}}
    lines, prev = [], None
    for i in range(n_entries):
        art = Digest(refs[i][1], refs[i][0]) if i < n_files else Digest(f"{i:064x}")
        entry = DepositEntry(
            manifest=ManifestRef("builtin:default.yaml", "a" * 64, "b" * 64),
            model=Digest.of("c" * 64, tokenizer_sha256="d" * 64),
            environment=env,
            problems_file=Digest("e" * 64),
            record=Digest.of(f"{i:064x}", id=f"p{i}", line=i),
            token_ids=Digest.of(f"{i:064x}", count=100),
            artifact=art,
            logits=Digest.of(f"{i:064x}", dtype="float32", position=99),
            verification=Verification.of("verified", None, "1", "1"),
        ).written_as(i, prev, "2026-11-30T00:00:00.000000+00:00")
        raw = canonical_json(entry.to_json())
        lines.append(raw)
        prev = hashlib.sha256(raw).hexdigest()
    ledger = tmp / "ledger.jsonl"
    ledger.write_bytes(b"".join(l + b"\n" for l in lines))
    return ledger


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--artifact-mb", type=int, default=1024)
    ap.add_argument("--files", type=int, default=64)
    args = ap.parse_args()

    from kvgraft_cli.audit.hashcache import HashCache, digest_of
    from kvgraft_cli.audit.verify import verify_ledger

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        t0 = time.perf_counter()
        ledger = build(tmp, args.entries, args.artifact_mb, args.files)
        print(f"built {args.entries} entries and {args.files} artifacts in {time.perf_counter() - t0:.1f} s")
        files = sorted((tmp / "store").rglob("*.kvg"))
        file_bytes = sum(f.stat().st_size for f in files)

        t0 = time.perf_counter()
        r = verify_ledger(ledger, rehash=False)
        t_lines = time.perf_counter() - t0
        assert r.passed, r.first_problem()
        print(f"line checks: {args.entries} entries in {t_lines:.1f} s = {args.entries / t_lines:,.0f} entries/s")

        sha = shutil.which("sha256sum")
        subprocess.run([sha, *map(str, files)], check=True, capture_output=True)  # warm the page cache
        ratios = []
        for _ in range(2):  # alternate the two, so drift in machine load hits both
            t0 = time.perf_counter()
            subprocess.run([sha, *map(str, files)], check=True, capture_output=True)
            t_sum = time.perf_counter() - t0
            t0 = time.perf_counter()
            nocache = HashCache(None, enabled=False)
            for f in files:
                digest_of(f, nocache)
            t_ours = time.perf_counter() - t0
            ratios.append(t_sum / t_ours)
        print(
            f"artifacts: {len(files)} files, {file_bytes / 2**20:.0f} MiB on disk; sha256sum {t_sum:.2f} s "
            f"({file_bytes / 2**20 / t_sum:.0f} MiB/s); kvgraft payload re-hash {t_ours:.2f} s "
            f"({file_bytes / 2**20 / t_ours:.0f} MiB/s of files)"
        )
        print(f"re-hash speed / sha256sum speed: {' '.join(f'{x:.2f}' for x in ratios)} (goal >= 0.8)")

        t0 = time.perf_counter()
        r = verify_ledger(ledger, full=True)
        t_full = time.perf_counter() - t0
        t0 = time.perf_counter()
        r2 = verify_ledger(ledger)
        t_cached = time.perf_counter() - t0
        assert r.passed and r2.passed
        print(
            f"verify --full: {t_full:.1f} s; verify again with the cache: {t_cached:.1f} s "
            f"({sum(f.status == 'ok' for f in r2.files)} files ok)"
        )
        print(f"cpu: {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
