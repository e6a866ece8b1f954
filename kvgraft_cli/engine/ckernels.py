"""kvgraft's C kernels: ATen's AVX2 bits at the speed of the CPU's widest vectors (int4mm.c, attnsum.c).

Under the avx2 profile (``ATEN_CPU_CAPABILITY=avx2``) ATen's kernels run 8 lanes wide on every CPU. Two of them are
most of a q4 decode step, and neither's arithmetic depends on the lane count, only on an order of operations that the
shapes fix:

- the int4 product (``aten._weight_int4pack_mm_for_cpu``): three fused multiply-adds a weight, in k's order
  (int4mm.c's header);
- attention's products under ``model.attn_products: aten`` (engine.attention): a float32 multiply into a temporary,
  then ATen's cascade sum (attnsum.c's header).

The C code performs those operations in that order on 16 lanes (AVX-512) or 8 (AVX2), and the products without their
temporaries, so it gives ATen's AVX2 bits on any x86-64 CPU with AVX2 and FMA, at any row count and thread count. It
runs where ATen's kernels would give those bits (ATen's capability is AVX2 in this process, so the int4 codes are in
ATen's AVX2 packing and its sums are 8 lanes wide), and only after products on fixed inputs, at several shapes, rows
and threads, came out byte-equal to ATen's own (once a process); otherwise ATen's kernels run: the same bits, slower.
A model's outputs are therefore the same with it or without it; the ledger's ``environment.ckernels`` names which
ran.

The C sources are compiled on first use with the system's C compiler (``$CC``, ``cc`` or ``gcc``) into the user's
cache (``~/.cache/kvgraft/kernels``, named by the hash of the sources, the flags and the compiler's version), in about
3 s, and loaded after torch, so their OpenMP threads are torch's own. No compiler, a failed compile or a failed
check: ATen's kernels, and :func:`status` says why.

``KVGRAFT_CKERNELS`` chooses: ``auto`` (the default: the widest path the CPU has), ``avx512``, ``avx2`` (that
path, refused if the CPU lacks it) or ``aten`` (ATen's kernels always).
"""

from __future__ import annotations

import contextlib
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

SOURCES = (Path(__file__).with_name("int4mm.c"), Path(__file__).with_name("attnsum.c"))
FLAGS = ("-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-fno-fast-math")
CHOICES = ("auto", "avx512", "avx2", "aten")
_WIDTH = {"avx512": 512, "avx2": 256}


@dataclass(frozen=True)
class Status:
    """Which kernels this process runs for the int4 product and attention's ATen products: ``path`` is ``avx512``,
    ``avx2`` (the C code's paths) or ``aten``; ``why`` says why ATen's kernels run, where they do."""

    path: str
    why: str = ""


_LIB: Any = None
_STATUS: Status | None = None


def status() -> Status:
    """The kernels this process runs (deciding on first call: compile, load, check)."""
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


def scores(q, key):
    """``engine.attention.aten_scores(q, key)``'s bits (q [b, h, m, d], key [b, h, n, d], float32), or None where the
    C code does not run (then the caller computes them with ATen; this module imports nothing of engine.attention)."""
    if not _attention_ok(q, key):
        return None
    return _scores(q, key, _WIDTH[status().path], _threads())


def mix(weights, value):
    """``engine.attention.aten_mix(weights, value)``'s bits (weights [b, h, m, n], value [b, h, n, d], float32), or
    None where the C code does not run."""
    if not _attention_ok(weights, value) or weights.shape[3] != value.shape[2]:
        return None
    return _mix(weights, value, _WIDTH[status().path], _threads())


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _attention_ok(a, b) -> bool:
    import torch

    return (
        status().path != "aten"
        and a.dtype == torch.float32
        and b.dtype == torch.float32
        and a.dim() == 4
        and b.dim() == 4
        and a.shape[:2] == b.shape[:2]
        and a.stride(3) == 1
        and b.stride(3) == 1
        and a.device.type == "cpu"
        and b.device.type == "cpu"
    )


def _scores(q, key, width: int, threads: int):
    import torch

    bsz, h, m, d = q.shape
    n = key.shape[2]
    out = torch.empty(bsz, h, m, n, dtype=torch.float32)
    if n == 0 or m == 0:
        return out
    qs, ks = q.stride(), key.stride()
    rc = _LIB.kvg_scores(q.data_ptr(), key.data_ptr(), out.data_ptr(), bsz, h, m, n, d, qs[0], qs[1], qs[2], ks[0],
                         ks[1], ks[2], width, threads)  # fmt: skip
    return out if rc == 0 else None  # a shape the C code does not take: the caller computes it with ATen


def _mix(weights, value, width: int, threads: int):
    import torch

    bsz, h, m, n = weights.shape
    d = value.shape[3]
    out = torch.empty(bsz, h, m, d, dtype=torch.float32)
    if m == 0:
        return out
    ws, vs = weights.stride(), value.stride()
    rc = _LIB.kvg_mix(weights.data_ptr(), value.data_ptr(), out.data_ptr(), bsz, h, m, n, d, ws[0], ws[1], ws[2],
                      vs[0], vs[1], vs[2], width, threads)  # fmt: skip
    return out if rc == 0 else None


def _decide() -> Status:
    global _LIB
    want = (os.environ.get("KVGRAFT_CKERNELS") or "auto").strip().lower()
    if want not in CHOICES:
        from ..errors import InputError

        raise InputError(f"KVGRAFT_CKERNELS={want!r} is not one of {', '.join(CHOICES)}", hint="unset it for auto")
    if want == "aten":
        return Status("aten", "KVGRAFT_CKERNELS=aten")
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

            raise InputError(f"KVGRAFT_CKERNELS={want}: this CPU has no such vectors", hint="unset it for auto")
        path = want
    if not path:
        return Status("aten", "this CPU lacks AVX2 or FMA")
    _LIB = lib
    bad = _check(_WIDTH[path])
    if bad:
        _LIB = None
        return Status("aten", f"the C kernels' {path} path differed from ATen's kernel ({bad})")
    return Status(path)


class _NoKernel(Exception):
    pass


def _compiler() -> str:
    for cc in (os.environ.get("CC") or "", "cc", "gcc"):
        if cc and shutil.which(cc):
            return cc
    raise _NoKernel("no C compiler (cc or gcc) to build the C kernels")


def _load():
    """The C sources compiled into one library (once a machine, in the user's cache) and loaded."""
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise _NoKernel(f"{cc} --version failed: {e}") from None
    source = b"".join(p.read_bytes() for p in SOURCES)
    key = hashlib.sha256(source + version.encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    base = user_cache_dir()
    folder = (base if base is not None else Path(tempfile.gettempdir()) / "kvgraft") / "kernels"
    lib = folder / f"kvgraft-{key}.so"
    if not lib.is_file():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".kvgraft-", suffix=".so")
        except OSError as e:
            raise _NoKernel(f"cannot write the C kernels into {folder}: {e}") from None
        os.close(fd)
        try:
            sources = [str(p) for p in SOURCES]
            done = subprocess.run([cc, *FLAGS, "-o", tmp, *sources], capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise _NoKernel(f"{cc} could not build the C kernels: {(done.stderr or done.stdout).strip()[-300:]}")
            os.replace(tmp, lib)  # atomic: a process beside this one loads a whole file or builds its own
        except (OSError, subprocess.SubprocessError) as e:
            raise _NoKernel(f"{cc} could not build the C kernels: {e}") from None
        finally:
            Path(tmp).unlink(missing_ok=True)
    try:
        handle = ctypes.CDLL(str(lib))
    except OSError as e:
        raise _NoKernel(f"could not load {lib}: {e}") from None
    p, i = ctypes.c_void_p, ctypes.c_int
    handle.kvg_int4mm.argtypes = [p, p, p, p, i, i, i, i, i]
    handle.kvg_int4mm.restype = i
    n = ctypes.c_long
    for name in ("kvg_scores", "kvg_mix"):
        getattr(handle, name).argtypes = [p, p, p, i, i, i, i, i, n, n, n, n, n, n, i, i]
        getattr(handle, name).restype = i
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


def check_attention_inputs(b: int, h: int, m: int, n: int, d: int, g):
    """(q, key, weights, value) for attention's products: random, with every fourth key a near-negation of the one
    before (partial sums that cancel, so float32's roundings reach the output's leading bits), as views with
    strides a cache's have (the keys' heads apart by a capacity larger than n)."""
    import torch

    q = torch.randn(b, h, m, d, generator=g)
    store = torch.randn(2, b, h, n + 7, d, generator=g) * 4
    store[:, :, :, 1::4] = -store[:, :, :, 0:-1:4][:, :, :, : store[:, :, :, 1::4].shape[3]] * (1 + 2**-20)
    key, value = store[0, :, :, :n], store[1, :, :, :n]
    weights = torch.softmax(torch.randn(b, h, m, n, generator=g) * 3, dim=-1)
    return q, key, weights, value


# Shapes of the attention check (b, h, m, n, d): d of whole 32-lane groups, with 16 and 8 lanes past them (80, 40),
# and small; n across multi_row_sum's levels (16 and 256 rows) and not a multiple of 4
_ATTENTION_SHAPES = ((1, 3, 3, 1, 64), (1, 2, 1, 19, 80), (2, 3, 4, 300, 64), (1, 1, 2, 4099, 40), (1, 2, 3, 70, 8))


def aten_products(q, key, weights, value):
    """Q·Kᵀ and weights·V as engine.attention's ``aten`` products compute them: ATen's elementwise product and sum
    (its query rows taken all at once here: how many it takes at a time does not change a bit, tests/
    test_attention_products.py)."""
    return (q.unsqueeze(3) * key.unsqueeze(2)).sum(-1), (weights.unsqueeze(-1) * value.unsqueeze(2)).sum(-2)


def _check(width: int) -> str:
    """'' if the C kernels' ``width`` path gives ATen's bits on :func:`check_inputs` (each shape and row count) and
    :func:`check_attention_inputs`, at 1 and 2 threads and this process's count, else what differed."""
    import torch

    counts = sorted({1, 2, torch.get_num_threads()})  # and the count this process runs at, the manifest's
    g = torch.Generator().manual_seed(44)
    for shape in _ATTENTION_SHAPES:
        q, key, weights, value = check_attention_inputs(*shape, g)
        for threads in counts:
            with _with_threads(threads):  # ATen's bits at the thread count the manifest pins
                want = aten_products(q, key, weights, value)
            got = _scores(q, key, width, threads), _mix(weights, value, width, threads)
            for what, x, y in (("scores", got[0], want[0]), ("mix", got[1], want[1])):
                if x is None or not torch.equal(x.view(torch.int32), y.view(torch.int32)):
                    return f"attention {what} {shape}, {threads} thread(s)"

    g = torch.Generator().manual_seed(44)
    for n, k in _CHECK_SHAPES:
        for m in _CHECK_ROWS:
            a, packed, sz = check_inputs(n, k, m, g)
            want = torch.ops.aten._weight_int4pack_mm_for_cpu(a, packed, 32, sz).view(torch.int16)
            for threads in counts:
                if not torch.equal(_run(a, packed, sz, width, threads).view(torch.int16), want):
                    return f"int4 {m}x{k} by {k}x{n}, {threads} thread(s)"
    return ""


@contextlib.contextmanager
def _with_threads(n: int):
    """torch's thread count set to ``n`` for a block, and set back."""
    import torch

    was = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(was)
