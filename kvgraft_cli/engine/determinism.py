"""Kernel flags and the effective environment: apply a manifest's pins, read back what is in force, name drift.

Some flags only take effect if set before torch is imported (``MKL_CBWR``, ``ATEN_CPU_CAPABILITY``,
``CUBLAS_WORKSPACE_CONFIG``): :func:`apply_environment` must run first. kvgraft's commands import torch inside the
command body, after it. When torch was already imported with other values, that is reported as drift, never hidden.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..config.profiles import KNOWN_BIT_ENV, profile_env
from ..errors import DeviceError, DriftError, engine_not_installed

if TYPE_CHECKING:
    from ..config.sections import RuntimeSection


@dataclass
class Drift:
    """Differences between the manifest's pin and the effective environment."""

    items: list[dict[str, Any]] = field(default_factory=list)

    def add(self, what: str, pinned: Any, effective: Any) -> None:
        self.items.append({"field": what, "pinned": pinned, "effective": effective})

    def __bool__(self) -> bool:
        return bool(self.items)

    def describe(self) -> str:
        from ..config.manifest import clip

        return "; ".join(
            f"{clip(d['field'], 80)}: pinned {clip(repr(d['pinned']), 120)}, effective "
            f"{clip(repr(d['effective']), 120)}"
            for d in self.items
        )

    def enforce(self, allow: bool, source: str) -> None:
        """Raise DriftError unless ``allow``; with ``allow`` the caller records the items in the ledger."""
        if self and not allow:
            raise DriftError(
                f"effective environment differs from the manifest {source}: {self.describe()}",
                "run in the pinned environment, write a manifest for this one (`kvgraft manifest init`), "
                "or pass --allow-drift to proceed and record the drift in the ledger",
            )


def apply_environment(pinned_env: Mapping[str, str | None], device: str = "cpu") -> Drift:
    """Set a manifest's ``runtime.env`` (before torch is imported) and report what cannot take effect.
    DeviceError for a pinned ATen capability this CPU cannot run (config.kernels.check_capability)."""
    from ..config.kernels import check_capability

    check_capability(pinned_env, device)
    drift = Drift()
    torch_loaded = "torch" in sys.modules
    for name, value in pinned_env.items():
        current = os.environ.get(name)
        if current == value:
            continue
        if torch_loaded:
            # Too late: the library read the old value at import. Record what is in force.
            drift.add(f"env.{name}", value, f"{current!r} (torch already imported)")
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    for name in KNOWN_BIT_ENV:
        if name not in pinned_env and name in os.environ:
            drift.add(f"env.{name}", "(not pinned)", os.environ[name])
    return drift


def cpu_name() -> str:
    """The CPU model name (Linux /proc/cpuinfo; platform.processor() elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def pin_profile(profile: str, device: str = "cpu") -> None:
    """Apply a kernel-flag profile's environment before torch is imported (for code that builds its own models: the
    matrix, the benchmarks, the check at scale); DriftError if torch was already imported with other values."""
    apply_environment(profile_env(profile, device), device).enforce(False, f"profile {profile}")


def configure_torch(runtime: RuntimeSection, drift: Drift) -> Any:
    """Import torch and apply threads, seed, determinism and TF32 flags; check versions and device. Returns the device."""
    try:
        import torch
        import transformers
    except ImportError as e:
        raise engine_not_installed(e) from None

    for lib, have in (("torch", torch.__version__), ("transformers", transformers.__version__)):
        want = runtime.versions[lib]
        if have != want:
            drift.add(f"runtime.versions.{lib}", want, have)

    torch.set_num_threads(runtime.threads)
    if torch.get_num_threads() != runtime.threads:
        drift.add("runtime.threads", runtime.threads, torch.get_num_threads())
    torch.manual_seed(runtime.seed)
    torch.use_deterministic_algorithms(runtime.deterministic_algorithms)
    allow_tf32 = runtime.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    torch.backends.cudnn.allow_tf32 = allow_tf32
    torch.set_float32_matmul_precision("high" if allow_tf32 else "highest")

    # The capability ATen dispatches to, read back: a pin set after torch was imported does not take effect.
    # Left to the machine, it must be the one the kernel identity names (config.kernels: the CPU's own).
    if runtime.device == "cpu":
        from ..config.kernels import this_cpu

        want_cap = runtime.env.get("ATEN_CPU_CAPABILITY") or this_cpu().aten_capability()
        have_cap = aten_capability()
        if have_cap.lower() != want_cap.lower():
            drift.add("effective ATen capability", want_cap, have_cap)

    want_cpu = runtime.cpu_name
    if want_cpu and want_cpu != cpu_name():
        drift.add("runtime.cpu_name", want_cpu, cpu_name())

    if runtime.device == "cuda":
        return _configure_cuda(torch, runtime, drift)
    return torch.device("cpu")


def _configure_cuda(torch, runtime: RuntimeSection, drift: Drift):
    if not torch.cuda.is_available():
        raise DeviceError(
            "the manifest asks for device cuda, but no CUDA GPU is visible to torch "
            f"(torch {torch.__version__}, cuda build: {torch.version.cuda or 'no'})",
            "run on a machine with a GPU and a CUDA build of torch, or use a manifest with runtime.device: cpu",
        )
    name = torch.cuda.get_device_name(0)
    if runtime.gpu_name and name != runtime.gpu_name:
        drift.add("runtime.gpu_name", runtime.gpu_name, name)
    if runtime.deterministic_algorithms and os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
        drift.add(
            "env.CUBLAS_WORKSPACE_CONFIG",
            ":4096:8 or :16:8 (needed for deterministic cuBLAS)",
            os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        )
    torch.backends.cudnn.deterministic = runtime.deterministic_algorithms
    torch.backends.cudnn.benchmark = False
    return torch.device("cuda:0")


def aten_capability() -> str:
    """The CPU capability ATen's kernels dispatch to in this process (``AVX2``, ``AVX512``, ``DEFAULT``, ...)."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def visible_gpu_name() -> str:
    """The name of CUDA device 0 as torch reports it (what a manifest's runtime.gpu_name pins); DeviceError if
    torch sees no GPU here."""
    try:
        import torch
    except ImportError as e:
        raise engine_not_installed(e) from None
    if not torch.cuda.is_available():
        raise DeviceError("--device cuda: no CUDA GPU is visible here", "write the manifest on the GPU machine")
    return torch.cuda.get_device_name(0)


def sdpa_context(backend: str | None):
    """A context manager that pins the SDPA backend a manifest's ``runtime.sdpa_backend`` names (None: a no-op)."""
    import contextlib

    if not backend:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {"math": "MATH", "efficient": "EFFICIENT_ATTENTION", "flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
    return sdpa_kernel([getattr(SDPBackend, names[backend])])


def effective_environment(runtime: RuntimeSection, device: Any = None) -> dict[str, Any]:
    """What is in force now, for the ledger: versions, machine, device, threads, kernel flags, env variables."""
    from .. import __version__

    env_names = sorted(set(KNOWN_BIT_ENV) | set(runtime.env))
    out: dict[str, Any] = {
        "kvgraft": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu_name(),
        "env": {n: os.environ.get(n) for n in env_names},
    }
    if "torch" in sys.modules:
        import torch
        import transformers

        out.update(
            torch=torch.__version__,
            transformers=transformers.__version__,
            threads=torch.get_num_threads(),
            deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
            allow_tf32=bool(torch.backends.cuda.matmul.allow_tf32),
            device=str(device) if device is not None else runtime.device,
            gpu=torch.cuda.get_device_name(0) if device is not None and str(device).startswith("cuda") else None,
        )
    return out
