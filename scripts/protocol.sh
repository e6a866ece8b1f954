#!/usr/bin/env bash
# The seed's own experiment on your own weights, in one command: a frozen model answers a problems file (AIME 2025
# in the seed) without and with a grafted library of verified solutions; every step is ledgered, both runs are
# scored, the ledger is verified, and the whole run becomes a registered pre-registration another machine replays.
#
#   bash scripts/protocol.sh MODEL_DIR LIBRARY.jsonl PROBLEMS.jsonl [OUTDIR]
#
# MODEL_DIR: a local Hugging Face checkpoint (safetensors; nothing is downloaded), e.g. a frozen Gemma-4-12B.
# LIBRARY.jsonl: verified solutions (id, problem, solution, answer); only those whose final answer matches are used.
# PROBLEMS.jsonl: the problems to answer (id, problem, answer). OUTDIR (default protocol-run) gets the manifest,
# store, ledger, outputs, score records and prereg.yaml.
# Settings by environment: DEVICE (cuda), DTYPE (bfloat16), PROFILE (native), K (4 related solutions),
# OVERLAY (manifests/protocol-aime2025.overlay.yaml), TARGET (the prereg target name, default DEVICE-PROFILE),
# MAX_NEW_TOKENS / ANSWER_TOKENS (override the overlay's decode budgets).
# On a second machine: kvgraft replay OUTDIR/prereg.yaml --store fresh-store  (after `kvgraft replay --register`).
set -euo pipefail
[ $# -ge 3 ] || { sed -n '2,17p' "$0"; exit 2; }
here=$(cd "$(dirname "$0")/.." && pwd)
model=$(cd "$1" 2>/dev/null && pwd || echo "$1"); library=$(realpath "$2"); problems=$(realpath "$3")
out=${4:-protocol-run}
DEVICE=${DEVICE:-cuda}; DTYPE=${DTYPE:-bfloat16}; PROFILE=${PROFILE:-native}; K=${K:-4}
OVERLAY=$(realpath "${OVERLAY:-$here/manifests/protocol-aime2025.overlay.yaml}")
TARGET=${TARGET:-$DEVICE-$PROFILE}
mkdir -p "$out" && cd "$out"
kvgraft manifest init "$model" --device "$DEVICE" --dtype "$DTYPE" --profile "$PROFILE" -o manifest.yaml --force
python3 - "$OVERLAY" <<'PY'
import os, sys, yaml
from kvgraft_cli.config.manifest import dump_yaml, validate_data
m = yaml.safe_load(open("manifest.yaml"))
for section, values in yaml.safe_load(open(sys.argv[1])).items():
    m[section].update(values)
for env, key in (("MAX_NEW_TOKENS", "max_new_tokens"), ("ANSWER_TOKENS", "answer_tokens")):
    if os.environ.get(env):
        m["decode"][key] = int(os.environ[env])
problems = validate_data(m, "manifest.yaml")
if problems:
    sys.exit("\n".join(problems))
open("manifest.yaml", "w").write("# kvgraft run-manifest: `kvgraft manifest init` + " + os.path.basename(sys.argv[1]) + "\n" + dump_yaml(m))
PY
kvgraft deposit "$library" -m manifest.yaml
kvgraft solve "$problems" -m manifest.yaml --compare --k "$K" -o outputs.jsonl --force
kvgraft score outputs.baseline.jsonl --answers "$problems" -m manifest.yaml --records outputs.baseline.scores.jsonl
kvgraft score outputs.library.jsonl --answers "$problems" -m manifest.yaml --records outputs.library.scores.jsonl
kvgraft verify -m manifest.yaml
kvgraft prereg make -m manifest.yaml --target "$TARGET" -o prereg.yaml --force
kvgraft replay --register prereg.yaml
echo "protocol done: $(pwd) (ledger kvgraft-ledger.jsonl, prereg prereg.yaml registered for target $TARGET)"
