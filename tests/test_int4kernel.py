"""kvgraft's int4 product (kvgraft_cli/engine/int4mm.c) gives ATen's AVX2 kernel's bits, byte for byte.

Each check runs in a child process pinned to ATen's AVX2 capability (ATen reads it once, at import), as the avx2
profile runs: the C code is compiled into a cache folder of the test's own, and both of its vector paths the CPU has
are compared with `aten._weight_int4pack_mm_for_cpu` at the real model's shapes (SmolLM2-135M's 576x576, 960x576
fused, 1536x576, 576x1536, 3072x576 fused, and a ragged last block of 16), at 1 to 17 rows, 1 and 2 threads, with
rows that cancel (so that bfloat16 shows the float32 roundings) and NaN, infinities, subnormals and large values among
the inputs. Then the guards: copies with other arithmetic (the accumulation as a multiply and an add, each rounded;
ATen's AVX-512 dequantization) are caught by the check at load and ATen's kernel runs; no compiler, ATen's capability
above AVX2 and KVGRAFT_INT4_KERNEL=aten all run ATen's kernel and say why. The real model's end-to-end bits under
int4mm.c are tests/test_main_prereg.py's: the committed pre-registration, made under ATen's kernel on another CPU,
replayed hash for hash.
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
    """
    import json, os, sys
    import torch
    from kvgraft_cli.engine import int4kernel as K
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
    for n, k in ((576, 576), (960, 576), (1536, 576), (576, 1536), (3072, 576), (208, 96)):
        for m in (1, 2, 3, 4, 5, 8, 16, 17):
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
    out.update(widths=widths, compared=compared, differed=differed)

    # Copies of int4mm.c with other arithmetic, each caught by the check at load (ATen's kernel runs instead): the
    # accumulation as a multiply and an add, each rounded; ATen's AVX-512 dequantization, w = fma(code - 8, s, z)
    source = K.SOURCE.read_text()
    unfused = source
    for width in ("512", "256"):
        for i in ("[t][0]", "[t][1]", "[t][v]"):
            unfused = unfused.replace(
                f"acc[r]{i} = _mm{width}_fmadd_ps(a, w{i}, acc[r]{i})",
                f"acc[r]{i} = _mm{width}_add_ps(_mm{width}_mul_ps(a, w{i}), acc[r]{i})",
            )
    dequant = source.replace("z[j] = __builtin_fmaf(sc, -8.0f, bf16f(p[2 * j + 1]));", "z[j] = bf16f(p[2 * j + 1]);")
    for width, vec in (("512", "si512"), ("256", "si256")):
        for nibble in (f"_mm{width}_and_{vec}(q, low)", f"_mm{width}_srli_epi32(q, 4)", f"_mm{width}_and_{vec}(q0, low)",
                       f"_mm{width}_and_{vec}(q1, low)", f"_mm{width}_srli_epi32(q0, 4)", f"_mm{width}_srli_epi32(q1, 4)"):
            dequant = dequant.replace(f"_mm{width}_cvtepi32_ps({nibble})",
                                      f"_mm{width}_cvtepi32_ps(_mm{width}_sub_epi32({nibble}, _mm{width}_set1_epi32(8)))")
    real = K.SOURCE
    for name, text in (("unfused", unfused), ("dequant", dequant)):
        assert text != source, name
        for width in ("avx512", "avx2") if lib.kvg_int4_isa() == 512 else ("avx2",):
            copy = os.path.join(sys.argv[1], f"int4mm_{name}.c")
            open(copy, "w").write(text)
            K.SOURCE = type(real)(copy)
            reset(KVGRAFT_INT4_KERNEL=width)
            out[f"{name}_{width}"] = K.status().__dict__
    K.SOURCE = real
    reset(KVGRAFT_INT4_KERNEL=None)

    path = os.environ["PATH"]
    reset(PATH="/nonexistent", CC=None)
    out["no_compiler"] = K.status().__dict__
    reset(PATH=path, KVGRAFT_INT4_KERNEL="aten")
    out["aten"] = K.status().__dict__
    reset(KVGRAFT_INT4_KERNEL="avx2")
    out["forced_avx2"] = K.status().__dict__
    reset(KVGRAFT_INT4_KERNEL="avx-1024")
    try:
        K.status()
    except InputError as e:
        out["bogus"] = e.message
    print(json.dumps(out))
    """
)


def _child(tmp_path, **env):
    full = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONPATH": str(REPO), **env}
    full.pop("KVGRAFT_INT4_KERNEL", None)
    full.update(env)
    p = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], env=full, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.splitlines()[-1])


def test_int4mm_gives_atens_avx2_bits_and_its_guards_hold(tmp_path):
    out = _child(tmp_path, ATEN_CPU_CAPABILITY="avx2")
    assert out["capability"] == "AVX2"
    assert out["status"]["path"] in ("avx512", "avx2"), out["status"]
    assert list((tmp_path / "cache" / "kvgraft" / "kernels").glob("int4mm-*.so"))  # compiled into the user's cache
    assert out["compared"] == 6 * 8 * 2 * len(out["widths"]) + 6 and out["differed"] == [], out
    broken = {k: v for k, v in out.items() if k.startswith(("unfused_", "dequant_"))}
    assert len(broken) == 2 * len(out["widths"])
    assert all(v["path"] == "aten" and "differed from ATen's kernel" in v["why"] for v in broken.values()), broken
    assert out["no_compiler"] == {"path": "aten", "why": "no C compiler (cc or gcc) to build int4mm.c"}
    assert out["aten"] == {"path": "aten", "why": "KVGRAFT_INT4_KERNEL=aten"}
    assert out["forced_avx2"] == {"path": "avx2", "why": ""}
    assert "KVGRAFT_INT4_KERNEL='avx-1024' is not one of" in out["bogus"]


def test_above_avx2_atens_own_kernel_runs(tmp_path):
    """Under ATen's AVX-512 capability the codes are packed for its AVX-512 kernel, whose bits are another's: not
    int4mm.c's to reproduce."""
    if "avx512f" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU has no AVX-512")
    p = subprocess.run(
        [sys.executable, "-c", "from kvgraft_cli.engine import int4kernel as K; import torch; print(K.status().why)"],
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(REPO), "ATEN_CPU_CAPABILITY": "avx512"},
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0 and p.stdout.strip() == "ATen's capability here is AVX512, not AVX2", p.stderr
