"""Evaluate the score graders on MATH-500's own answers: kvgraft's exact grader (normalize, compare exactly) against
math-verify alone (its defaults, time-outs off) and kvgraft's ``--grader math-verify`` (exact first, else
math-verify, refusing equation-vs-value, percent-vs-number and closed-at-infinity pairs, numbers to 10 decimals;
eval/scoring.py).

Every pair is graded with the reference as gold:
  identity   each reference answer against itself (must be accepted)
  boxed      each solution's last \\boxed{} answer against its own trailer answer (the same answer, written twice)
  normalized each reference against kvgraft's normalized form of it
  wrong      each reference against the reference of problem i+k, k = 1..--shifts (other problems' answers: an
             acceptance is wrong unless the two answers are in fact equal; those are listed for reading)
  near       wrong answers one small edit away from a reference (integer +1 or negated, fraction turned over,
             interval bracket flipped, first two entries of a tuple swapped)
  cases      hand-written pairs with the truth (equivalent forms, and wrong answers that look close)
and the verdict digest is compared across two processes with different hash seeds (--seed-check).

Usage (math-verify installed, e.g. pip install 'kvgraft[mathverify]'):
    python benchmarks/eval_graders.py [--data data/math500/math500.jsonl] [--shifts 5] [--seed-check] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness import timed  # noqa: E402  (benchmarks/ is this script's own folder, first on sys.path)

from kvgraft_cli.eval import answers, scoring  # noqa: E402
from kvgraft_cli.eval.problems import read_problems  # noqa: E402

MATH_MAP = {"id": None, "problem": "question", "solution": "answer", "answer": "answer", "answer_extract": "trailer"}

# (reference, candidate, truly equivalent?)
CASES = [
    ("\\frac{1}{2}", "0.5", True),
    ("\\frac{1}{2}", "1/2", True),
    ("\\dfrac{3}{4}", "\\frac{3}{4}", True),
    ("\\tfrac{3}{4}", "\\frac34", True),
    ("[2,5)", "[2, 5)", True),
    ("[2,5)", "\\left[2,5\\right)", True),
    ("(-\\infty, 3]", "(-\\infty,3]", True),
    ("\\{1,2\\}", "\\{2,1\\}", True),
    ("1,2,3", "3, 2, 1", True),
    ("25", "025", True),
    ("70^\\circ", "70", True),
    ("1{,}024", "1024", True),
    ("2\\sqrt{2}", "\\sqrt{8}", True),
    ("\\frac{\\sqrt{3}}{2}", "\\frac{1}{2}\\sqrt{3}", True),
    ("x^2+2x+1", "(x+1)^2", True),
    ("\\text{(B)}", "(B)", True),
    ("10\\%", "10\\%", True),
    ("-\\frac{2}{3}", "\\frac{-2}{3}", True),
    ("\\pi", "\\pi", True),
    ("3\\pi", "3 \\pi", True),
    ("0.25", ".25", True),
    # wrong answers that look close
    ("[2,5)", "(2,5)", False),
    ("[2,5)", "[2,5]", False),
    ("\\{1,2\\}", "\\{1,3\\}", False),
    ("(1,2)", "(2,1)", False),
    ("\\frac{1}{2}", "\\frac{2}{1}", False),
    ("81", "72", False),
    ("-7", "7", False),
    ("1.5", "15", False),
    ("0.25", "25", False),
    ("\\pi", "3.14", False),
    ("\\infty", "-\\infty", False),
    ("\\frac{1}{3}", "0.333333", False),
    ("\\frac{1}{3}", "0.33", False),
    ("10", "10\\%", False),
    ("1000000", "1000001", False),
    ("3", "3.0000001", False),
    ("\\text{(B)}", "(C)", False),
    ("\\text{Tuesday}", "\\text{Wednesday}", False),
    ("x=3", "3", False),
    ("2", "x=2, y=3", False),
    ("5", "5, not 7", False),
    ("42", "not 42", False),
    ("(-\\infty, 0]", "[-\\infty, 0]", False),
]


def near_misses(ref: str) -> list[str]:
    """Wrong answers one small edit away from a reference: an integer off by one or negated, a fraction turned
    over, an interval with its opening bracket flipped, a tuple or set with its first two entries swapped."""
    import re

    s = ref.strip()
    if re.fullmatch(r"-?\d+", s):
        n = int(s)
        return [str(n + 1)] + ([str(-n)] if n else [])
    m = re.fullmatch(r"(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}", s)
    if m and m.group(2).strip() != m.group(3).strip():
        return [f"{m.group(1)}\\frac{{{m.group(3)}}}{{{m.group(2)}}}"]
    if re.fullmatch(r"[\[(].*,.*[\])]", s) and "\\" not in s[:2]:
        flipped = ("(" if s[0] == "[" else "[") + s[1:]
        parts = s[1:-1].split(",")
        out = [flipped]
        if len(parts) >= 2 and parts[0].strip() != parts[1].strip():
            out.append(s[0] + ",".join([parts[1], parts[0]] + parts[2:]) + s[-1])
        return out
    return []


def evaluate(data: Path, shifts: int) -> dict:
    import logging

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "time-outs are off": on purpose
    probs = read_problems(data, MATH_MAP)
    refs = [p.answer for p in probs]
    boxed = [answers.last_boxed(p.solution) for p in probs]

    def mv(ext, ref):
        """math-verify as its README uses it (defaults), time-outs off so that load cannot change a verdict."""
        from math_verify import parse, verify

        return verify(
            parse("\\boxed{" + ref + "}", parsing_timeout=None),
            parse("\\boxed{" + ext + "}", parsing_timeout=None),
            timeout_seconds=None,
        )

    graders = {
        "exact": lambda ext, ref: scoring.grade(ext, ref, "exact"),
        "math-verify alone": lambda ext, ref: ext is not None and mv(ext, ref),
        "kvgraft --grader math-verify": lambda ext, ref: scoring.grade(ext, ref, "math-verify"),
    }
    out: dict = {"problems": len(refs), "math_verify": scoring.math_verify_versions(), "sets": {}, "verdicts": {}}
    slowest = (0.0, None)

    def run(name, pairs):
        nonlocal slowest
        res = {}
        for g, fn in graders.items():
            verdicts = []
            for ref, ext in pairs:
                dt, v = timed(lambda: fn(ext, ref))
                if dt > slowest[0]:
                    slowest = (dt, (ref, ext))
                verdicts.append(bool(v))
            res[g] = verdicts
            out["verdicts"].setdefault(g, []).extend(verdicts)
        return res

    t0 = time.perf_counter()
    for name, pairs in (
        ("identity", [(r, r) for r in refs]),
        ("boxed", [(r, b) for r, b in zip(refs, boxed)]),
        ("normalized", [(r, answers.normalize(r)) for r in refs]),
    ):
        res = run(name, pairs)
        out["sets"][name] = {"pairs": len(pairs), **{g: sum(v) for g, v in res.items()}}
        out["sets"][name]["rejected_by_math_verify_alone"] = [
            {"reference": r, "candidate": c} for (r, c), ok in zip(pairs, res["math-verify alone"]) if not ok
        ][:10]

    wrong_pairs = [(refs[i], refs[(i + k) % len(refs)]) for k in range(1, shifts + 1) for i in range(len(refs))]
    res = run("wrong", wrong_pairs)
    same = [answers.answers_match(c, r) for r, c in wrong_pairs]
    w = {"pairs": len(wrong_pairs), "same_answer_by_exact": sum(same)}
    for g, verdicts in res.items():
        w[g] = sum(verdicts)
        w[g + ": accepted where exact differs"] = [
            {"reference": r, "candidate": c} for (r, c), ok, s in zip(wrong_pairs, verdicts, same) if ok and not s
        ]
    out["sets"]["wrong"] = w

    near = [(r, c) for r in refs for c in near_misses(r)]
    res = run("near", near)
    out["sets"]["near"] = {
        "pairs": len(near),
        **{g: sum(v) for g, v in res.items()},
        "accepted": {g: [f"{c} for {r}" for (r, c), ok in zip(near, v) if ok] for g, v in res.items()},
    }

    res = run("cases", [(r, c) for r, c, _ in CASES])
    cases = {"pairs": len(CASES), "equivalent": sum(t for *_, t in CASES)}
    for g, verdicts in res.items():
        cases[g] = {
            "accepted_equivalent": sum(v and t for v, (*_, t) in zip(verdicts, CASES)),
            "accepted_wrong": [f"{r} ~ {c}" for v, (r, c, t) in zip(verdicts, CASES) if v and not t],
            "rejected_equivalent": [f"{r} ~ {c}" for v, (r, c, t) in zip(verdicts, CASES) if not v and t],
        }
    out["sets"]["cases"] = cases
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out["slowest_comparison_s"] = round(slowest[0], 3)
    out["verdict_sha256"] = {g: hashlib.sha256(bytes(v)).hexdigest()[:16] for g, v in out["verdicts"].items()}
    del out["verdicts"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=REPO / "data" / "math500" / "math500.jsonl")
    ap.add_argument("--shifts", type=int, default=5, help="wrong pairs: problem i against i+1 .. i+SHIFTS")
    ap.add_argument("--seed-check", action="store_true", help="re-run in two processes with other hash seeds")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if scoring.math_verify_versions() is None:
        sys.exit(f"math-verify is not installed: {scoring.MATH_VERIFY_HINT}")
    result = evaluate(a.data, a.shifts)
    if a.seed_check:
        digests = []
        for seed in ("1", "4242"):
            p = subprocess.run(
                [sys.executable, __file__, "--data", str(a.data), "--shifts", str(a.shifts), "--json"],
                env={**os.environ, "PYTHONHASHSEED": seed},
                capture_output=True,
                text=True,
                check=True,
            )
            digests.append(json.loads(p.stdout)["verdict_sha256"])
        result["same_verdicts_across_hash_seeds"] = all(d == result["verdict_sha256"] for d in digests)
    if a.json:
        print(json.dumps(result, indent=2, ensure_ascii=False))
        return
    print(f"MATH-500: {result['problems']} problems; math-verify {result['math_verify']}")
    for name in ("identity", "boxed", "normalized"):
        s = result["sets"][name]
        print(
            f"{name:10} accepted of {s['pairs']}: "
            + ", ".join(f"{g} {s[g]}" for g in ("exact", "math-verify alone", "kvgraft --grader math-verify"))
        )
        for x in s["rejected_by_math_verify_alone"]:
            print(f"           math-verify alone rejects {x['candidate']!r} for {x['reference']!r}")
    nm = result["sets"]["near"]
    print(
        f"near       {nm['pairs']} near misses (integer +1 or negated, fraction turned over, interval bracket "
        "flipped, first two entries swapped); accepted: "
        + ", ".join(f"{g} {nm[g]}" for g in ("exact", "math-verify alone", "kvgraft --grader math-verify"))
    )
    for g, acc in nm["accepted"].items():
        for x in acc:
            print(f"           {g} accepts {x}")
    w = result["sets"]["wrong"]
    print(
        f"wrong      {w['pairs']} pairs of different problems' answers ({w['same_answer_by_exact']} are the same "
        "answer by exact match); accepted: "
        + ", ".join(f"{g} {w[g]}" for g in ("exact", "math-verify alone", "kvgraft --grader math-verify"))
    )
    for g in ("math-verify alone", "kvgraft --grader math-verify"):
        for x in w[g + ": accepted where exact differs"]:
            print(f"           {g} accepts {x['candidate']!r} for {x['reference']!r}")
    c = result["sets"]["cases"]
    print(f"cases      {c['pairs']} hand-written pairs, {c['equivalent']} equivalent:")
    for g in ("exact", "math-verify alone", "kvgraft --grader math-verify"):
        x = c[g]
        print(
            f"           {g}: {x['accepted_equivalent']}/{c['equivalent']} equivalent accepted, "
            f"{len(x['accepted_wrong'])} wrong accepted {x['accepted_wrong']}, rejected {x['rejected_equivalent']}"
        )
    print(
        f"{result['seconds']} s in all, slowest comparison {result['slowest_comparison_s']} s; verdict digests "
        f"{result['verdict_sha256']}"
    )
    if "same_verdicts_across_hash_seeds" in result:
        print(f"same verdicts in two more processes with other hash seeds: {result['same_verdicts_across_hash_seeds']}")


if __name__ == "__main__":
    main()
