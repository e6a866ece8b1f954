"""Which kernel flags make CPU forwards portable across x86-64 machines: run on two machines, compare the output.

For each flag variant on top of the portable base (1 thread, MKL_CBWR=COMPATIBLE, ATEN_CPU_CAPABILITY=default) and each
dtype, a child process (flags are read when torch loads) runs four tiny zoo models (random weights, seed 1) over
inputs of 1, 5, 17 and 64 tokens and prints a SHA-256 prefix of all logits bytes per model. Equal lines on two
machines mean bit-identical forwards there. Results land in $OUT/onednn.json (default: the current folder).
This is how the oneDNN cap of the portable profile was found (docs/EXACTNESS.md). Usage:
    python scripts/portability_flags.py
"""

import hashlib
import json
import os
import subprocess
import sys

VARIANTS = {
    "portable": {},
    "onednn-sse41": {"ONEDNN_MAX_CPU_ISA": "SSE41"},
    "onednn-avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "no-mkldnn": {"EXP_NO_MKLDNN": "1"},
    "mkl-avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "caps-avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}


def child(dtype):
    import torch

    torch.set_num_threads(1)
    if os.environ.get("EXP_NO_MKLDNN"):
        torch.backends.mkldnn.enabled = False
    import transformers

    from kvgraft_cli.engine.zoo import ARCHS

    transformers.utils.logging.set_verbosity_error()
    out = {}
    for arch in ("llama", "gemma4", "gpt2", "qwen3"):
        torch.manual_seed(1)
        m = (
            transformers.AutoModelForCausalLM.from_config(ARCHS[arch].make_config(), attn_implementation="eager")
            .to(getattr(torch, dtype))
            .eval()
        )
        h = hashlib.sha256()
        g = torch.Generator().manual_seed(0)
        for n in (1, 5, 17, 64):
            ids = torch.randint(3, 200, (1, n), generator=g)
            with torch.inference_mode():
                lo = m(input_ids=ids).logits
            h.update(lo.contiguous().view(torch.uint8).numpy().tobytes())
        out[arch] = h.hexdigest()[:16]
    print(json.dumps(out))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        child(sys.argv[1])
        sys.exit()
    res = {}
    for name, extra in VARIANTS.items():
        for dtype in ("bfloat16", "float16", "float32"):
            env = {
                k: v
                for k, v in os.environ.items()
                if k not in ("MKL_CBWR", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
            }
            env.update({"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default", **extra})
            p = subprocess.run([sys.executable, __file__, dtype], env=env, capture_output=True, text=True, check=False)
            res[f"{name}/{dtype}"] = (
                json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else p.stderr[-300:]
            )
            print(name, dtype, res[f"{name}/{dtype}"], flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "onednn.json"), "w") as f:
        json.dump(res, f, indent=1)
