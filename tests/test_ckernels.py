"""kvgraft's C kernels (kvgraft_cli/engine/int4mm.c, attnsum.c) give ATen's AVX2 kernels' bits, byte for byte.

Each check runs in a child process pinned to ATen's AVX2 capability (ATen reads it once, at import), as the avx2
profile runs: the C code is compiled into a cache folder of the test's own, and both of its vector paths the CPU has
are compared with ATen at 1 and 2 threads:
- the int4 product with `aten._weight_int4pack_mm_for_cpu` at the real model's shapes (SmolLM2-135M's 576x576,
  960x576 fused, 576x1536, and a ragged last block of 16), at 1 to 17 rows, with rows that cancel (so that bfloat16
  shows the float32 roundings) and NaN, infinities, subnormals and large values among the inputs;
- attention's products with engine.attention's ATen mul and sum, at the real model's shapes (a token, a prefill chunk)
  and others (head sizes of 128, 80 and 40; keys past multi_row_sum's levels), with NaN and infinities.
Then the guards: copies with other arithmetic (the int4 accumulation as a multiply and an add, each rounded;
attention's sums in another order) are caught by the check at load and ATen's kernels run; no compiler, ATen's
capability above AVX2 and KVGRAFT_CKERNELS=aten all run ATen's kernels and say why. The real model's end-to-end
bits under the C kernels are tests/test_main_prereg.py's: the committed pre-registration, made under ATen's kernels on
another CPU, replayed hash for hash.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO

pytestmark = pytest.mark.skipif(
    not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler: ATen's kernel runs (checked below)"
)

CHILD = textwrap.dedent(
    r"""
    import json, os, sys
    import torch
    from kvgraft_cli.engine import ckernels as K
    from kvgraft_cli.errors import InputError

    def reset(**env):
        K._STATUS, K._LIB = None, None
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    out = {"capability": torch.backends.cpu.get_cpu_capability(), "status": K.status().__dict__}
    lib = K._LIB
    g = torch.Generator().manual_seed(7)
    widths = [w for w in (512, 256) if w <= lib.kvg_int4_isa()]
    compared, differed = 0, []
    for n, k in ((576, 576), (960, 576), (576, 1536), (208, 96)):
        for m in (1, 3, 4, 5, 17):
            a, packed, sz = K.check_inputs(n, k, m, g)  # half the rows cancel: bfloat16 shows the roundings
            if m == 5:  # values at the edges of float32 and bfloat16
                a[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38])
                a[2, :] = 1e-39  # subnormal
                a[4, :] = 1e30
            want = torch.ops.aten._weight_int4pack_mm_for_cpu(a, packed, 32, sz).view(torch.int16)
            for width in widths:
                for threads in (1, 2):
                    got = K._run(a, packed, sz, width, threads).view(torch.int16)
                    compared += 1
                    if not torch.equal(got, want):
                        differed.append([n, k, m, width, threads, int((got != want).sum())])
            if m == 4:  # through the public entry, the path status() chose
                compared += 1
                if not torch.equal(K.int4_mm(a, packed, 32, sz).view(torch.int16), want):
                    differed.append([n, k, m, "int4_mm"])
    # Attention's products (model.attn_products: aten) at the real model's shapes (3 KV heads of 64, 3 query heads
    # each: a token, a prefill chunk of 16) and others (d of 128, 80 and 40; n past 16, 256 and 4096 rows)
    from kvgraft_cli.engine.attention import aten_mix, aten_scores  # engine.attention's own, rows at a time

    shapes = ((1, 3, 3, 1, 64), (1, 3, 3, 17, 64), (1, 3, 3, 512, 64), (1, 3, 48, 300, 64), (2, 3, 3, 1030, 64),
              (1, 4, 2, 300, 128), (1, 2, 2, 33, 80), (1, 2, 1, 4100, 40))
    for shape in shapes:
        q, key, weights, value = K.check_attention_inputs(*shape, g)
        if shape[3] == 512:
            q[0, 0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
            weights[0, 1, 1, :2] = torch.tensor([1e-45, 3e38])
        for threads in (1, 2):
            with K._with_threads(threads):
                want = aten_scores(q, key).view(torch.int32), aten_mix(weights, value).view(torch.int32)
            for width in widths:
                got = K._scores(q, key, width, threads), K._mix(weights, value, width, threads)
                for what, x, y in (("scores", got[0].view(torch.int32), want[0]), ("mix", got[1].view(torch.int32), want[1])):
                    compared += 1
                    if not torch.equal(x, y):
                        differed.append([what, *shape, width, threads, int((x != y).sum())])
    out.update(widths=widths, compared=compared, differed=differed)

    # Copies with other arithmetic, each caught by the check at load (ATen's kernels run instead), on the widest path
    # (a compile each, unoptimized): int4mm.c's accumulation as a multiply and an add, each rounded; attnsum.c's 8
    # lanes of Q·Kᵀ added in another order, and weights·V's levels carried every 32 rows, not 16. (So were ATen's
    # AVX-512 dequantization, no row_sum for d's lanes past the last 32, and row_sum's partials in another order,
    # when this test was written.)
    int4, attn = K.SOURCES
    source, a = int4.read_text(), attn.read_text()
    unfused = source
    for width in ("512", "256"):
        for i in ("[t][0]", "[t][1]", "[t][v]"):
            unfused = unfused.replace(
                f"acc[r]{i} = _mm{width}_fmadd_ps(a, w{i}, acc[r]{i})",
                f"acc[r]{i} = _mm{width}_add_ps(_mm{width}_mul_ps(a, w{i}), acc[r]{i})",
            )
    lanes = a.replace("for (int l = 0; l < 8; l++) f += a[0][l];", "for (int l = 7; l >= 0; l--) f += a[0][l];")
    lanes = lanes.replace("f[j] += t[l][j];", "f[j] += t[7 - l][j];")
    levels = a.replace("#define STEP 16", "#define STEP 32")
    copies = {"unfused": (unfused, attn), "lanes": (int4, lanes), "levels": (int4, levels)}
    width = "avx512" if lib.kvg_int4_isa() == 512 else "avx2"
    flags = K.FLAGS
    K.FLAGS = tuple("-O0" if f == "-O3" else f for f in flags)  # 0.5 s a compile, not 3: the same IEEE operations
    for name, (i4, at) in copies.items():
        assert (i4, at) != (int4, attn) and source not in (at,), name
        paths = []
        for text, real in ((i4, int4), (at, attn)):
            if isinstance(text, str):
                paths.append(type(real)(os.path.join(sys.argv[1], f"{name}-{real.name}")))
                paths[-1].write_text(text)
            else:
                paths.append(text)
        K.SOURCES = tuple(paths)
        reset(KVGRAFT_CKERNELS=width)
        out[f"{name}_{width}"] = K.status().__dict__
    K.SOURCES, K.FLAGS = (int4, attn), flags
    reset(KVGRAFT_CKERNELS=None)

    path = os.environ["PATH"]
    reset(PATH="/nonexistent", CC=None)
    out["no_compiler"] = K.status().__dict__
    reset(PATH=path, KVGRAFT_CKERNELS="aten")
    out["aten"] = K.status().__dict__
    reset(KVGRAFT_CKERNELS="avx2")
    out["forced_avx2"] = K.status().__dict__
    reset(KVGRAFT_CKERNELS="avx-1024")
    try:
        K.status()
    except InputError as e:
        out["bogus"] = e.message
    print(json.dumps(out))
    """
)


def _child(tmp_path, **env):
    full = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONPATH": str(REPO), **env}
    full.pop("KVGRAFT_CKERNELS", None)
    full.update(env)
    p = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], env=full, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.splitlines()[-1])


def test_the_c_kernels_give_atens_avx2_bits_and_their_guards_hold(tmp_path):
    out = _child(tmp_path, ATEN_CPU_CAPABILITY="avx2")
    assert out["capability"] == "AVX2"
    assert out["status"]["path"] in ("avx512", "avx2"), out["status"]
    assert list((tmp_path / "cache" / "kvgraft" / "kernels").glob("kvgraft-*.so"))  # compiled into the user's cache
    assert out["compared"] == (4 * 5 * 2 + 8 * 2 * 2) * len(out["widths"]) + 4 and out["differed"] == [], out
    broken = {k: v for k, v in out.items() if k.startswith(("unfused_", "lanes_", "levels_"))}
    assert len(broken) == 3
    assert all(v["path"] == "aten" and "differed from ATen's kernel" in v["why"] for v in broken.values()), broken
    assert out["no_compiler"] == {"path": "aten", "why": "no C compiler (cc or gcc) to build the C kernels"}
    assert out["aten"] == {"path": "aten", "why": "KVGRAFT_CKERNELS=aten"}
    assert "scores" in broken[next(k for k in broken if k.startswith("lanes_"))]["why"], broken
    assert out["forced_avx2"] == {"path": "avx2", "why": ""}
    assert "KVGRAFT_CKERNELS='avx-1024' is not one of" in out["bogus"]


def test_above_avx2_atens_own_kernel_runs(tmp_path):
    """Under ATen's AVX-512 capability the codes are packed for its AVX-512 kernel, whose bits are another's: not
    int4mm.c's to reproduce."""
    if "avx512f" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU has no AVX-512")
    p = subprocess.run(
        [sys.executable, "-c", "from kvgraft_cli.engine import ckernels as K; import torch; print(K.status().why)"],
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(REPO), "ATEN_CPU_CAPABILITY": "avx512"},
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0 and p.stdout.strip() == "ATen's capability here is AVX512, not AVX2", p.stderr
