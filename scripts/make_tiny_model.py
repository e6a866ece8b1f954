"""Make the embedded default model (kvgraft_cli/data/tiny-gemma4) deterministically.

Usage: python scripts/make_tiny_model.py [OUTPUT_DIR]
Re-running it with the pinned torch/transformers gives byte-identical files (check: kvgraft model-hash DIR).
After changing the model, regenerate the default manifest's hashes:
    kvgraft manifest init builtin:tiny-gemma4 --profile portable -o kvgraft_cli/data/default.yaml --force
"""

import sys
from pathlib import Path

from kvgraft_cli.engine.tinymodel import write_tiny_model

if __name__ == "__main__":
    default = Path(__file__).resolve().parents[1] / "kvgraft_cli" / "data" / "tiny-gemma4"
    out = write_tiny_model(Path(sys.argv[1]) if len(sys.argv) > 1 else default)
    print(out, sorted(p.name for p in out.iterdir()))
