#!/usr/bin/env bash
# Append a new pre-registered reference run to ledger/reference.jsonl (the project's CI gate reads it).
#
#   bash scripts/reference_run.sh NAME      e.g. bash scripts/reference_run.sh 2027-01-portable
#
# 1. An exploratory run in a scratch folder (deposit examples/problems.jsonl, graft --check on two artifacts,
#    score examples/outputs.jsonl) gives the expected hashes on this machine (target cpu-portable).
# 2. Those become ledger/prereg-NAME.yaml (`kvgraft prereg make`).
# 3. The prereg is registered in ledger/reference.jsonl and replayed into it: the ledger is only appended to.
# tests/test_reference_ledger.py replays the most recently registered prereg on every CI run.
set -euo pipefail
name=${1:?usage: scripts/reference_run.sh NAME}
cd "$(dirname "$0")/.."
prereg="ledger/prereg-$name.yaml"
[ -e "$prereg" ] && { echo "$prereg exists: pick another NAME (never rewrite a registered prereg)" >&2; exit 2; }
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
kv() { kvgraft "$@" --store "$scratch/store" --ledger "$scratch/ledger.jsonl"; }
kv deposit examples/problems.jsonl --json > /dev/null
kv graft --check --samples 5 -n 4 sum-1 --json > /dev/null
kv graft --check --samples 5 -n 4 angle-1 --json > /dev/null
kvgraft score examples/outputs.jsonl --answers examples/problems.jsonl --records "$scratch/scores.jsonl" \
    --ledger "$scratch/ledger.jsonl" --json > /dev/null
kvgraft prereg make "$scratch/ledger.jsonl" --target cpu-portable --name "reference-$name" -o "$prereg"
kvgraft replay --register "$prereg" --ledger ledger/reference.jsonl
kvgraft replay "$prereg" --ledger ledger/reference.jsonl --store kvgraft-store
kvgraft verify ledger/reference.jsonl
