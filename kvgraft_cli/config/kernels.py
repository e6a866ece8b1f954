"""Which kernels compute a run's bits, and the name they go by here: the *kernel identity*. Plain data, no torch.

torch's CPU build hands its work to three libraries that each pick a code path for the CPU they run on: ATen's
own vectorized kernels (the int4 product, norms, softmax, activations; ``ATEN_CPU_CAPABILITY``), MKL's BLAS (the
attention's float32 products; ``MKL_CBWR``) and oneDNN (16-bit dense products; ``ONEDNN_MAX_CPU_ISA``). A manifest
that pins all three names its kernels by itself: the ``portable`` profile (x86-64 baseline) and the ``avx2`` one
(AVX2 and FMA, which every x86-64 CPU since Haswell and Zen has) run the same instructions on every machine that has
them, so their bits are every such machine's. A manifest that leaves any of them to the machine (``native``) computes
bits that belong to this CPU: its kernel identity names the CPU (vendor, model, the instruction sets those libraries
dispatch on) and the libraries left to it, and goes into the compute identity of everything it makes
(:func:`machine_compute_sha256`): an artifact's ``manifest_sha256`` and ``kernels`` metadata, prompt-cache keys,
library keys. Another CPU then computes another identity: its graft is refused, naming both, and `solve` and `serve`
find nothing of the other machine's (a miss, computed here).

The identity errs on the strict side: two CPUs of different models with the same instruction sets are told apart
even where their bits would agree (MKL's automatic path may also depend on cache sizes, which nothing here reads).
On a GPU the manifest's ``runtime.gpu_name`` pins the device already; a CUDA run has no kernel identity here.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

from ..errors import DeviceError

# The libraries that pick a CPU code path of their own, and the variables that pin it (any one of them pins it).
LIBRARIES: dict[str, tuple[str, ...]] = {
    "aten": ("ATEN_CPU_CAPABILITY",),
    "mkl": ("MKL_CBWR",),
    "onednn": ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"),
}

# The instruction sets those libraries dispatch on (/proc/cpuinfo's names): what a kernel identity lists.
ISA_FLAGS = (
    "sse4_1",
    "sse4_2",
    "avx",
    "f16c",
    "fma",
    "avx2",
    "avx_vnni",
    "avx512f",
    "avx512dq",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)

# What a pinned ATEN_CPU_CAPABILITY needs of the CPU. ATen takes the variable at its word: a capability the CPU
# lacks is not capped but run, and dies on its first vector instruction (SIGILL), so it is refused before torch loads.
CAPABILITY_NEEDS = {
    "avx2": ("avx2", "fma"),
    "avx512": ("avx512f", "avx512dq", "avx512bw", "avx512vl", "fma"),
}


@dataclass(frozen=True)
class Cpu:
    """What this machine's CPU says of itself: architecture, vendor, model name and instruction-set flags."""

    arch: str
    vendor: str
    model: str
    flags: frozenset[str]

    @property
    def isa(self) -> list[str]:
        """The instruction sets of ISA_FLAGS this CPU has, in ISA_FLAGS' order."""
        return [f for f in ISA_FLAGS if f in self.flags]

    def missing(self, capability: str) -> list[str]:
        """The flags an ATen capability (``avx2``, ``avx512``; CAPABILITY_NEEDS) needs that this CPU lacks: none for
        one it can run, or for ``default``."""
        return [f for f in CAPABILITY_NEEDS.get(capability.lower(), ()) if f not in self.flags]

    def aten_capability(self) -> str:
        """The capability ATen picks on its own here (its rule: AVX-512 with F, DQ, BW and VL; else AVX2 with FMA)."""
        return next((cap for cap in ("avx512", "avx2") if not self.missing(cap)), "default")


def read_cpu(cpuinfo: str | None = None) -> Cpu:
    """The CPU as /proc/cpuinfo describes its first processor (``cpuinfo``: that file's text, for tests); on a
    system without it, the architecture and platform.processor() with no flags."""
    arch = platform.machine() or "unknown"
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read(1 << 20)
        except OSError:
            return Cpu(arch, "unknown", platform.processor() or arch, frozenset())
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough: every core of a machine is the same CPU here
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = fields.get("flags") or fields.get("Features") or ""
    return Cpu(
        arch,
        fields.get("vendor_id") or fields.get("CPU implementer") or "unknown",
        fields.get("model name") or platform.processor() or arch,
        frozenset(flags.split()),
    )


CPUINFO_ENV = "KVGRAFT_CPUINFO"


@lru_cache(maxsize=1)
def this_cpu() -> Cpu:
    """This machine's CPU (read once a process). ``KVGRAFT_CPUINFO`` names a file in /proc/cpuinfo's format to read
    instead: another machine's CPU, for tests that need a second machine and for working out what identity another
    machine's kernels go by. It changes no kernel (the libraries read the real CPU): ledger lines record it."""
    path = os.environ.get(CPUINFO_ENV)
    if path:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                return read_cpu(f.read(1 << 20))
        except OSError as e:
            raise DeviceError(f"{CPUINFO_ENV}={path}: {e.strerror or e}", f"unset {CPUINFO_ENV}") from None
    return read_cpu()


def left_to_machine(env: Mapping[str, str | None], device: str = "cpu") -> list[str]:
    """The libraries whose code path a manifest's ``runtime.env`` does not pin, so that the CPU picks it: empty for
    ``portable`` and ``avx2``, all three for ``native``; empty on a GPU (runtime.gpu_name pins the device)."""
    if device != "cpu":
        return []
    return [lib for lib, names in LIBRARIES.items() if not any(env.get(n) for n in names)]


def kernel_identity(env: Mapping[str, str | None], device: str = "cpu", cpu: Cpu | None = None) -> str | None:
    """The name of the kernels that compute under a manifest's ``runtime.env`` here, or None where the manifest's pins name them
    (nothing is left to the machine). One line: ``<arch> <vendor> <model> | <instruction sets> | <libraries left to
    the CPU>``; what the manifest does pin is in its compute pin already."""
    libs = left_to_machine(env, device)
    if not libs:
        return None
    cpu = cpu or this_cpu()
    isa = " ".join(cpu.isa) or "-"
    return f"{cpu.arch} {cpu.vendor} {cpu.model} | {isa} | {' '.join(libs)} left to the CPU"


def short_identity(identity: str | None) -> str:
    """A kernel identity for a one-line message: the CPU and its widest instruction sets; "pinned kernels" for None."""
    if identity is None:
        return "kernels pinned by the manifest"
    parts = identity.split(" | ")
    if len(parts) != 3:
        return identity[:120]
    isa = [f for f in parts[1].split() if f in ("avx2", "avx512f", "avx512_bf16", "amx_tile")]
    return f"{parts[0]} ({', '.join(isa) or 'no AVX2'})"


def machine_compute_sha256(
    compute_sha256: str, env: Mapping[str, str | None], device: str = "cpu", cpu: Cpu | None = None
) -> str:
    """The compute identity of what a manifest computes on this machine: its compute pin's hash where the pins name
    the kernels; else the hash of that pin with this machine's kernel identity, so that nothing computed under other
    kernels is ever found, restored or grafted as if it were this machine's."""
    identity = kernel_identity(env, device, cpu)
    if identity is None:
        return compute_sha256
    from ..util.hashing import sha256_json

    return sha256_json({"compute_pin": compute_sha256, "kernels": identity})


def check_capability(env: Mapping[str, str | None], device: str = "cpu", cpu: Cpu | None = None) -> None:
    """Refuse, before torch is imported, a pinned ATen capability this CPU cannot run (DeviceError naming what is
    missing): ATen would run it anyway and die on an illegal instruction."""
    if device != "cpu":
        return
    cap = (env.get("ATEN_CPU_CAPABILITY") or "").lower()
    cpu = cpu or this_cpu()
    missing = cpu.missing(cap)
    if missing:
        raise DeviceError(
            f"the manifest pins ATEN_CPU_CAPABILITY={cap}, which needs {', '.join(CAPABILITY_NEEDS[cap])}; this CPU "
            f"({cpu.model}, {cpu.arch}) lacks {', '.join(missing)}",
            "run it on a CPU that has them, or write a manifest for this one: "
            "`kvgraft manifest init MODEL --profile portable` (any x86-64) or `--profile native` (this CPU's bits)",
        )
