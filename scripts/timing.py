"""The benchmark scripts' one timing harness: a callable timed over repeats (median), and a stopwatch for a span of
code. Wall-clock seconds from ``time.perf_counter``; ratios the scripts print come from runs side by side in one
process or one interleaved run, never from figures taken at different times (machines here are shared and noisy)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


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
