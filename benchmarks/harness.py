"""The benchmarks' one harness: timing (a callable over repeats, a stopwatch, rounds interleaved), and what every
result file says about where it was measured (:func:`environment`: the CPU and its instruction sets, threads,
versions, the commit) written with the results (:func:`write_json`).

Wall-clock seconds from ``time.perf_counter``. The ratios a benchmark prints come from runs side by side in one
process or one interleaved run, never from figures taken at different times: machines here are shared and noisy,
and a figure is a CPU's (an AMD EPYC and an Intel Xeon give other ratios), so every result names its machine.

A benchmark imports it as ``from harness import ...``: benchmarks/, the script's own folder, is first on sys.path.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def timed(fn: Callable[[], Any], repeat: int = 1) -> tuple[float, Any]:
    """(median seconds of ``repeat`` calls of ``fn``, the last call's result)."""
    times, out = [], None
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


class Lap:
    """Seconds a ``stopwatch`` block took (``s``), set when the block ends."""

    s: float = float("nan")


@contextmanager
def stopwatch() -> Iterator[Lap]:
    """``with stopwatch() as lap: ...`` then ``lap.s``: the block's wall-clock seconds (also if it raised)."""
    lap = Lap()
    t0 = time.perf_counter()
    try:
        yield lap
    finally:
        lap.s = time.perf_counter() - t0


def median(values) -> float:
    """The median of ``values`` (NaN for none): what a table prints for repeated laps."""
    values = list(values)
    return statistics.median(values) if values else float("nan")


def interleaved(runs: dict[str, Callable[[], Any]], repeat: int) -> dict[str, list[float]]:
    """Seconds of each of ``runs`` over ``repeat`` rounds, each round calling every one once in turn (so a burst of
    the machine's noise falls on all of them alike, not on whichever ran during it). Returns the laps by name."""
    laps: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeat):
        for name, fn in runs.items():
            with stopwatch() as lap:
                fn()
            laps[name].append(lap.s)
    return laps


def fresh_dir(path: Path | None, prefix: str) -> Path:
    """A benchmark's folder: ``path`` made new (SystemExit when it exists: a run starts from nothing), or a new
    temporary one named ``prefix``...."""
    import tempfile

    if path is None:
        return Path(tempfile.mkdtemp(prefix=prefix))
    if path.exists():
        raise SystemExit(f"{path} exists; the benchmark starts from a fresh folder")
    path.mkdir(parents=True)
    return path.resolve()


def cpu() -> dict[str, Any]:
    """This machine's CPU as /proc/cpuinfo names it (kvgraft_cli.config.kernels.read_cpu, the reader kernel
    identities use): model, logical CPUs, and the instruction sets that decide which kernels run (AVX2, AVX-512's
    extensions, AMX)."""
    from kvgraft_cli.config.kernels import read_cpu

    c = read_cpu()
    return {
        "model": c.model,
        "logical_cpus": os.cpu_count(),
        "avx2": "avx2" in c.flags,
        "avx512": sorted(f for f in c.flags if f.startswith("avx512")),
        "amx": sorted(f for f in c.flags if f.startswith("amx")),
    }


def environment() -> dict[str, Any]:
    """Where a result was measured: the CPU, Python, the package versions that decide the figures (those
    installed; torch's own build tag when it is imported), the checkout's commit, and the time."""
    from importlib import metadata

    versions = {}
    for dist in ("kvgraft", "torch", "transformers", "llama-cpp-python"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    if "torch" in sys.modules:
        import torch

        versions["torch"] = torch.__version__
        versions["torch_threads"] = torch.get_num_threads()
    git = subprocess.run(
        ["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True, check=False
    )
    return {
        "cpu": cpu(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
        "commit": git.stdout.strip() or None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_json(path: str | Path, results: Any, **settings: Any) -> Path:
    """Write a benchmark's ``results`` with its ``settings`` and :func:`environment` to ``path`` (JSON, written
    whole then renamed into place, so a reader never sees half a file). Returns the path."""
    path = Path(path)
    payload = {"environment": environment(), "settings": settings, "results": results}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path
