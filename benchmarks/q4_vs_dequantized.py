"""What `model.weights: q4` changes against the dequantized model: the same prompts through both, every position's
logits compared (largest absolute difference, KL divergence of q4's distribution from the dequantized one's, and
whether the argmax agrees).

Both sides run the main job's manifest (manifests/smollm2-math500-q4.yaml: SmolLM2-135M-Instruct, grouped attention,
native profile, 1 thread); the dequantized side is the same manifest without its ``weights`` keys (every weight in
float32). The prompts are the library's own: the first N MATH-500 problems with their worked solutions, as `deposit`
renders them (chat template). Not exactness (each side is exact against itself, scripts/real_model_exactness.sh):
how far apart two pinned configurations are.

Another q4 manifest (another GGUF: a Q4_K_M file, say) is compared the same way with --manifest. With
``--without kv_dtype`` the reference side is the manifest without ``model.kv_dtype`` instead (a 16-bit cache against
the float32 one, everything else equal).

Usage: python benchmarks/q4_vs_dequantized.py [--problems 20] [--manifest M] [--without weights|kv_dtype] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import yaml
from harness import write_json

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "manifests" / "smollm2-math500-q4.yaml"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", type=int, default=20)
    ap.add_argument("--manifest", type=Path, default=MANIFEST, help="a q4 manifest (default: the main job's)")
    ap.add_argument(
        "--without",
        choices=["weights", "kv_dtype"],
        default="weights",
        help="what the reference side drops: model.weights (the dequantized model) or model.kv_dtype (a float32 cache)",
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from kvgraft_cli.config.manifest import load_manifest
    from kvgraft_cli.engine.engine import load_engine, pin_environment

    tmp = Path(tempfile.mkdtemp(prefix="q4-vs-dequantized-"))
    source = args.manifest.resolve()
    data = yaml.safe_load(source.read_text())
    model_path = data["model"]["path"]
    if not model_path.startswith("package:") and not Path(model_path).is_absolute():
        data["model"]["path"] = str((source.parent / model_path).resolve())  # the copies live elsewhere
    for key in ("weights", "weights_sha256") if args.without == "weights" else ("kv_dtype",):
        if key not in data["model"]:
            sys.exit(f"{args.manifest}: has no model.{key} to compare without")
        data["model"].pop(key)
    (tmp / "dequantized.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    q4_manifest = tmp / "q4.yaml"
    data_q4 = yaml.safe_load(source.read_text())
    data_q4["model"]["path"] = data["model"]["path"]
    q4_manifest.write_text(yaml.safe_dump(data_q4, sort_keys=False))
    drift = pin_environment(load_manifest(q4_manifest))
    q4 = load_engine(load_manifest(q4_manifest), drift=drift)
    deq = load_engine(load_manifest(tmp / "dequantized.yaml"), drift=drift)

    import torch

    rows = [json.loads(x) for x in (REPO / "data" / "math500" / "math500.jsonl").read_text().splitlines()]
    positions = agree = 0
    kl_sum, worst_kl, worst_abs = 0.0, 0.0, 0.0
    for i, row in enumerate(rows[: args.problems]):
        entry = {"id": str(i), "problem": row["question"], "solution": row["answer"], "answer": ""}
        ids = q4.prefix_ids(q4.prompts.root_text(entry))
        a = q4.batched_pass(ids, len(ids)).double()
        b = deq.batched_pass(ids, len(ids)).double()
        kl = torch.nn.functional.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True, reduction="none")
        kl = kl.sum(-1)
        positions += len(ids)
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        kl_sum += float(kl.sum())
        worst_kl = max(worst_kl, float(kl.max()))
        worst_abs = max(worst_abs, float((a - b).abs().max()))
        print(f"problem {i + 1:>3}: {len(ids):>4} tokens, argmax agrees {agree}/{positions} so far", file=sys.stderr)
    result = {
        "model": f"{data['model']['path']} (gguf_sha256 {data['model']['gguf_sha256'][:16]}...)",
        "manifest": f"{args.manifest} vs the same without model.{args.without}",
        "torch": torch.__version__,
        "problems": args.problems,
        "positions": positions,
        "argmax_agreement": agree / positions,
        "mean_kl": kl_sum / positions,
        "max_kl": worst_kl,
        "max_abs_logit_diff": worst_abs,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        write_json(args.json, result, **vars(args))


if __name__ == "__main__":
    main()
