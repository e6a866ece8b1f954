#!/usr/bin/env bash
# The flywheel figures (docs/LIBRARY.md) on the demo model, measured in one run (CPU; nothing downloaded):
#   bash scripts/demo_figures.sh [OUTDIR]
# 1. the demo library and queries (examples/demo): recurring questions and new instances of synthetic families;
# 2. MATH-500 (data/math500/math500.jsonl): its 500 worked solutions as the library, the same 500 problems asked
#    again (the recurring case);
# each with `solve --compare` (baseline and library side by side), `score`, `store stats` and `verify`.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-demo-figures}
math500=${MATH500:-$here/data/math500/math500.jsonl}
mkdir -p "$out" && cd "$out"
demo=(-m "$here/kvgraft_cli/data/demo.yaml" --store demo-store --ledger demo-ledger.jsonl)
kvgraft deposit "$here/examples/demo/library.jsonl" "${demo[@]}" --json > demo-deposit.json
kvgraft solve "$here/examples/demo/queries.jsonl" "${demo[@]}" --compare --k 2 --force -o demo.jsonl --json > demo-solve.json
kvgraft score demo.library.jsonl --answers "$here/examples/demo/queries.jsonl" -m "$here/kvgraft_cli/data/demo.yaml" --ledger demo-ledger.jsonl --json > demo-score.json
kvgraft verify demo-ledger.jsonl --json > demo-verify.json
m500=(-m "$here/manifests/demo-math500.yaml" --store m500-store --ledger m500-ledger.jsonl)
kvgraft deposit "$math500" "${m500[@]}" --json > m500-deposit.json
kvgraft solve "$math500" "${m500[@]}" --compare --force -o m500.jsonl --json > m500-solve.json
kvgraft store stats "${m500[@]:0:4}" --json > m500-stats.json
kvgraft verify m500-ledger.jsonl --json > m500-verify.json
python3 - <<'PY'
import json
for name in ("demo", "m500"):
    d = json.load(open(f"{name}-solve.json"))
    rows = {m: d[m]["totals"] for m in ("baseline", "library")}
    by = {}
    for m in ("baseline", "library"):
        for r in d[m]["records"]:
            kind = "transfer" if r["id"].startswith("fam-") else "recurring"
            a = by.setdefault((m, kind), [0, 0]); a[0] += bool(r["correct"]); a[1] += 1
    print(f"== {name}")
    for m, t in rows.items():
        print(f"{m:8} correct {t['correct']}/{t['scored']} [{100*t['wilson95_low']:.1f}, {100*t['wilson95_high']:.1f}]"
              f" decode {t['decode_tokens']} prefill {t['prefill_tokens']} grafted {t['grafted_tokens']}"
              f" wall {t['wall_s']:.2f}s cpu {t['cpu_s']:.2f}s exact {t['exact_hits']} related {t['related_hits']}")
    print("by kind:", {f"{m} {k}": f"{a}/{n}" for (m, k), (a, n) in sorted(by.items())})
    print("ratios:", {k: (round(v, 2) if v else v) for k, v in d["ratios"].items()})
s = json.load(open("m500-stats.json"))
print("m500 store:", s)
for v in ("demo-verify.json", "m500-verify.json"):
    print(v, json.load(open(v))["passed"])
PY
