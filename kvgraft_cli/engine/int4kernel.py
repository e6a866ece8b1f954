"""kvgraft's int4 product (int4mm.c): ATen's AVX2 bits at the speed of the CPU's widest vectors.

Under the avx2 profile (``ATEN_CPU_CAPABILITY=avx2``) ATen's int4 kernel runs 8 lanes wide on every CPU, and it is
most of a q4 decode step. Its arithmetic is three fused multiply-adds a weight, each rounded once, in an order fixed
by k (int4mm.c's header): nothing in it depends on the lane count. int4mm.c performs those operations in that order on
16 lanes (AVX-512) or 8 (AVX2), so it gives ATen's AVX2 bits, column for column, on any x86-64 CPU with AVX2 and FMA,
at any row count and thread count. It is used where ATen's kernel would give those bits (ATen's capability is AVX2 in
this process, so the codes are in ATen's AVX2 packing), and only after a product on fixed random inputs, at several
shapes, rows and threads, came out byte-equal to ATen's own (once a process); otherwise ATen's kernel runs: the same
bits, slower. A model's outputs are therefore the same with it or without it, and the ledger does not say which ran.

The C source is compiled on first use with the system's C compiler (``cc``, else ``gcc``) into the user's cache
(``~/.cache/kvgraft/kernels``, named by the hash of the source and the compiler's version), about a second, and is
loaded after torch, so its OpenMP threads are torch's own. No compiler, a failed compile or a failed check: ATen's
kernel, and :func:`status` says why.

``KVGRAFT_INT4_KERNEL`` chooses: ``auto`` (the default: the widest path the CPU has), ``avx512``, ``avx2`` (that
path, refused if the CPU lacks it) or ``aten`` (ATen's kernel always).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..util.fsio import user_cache_dir

SOURCE = Path(__file__).with_name("int4mm.c")
FLAGS = ("-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-fno-fast-math")
CHOICES = ("auto", "avx512", "avx2", "aten")
_WIDTH = {"avx512": 512, "avx2": 256}


@dataclass(frozen=True)
class Status:
    """Which int4 product this process runs: ``path`` is ``avx512``, ``avx2`` (int4mm.c's paths) or ``aten``;
    ``why`` says why ATen's kernel runs, where it does."""

    path: str
    why: str = ""


_LIB: Any = None
_STATUS: Status | None = None


def status() -> Status:
    """The int4 product this process runs (deciding it on first call: compile, load, check)."""
    global _STATUS
    if _STATUS is None:
        _STATUS = _decide()
    return _STATUS


def int4_mm(a, packed, group: int, scales_zeros):
    """``aten._weight_int4pack_mm_for_cpu(a, packed, group, scales_zeros)``'s bits: a [M, K] bfloat16, packed codes
    and [K/group, N, 2] bfloat16 scales and zeros as ATen packs them; through int4mm.c where :func:`status` allows."""
    import torch

    usable = a.dtype == torch.bfloat16 and a.is_contiguous() and packed.is_contiguous() and scales_zeros.is_contiguous()
    if status().path == "aten" or group != 32 or not usable:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(a, packed, group, scales_zeros)
    return _run(a, packed, scales_zeros, _WIDTH[status().path], torch.get_num_threads())


def _run(a, packed, scales_zeros, width: int, threads: int):
    import torch

    m, k = a.shape
    n = scales_zeros.shape[1]
    out = torch.empty(m, n, dtype=torch.bfloat16)
    rc = _LIB.kvg_int4mm(a.data_ptr(), packed.data_ptr(), scales_zeros.data_ptr(), out.data_ptr(), m, n, k, width,
                         threads)  # fmt: skip
    if rc != 0:  # a shape the C code does not take (the caller's shapes are checked once, below)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(a, packed, 32, scales_zeros)
    return out


def _decide() -> Status:
    global _LIB
    want = (os.environ.get("KVGRAFT_INT4_KERNEL") or "auto").strip().lower()
    if want not in CHOICES:
        from ..errors import InputError

        raise InputError(f"KVGRAFT_INT4_KERNEL={want!r} is not one of {', '.join(CHOICES)}", hint="unset it for auto")
    if want == "aten":
        return Status("aten", "KVGRAFT_INT4_KERNEL=aten")
    import torch

    cap = torch.backends.cpu.get_cpu_capability()
    if cap != "AVX2":  # another packing and, above AVX2, other bits: ATen's kernel is this process's arithmetic
        return Status("aten", f"ATen's capability here is {cap}, not AVX2")
    try:
        lib = _load()
    except _NoKernel as e:
        return Status("aten", str(e))
    width = lib.kvg_int4_isa()
    path = {512: "avx512", 256: "avx2"}.get(width, "")
    if want != "auto":
        if _WIDTH[want] > width:
            from ..errors import InputError

            raise InputError(f"KVGRAFT_INT4_KERNEL={want}: this CPU has no such vectors", hint="unset it for auto")
        path = want
    if not path:
        return Status("aten", "this CPU lacks AVX2 or FMA")
    _LIB = lib
    bad = _check(_WIDTH[path])
    if bad:
        _LIB = None
        return Status("aten", f"int4mm.c's {path} path differed from ATen's kernel ({bad})")
    return Status(path)


class _NoKernel(Exception):
    pass


def _compiler() -> str:
    for cc in (os.environ.get("CC") or "", "cc", "gcc"):
        if cc and shutil.which(cc):
            return cc
    raise _NoKernel("no C compiler (cc or gcc) to build int4mm.c")


def _load():
    """int4mm.c compiled (once a machine, in the user's cache) and loaded."""
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise _NoKernel(f"{cc} --version failed: {e}") from None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + version.encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    base = user_cache_dir()
    folder = (base if base is not None else Path(tempfile.gettempdir()) / "kvgraft") / "kernels"
    lib = folder / f"int4mm-{key}.so"
    if not lib.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".int4mm-", suffix=".so")
        os.close(fd)
        try:
            done = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise _NoKernel(f"{cc} could not build int4mm.c: {(done.stderr or done.stdout).strip()[-300:]}")
            os.replace(tmp, lib)  # atomic: a process beside this one loads a whole file or builds its own
        except (OSError, subprocess.SubprocessError) as e:
            raise _NoKernel(f"{cc} could not build int4mm.c: {e}") from None
        finally:
            Path(tmp).unlink(missing_ok=True)
    try:
        handle = ctypes.CDLL(str(lib))
    except OSError as e:
        raise _NoKernel(f"could not load {lib}: {e}") from None
    p, i = ctypes.c_void_p, ctypes.c_int
    handle.kvg_int4mm.argtypes = [p, p, p, p, i, i, i, i, i]
    handle.kvg_int4mm.restype = i
    handle.kvg_int4_isa.restype = i
    return handle


# Shapes of the check: a full tile and ragged ones, a last block of 16 columns, several groups along k.
_CHECK_SHAPES = ((208, 96), (96, 64), (48, 32))
_CHECK_ROWS = (1, 2, 3, 4, 5, 9)


def check_inputs(n: int, k: int, m: int, g):
    """A product whose bits show a difference in arithmetic (codes, scales and zeros, activations): the output is
    bfloat16, which hides a float32 result's last bits, so half the rows cancel. Codes repeat in pairs along k and
    those rows' activations are +x, -x in each pair, 2^8 times larger: the exact sum is 0, and the result is what the
    roundings left, which a multiply and an add rounded apart, another dequantization or another order all change."""
    import torch

    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
    codes[:, 1::2] = codes[:, 0::2]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    sz = torch.stack([torch.randn(k // 32, n, generator=g) * 0.02, torch.randn(k // 32, n, generator=g) * 0.01], -1)
    a = torch.randn(m, k, generator=g) * 3
    a[1::2, 0::2] *= 256
    a[1::2, 1::2] = -a[1::2, 0::2]
    return a.to(torch.bfloat16), packed, sz.to(torch.bfloat16).contiguous()


def _check(width: int) -> str:
    """'' if int4mm.c's ``width`` path gives ATen's bits on :func:`check_inputs` (each shape, row count, 1 and 2
    threads), else what differed."""
    import torch

    g = torch.Generator().manual_seed(44)
    for n, k in _CHECK_SHAPES:
        for m in _CHECK_ROWS:
            a, packed, sz = check_inputs(n, k, m, g)
            want = torch.ops.aten._weight_int4pack_mm_for_cpu(a, packed, 32, sz).view(torch.int16)
            for threads in (1, 2):
                if not torch.equal(_run(a, packed, sz, width, threads).view(torch.int16), want):
                    return f"{m}x{k} by {k}x{n}, {threads} thread(s)"
    return ""
