"""The served traffic a report shows: `kvgraft serve`'s ledger lines (one ``serve`` line per request, read into rows
by report/collect.py) summarized (torch-free, no import of the rest of the report).

A summary counts the requests by library hit, finish reason and endpoint, sums their recorded token counts, and gives
latency percentiles by the **nearest-rank** method: the p-th percentile of n values is the ceil(p/100 * n)-th
smallest, so every percentile shown is one request's recorded value, cited by its line (p99 of fewer than 100
requests is the slowest). Latency is over the requests not cancelled (a cancelled request's times end when it was
cancelled); counts and tokens are over every request, as recorded.
"""

from __future__ import annotations

import math
from typing import Any

HITS = ("exact", "related", "none", "plain")  # inputs.library.hit, in the order the page shows them
FINISH = ("stop", "length", "cancelled")  # outputs.finish_reason
ENDPOINTS = ("chat", "completion")  # inputs.request.endpoint
TOKENS = ("prompt_tokens", "grafted_tokens", "cached_tokens", "prefill_tokens", "decode_tokens")
TIMES = ("first_token_s", "wall_s", "queue_s")
PERCENTILES = (50, 99)


def percentile(values: list[tuple[float, int]], p: float) -> dict[str, Any] | None:
    """The nearest-rank ``p``-th percentile of (value, line) pairs, as {value, line}: the ceil(p/100 * n)-th
    smallest finite value (ties in line order). None when no value is finite."""
    finite = sorted(((v, line) for v, line in values if math.isfinite(v)), key=lambda x: (x[0], x[1]))
    if not finite:
        return None
    rank = max(1, math.ceil(p / 100 * len(finite)))
    v, line = finite[rank - 1]
    return {"value": v, "line": line}


def value(row: dict[str, Any], key: str) -> str:
    """A row's recorded text under ``key``, or ``(not recorded)``."""
    return row[key] if row[key] is not None else "(not recorded)"


def tally(rows: list[dict[str, Any]], key: str, known: tuple[str, ...]) -> dict[str, int]:
    """Requests by the value of ``key``: the known values first (0 when none), then any other recorded value."""
    counts = dict.fromkeys(known, 0)
    for r in rows:
        counts[value(r, key)] = counts.get(value(r, key), 0) + 1
    return counts


def _sum(rows: list[dict[str, Any]], key: str) -> int | None:
    """The recorded counts summed (None when no row records one)."""
    values = [r[key] for r in rows if r[key] is not None]
    return sum(values) if values else None


def cache_use(row: dict[str, Any]) -> str:
    """Whether a request's prompt was restored from the prompt cache: ``restored`` (at least one chunk or token),
    ``not restored``, or ``off`` (the server ran without the prompt cache: no chunk size recorded)."""
    if row["cache_chunks"] or (row["cached_tokens"] or 0) > 0:
        return "restored"
    return "off" if row["chunk"] is None else "not restored"


def latency(rows: list[dict[str, Any]], label: str) -> dict[str, Any]:
    """The latency percentiles of ``rows`` (not cancelled) as {group, requests, <time>: {p50, p99}}."""
    out: dict[str, Any] = {"group": label, "requests": len(rows)}
    for t in TIMES:
        values = [(r[t], r["line"]) for r in rows if r[t] is not None]
        out[t] = {f"p{p}": percentile(values, p) for p in PERCENTILES}
    return out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary of one model and configuration's ``serve`` rows (in ledger order; see the module docstring)."""
    done = [r for r in rows if r["finish_reason"] != "cancelled"]
    groups = [latency(done, "all")]
    for hit in tally(rows, "hit", HITS):
        these = [r for r in done if value(r, "hit") == hit]
        if these:
            groups.append(latency(these, f"library hit: {hit}"))
    for use in ("restored", "not restored", "off"):
        these = [r for r in done if cache_use(r) == use]
        if these:
            groups.append(latency(these, f"prompt cache: {use}"))
    return {
        "requests": len(rows),
        "first_line": rows[0]["line"] if rows else None,
        "last_line": rows[-1]["line"] if rows else None,
        "by_hit": tally(rows, "hit", HITS),
        "by_finish": tally(rows, "finish_reason", FINISH),
        "by_endpoint": tally(rows, "endpoint", ENDPOINTS),
        "tokens": {k: _sum(rows, k) for k in TOKENS},
        "prompt_cache": {
            "restored_requests": sum(cache_use(r) == "restored" for r in rows),
            "off_requests": sum(cache_use(r) == "off" for r in rows),
            "chunks_restored": sum(r["cache_chunks"] for r in rows),
            "chunks_deposited": sum(r["deposited"] for r in rows),
            "chunks_refused": sum(r["refused"] for r in rows),
        },
        "settings": {
            name: sorted({r[name] for r in rows}, key=lambda v: (v is None, str(v)))
            for name in ("k", "min_score", "chunk")
        },
        "latency": groups,
    }
