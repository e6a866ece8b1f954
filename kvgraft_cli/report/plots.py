"""The report's plots as inline SVG, drawn with matplotlib (the optional ``report`` extra, imported only in
:func:`draw`, Agg backend).

Each figure names the model that produced its numbers in its title (the model hash prefix and the manifest); the page
repeats it in full under the figure. The SVG is made safe to inline: text is drawn as paths (no font is fetched), and
the XML prolog, the metadata block, comments and the namespace declarations (URLs, though never fetched) are
removed. Labels from the ledger are drawn as plain text (:func:`plain`: a ``$`` in a name is a dollar sign, not
mathtext).
"""

from __future__ import annotations

import io
import math
import re
import textwrap
from collections.abc import Callable
from typing import Any

REPORT_EXTRA_HINT = "pip install 'kvgraft[report]'"
# The two runs of a comparison, the same colours in every figure (colour-blind safe pair).
BASELINE, LIBRARY = "#7f7f7f", "#1f77b4"
# Served requests by library hit (an exact hit the library's colour), and any other recorded value.
HIT_COLORS = {"exact": LIBRARY, "related": "#56b4e9", "none": "#e69f00", "plain": BASELINE}
OTHER_HIT = "#cc79a7"
# Where a served prompt's tokens came from: (cost field, label, colour).
SOURCES = (
    ("grafted_tokens", "grafted", LIBRARY),
    ("cached_tokens", "prompt cache", "#009e73"),
    ("prefill_tokens", "computed", BASELINE),
)
ABOVE: dict[str, Any] = {"loc": "lower left", "bbox_to_anchor": (0, 1), "borderaxespad": 0.2}  # a legend over its axes
MAX_POINTS = 2000  # served requests drawn one by one; above, the slowest of each run of consecutive requests


class PlotsUnavailable(ImportError):
    """matplotlib is not installed: the report is tables only."""


def available() -> bool:
    """Whether matplotlib can be imported (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def draw(kind: str, item: dict[str, Any], caption: str) -> str:
    """One figure as an SVG string: ``kind`` is ``comparison``, ``per_problem``, ``probe`` or ``served``;
    ``caption`` (the model) is its title's second line. Raises PlotsUnavailable without matplotlib."""
    try:
        import matplotlib
    except ImportError as e:
        raise PlotsUnavailable(str(e)) from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    drawers: dict[str, Callable] = {
        "comparison": _comparison,
        "per_problem": _per_problem,
        "probe": _probe,
        "served": _served,
    }
    rc = {
        "svg.fonttype": "path",
        "svg.hashsalt": "kvgraft-report",
        "font.size": 9,
        "axes.spines.top": False,
        "axes.spines.right": False,
    }
    with matplotlib.rc_context(rc):
        fig = drawers[kind](plt, item)
        width = fig.get_size_inches()[0]
        title = "\n".join(textwrap.wrap(plain(caption), int(width * 15)))
        fig.suptitle(title, fontsize=8, color="#444444", y=0.995, va="top")
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.045 * (title.count("\n") + 1)))
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})
        plt.close(fig)
    return clean_svg(buf.getvalue())


def fin(x: float | int | None) -> float | int | None:
    """A recorded value to draw: None for what cannot be drawn (absent, NaN, infinite; the tables show those)."""
    return x if x is not None and math.isfinite(x) else None


def plain(label: str) -> str:
    """A label from the ledger as matplotlib should draw it: every ``$`` escaped (no mathtext), on one line."""
    return " ".join(str(label).replace("$", r"\$").split())


def clean_svg(svg: str) -> str:
    """An SVG document as an element to inline in HTML: no prolog, doctype, metadata, comments or xmlns URLs."""
    svg = re.sub(r"<\?xml[^>]*\?>|<!DOCTYPE[^>]*>", "", svg)
    svg = re.sub(r"<!--.*?-->", "", svg, flags=re.S)
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)
    svg = re.sub(r'\s+xmlns(:\w+)?="[^"]*"', "", svg)
    svg = re.sub(r"<svg ", '<svg role="img" ', svg, count=1)
    return svg.strip()


def _comparison(plt, c: dict[str, Any]):
    """Accuracy with its Wilson 95% interval, and decode tokens, without vs with the library."""
    base, lib = c["baseline"], c["library"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 3))
    names = ["without library", "with library"]
    acc = [fin(r["accuracy"]) or 0.0 for r in (base, lib)]
    low = [fin(r["wilson95_low"]) for r in (base, lib)]
    high = [fin(r["wilson95_high"]) for r in (base, lib)]
    err = [
        [max(0.0, a - (lo if lo is not None else a)) for a, lo in zip(acc, low)],
        [max(0.0, (hi if hi is not None else a) - a) for a, hi in zip(acc, high)],
    ]
    ax1.bar(
        names,
        [100 * a for a in acc],
        yerr=[[100 * e for e in err[0]], [100 * e for e in err[1]]],
        color=[BASELINE, LIBRARY],
        capsize=6,
    )
    for i, r in enumerate((base, lib)):
        ax1.annotate(
            f"{r['correct']}/{r['scored']}",
            (i, 100 * acc[i]),
            ha="center",
            va="bottom",
            xytext=(14, 2),
            textcoords="offset points",
        )
    ax1.set_ylim(0, 105)
    ax1.set_ylabel("accuracy, % (Wilson 95%)")
    tokens = [max(0, r["decode_tokens"] or 0) for r in (base, lib)]
    ax2.bar(names, tokens, color=[BASELINE, LIBRARY])
    for i, t in enumerate(tokens):
        ax2.annotate(f"{t:,}", (i, t), ha="center", va="bottom", xytext=(0, 2), textcoords="offset points")
    ax2.set_ylabel("decode tokens (all problems)")
    return fig


def _per_problem(plt, c: dict[str, Any]):
    """Decode tokens per problem, without vs with the library, problems in id order."""
    base = {p["id"]: p["decode_tokens"] for p in c["baseline"]["per_problem"]}
    lib = {p["id"]: p["decode_tokens"] for p in c["library"]["per_problem"]}
    ids = sorted(set(base) | set(lib), key=lambda x: str(x))
    width = min(12.0, max(8.0, 0.12 * len(ids) + 3))
    fig, ax = plt.subplots(figsize=(width, 3))
    xs = range(len(ids))
    nan = float("nan")
    # Side by side at each problem (equal counts would hide one marker under the other).
    ax.plot(
        [x - 0.15 for x in xs],
        [base.get(i) if base.get(i) is not None else nan for i in ids],
        "o",
        color=BASELINE,
        label="without library",
        markersize=4,
    )
    ax.plot(
        [x + 0.15 for x in xs],
        [lib.get(i) if lib.get(i) is not None else nan for i in ids],
        "s",
        color=LIBRARY,
        label="with library",
        markersize=4,
    )
    ax.set_xlabel(f"problem ({len(ids)}, in id order)")
    ax.set_ylabel("decode tokens")
    if len(ids) <= 30:
        ax.set_xticks(list(xs), [plain(str(i)[:12]) for i in ids], rotation=60, ha="right", fontsize=7)
    top = max([v for v in [*base.values(), *lib.values()] if v is not None] or [1])
    ax.set_ylim(0, top * 1.35)
    ax.legend(frameon=False, loc="upper right", ncols=2)
    return fig


def _probe(plt, p: dict[str, Any]):
    """max |diff| against offset, both axes logarithmic (offset 0, and a difference of 0, at the bottom edge)."""
    rows = [
        {k: fin(v) if isinstance(v, float) else v for k, v in r.items()}
        for r in sorted(p["offsets"], key=lambda r: r["offset"])
    ]
    positive = [v for r in rows for v in (r["max_abs_diff"], r["unmoved_max_abs_diff"]) if v and v > 0]
    floor = min(positive) / 10 if positive else 1e-8
    fig, ax = plt.subplots(figsize=(8, 3.2))
    xs = [r["offset"] for r in rows]

    def series(key, label, color, marker):
        ys = [r[key] for r in rows]
        ax.plot(
            [x for x, y in zip(xs, ys) if y and y > 0],
            [y for y in ys if y and y > 0],
            marker + "-",
            color=color,
            label=label,
        )
        zeros = [x for x, y in zip(xs, ys) if y == 0]
        if zeros:
            ax.plot(
                zeros,
                [floor] * len(zeros),
                marker,
                color=color,
                markerfacecolor="white",
                markersize=9,
                label=f"{label}: exactly 0",
            )

    series("max_abs_diff", plain(f"grafted at offset ({p['method'] or 'moved'})"), LIBRARY, "o")
    if any(r["unmoved_max_abs_diff"] is not None for r in rows):
        series("unmoved_max_abs_diff", "unmoved cache", BASELINE, "s")
    ax.set_xscale("symlog", linthresh=1)
    ax.set_yscale("log")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("offset (positions the artifact is moved by)")
    ax.set_ylabel("max |diff| of logits vs fresh")
    ax.legend(frameon=False, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def _served(plt, g: dict[str, Any]):
    """A model's served requests: first-token seconds in ledger order (left), prompt tokens by source (right)."""
    from .served import HITS, value

    rows = g["requests"]
    hits = [h for h in HITS if any(value(r, "hit") == h for r in rows)]
    hits += sorted({value(r, "hit") for r in rows} - set(hits))  # any other value the ledger records
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.4), width_ratios=(2.2, 1.2))
    _first_token(ax1, rows, hits)
    _prompt_tokens(ax2, rows, hits)
    return fig


def _first_token(ax, rows: list[dict[str, Any]], hits: list[str]) -> None:
    """First-token seconds of each request not cancelled, in ledger order, coloured by library hit, filled when its
    prompt was restored from the prompt cache; above MAX_POINTS requests, the slowest of each run of ``step``."""
    from .served import cache_use, value

    done = [r for r in rows if r["finish_reason"] != "cancelled"]
    step = max(1, math.ceil(len(done) / MAX_POINTS))
    points: dict[tuple[str, bool], dict[int, tuple[int, float]]] = {}  # (hit, restored) -> run -> slowest (x, y)
    for x, r in enumerate(done, 1):
        y = fin(r["first_token_s"])
        if y is None:
            continue
        runs = points.setdefault((value(r, "hit"), cache_use(r) == "restored"), {})
        run = (x - 1) // step
        if run not in runs or y > runs[run][1]:
            runs[run] = (x, y)
    for (hit, restored), runs in sorted(points.items(), key=lambda kv: (hits.index(kv[0][0]), kv[0][1])):
        color = HIT_COLORS.get(hit, OTHER_HIT)
        xs, ys = zip(*sorted(runs.values()))
        ax.plot(xs, ys, "o", color=color, markerfacecolor=color if restored else "white", markersize=4, alpha=0.85)
    for hit in hits:
        ax.plot([], [], "o", color=HIT_COLORS.get(hit, OTHER_HIT), label=plain(hit[:20]))
    ax.plot([], [], "o", color="#444444", markerfacecolor="white", label="computed")
    ax.plot([], [], "o", color="#444444", label="prompt cache")
    seconds = [y for runs in points.values() for _, y in runs.values()]
    if seconds and min(seconds) > 0 and max(seconds) / min(seconds) > 30:
        ax.set_yscale("log")
    else:
        ax.set_ylim(0, (max(seconds) if seconds else 1) * 1.1)
    every = f"; each point the slowest of {step}" if step > 1 else ""
    ax.set_xlabel(f"request, in ledger order ({len(done):,} not cancelled{every})")
    ax.set_ylabel("first-token seconds")
    ax.legend(frameon=False, fontsize=7, ncols=min(6, len(hits) + 2), **ABOVE)


def _prompt_tokens(ax, rows: list[dict[str, Any]], hits: list[str]) -> None:
    """The prompt tokens of every request by library hit, stacked by where they came from."""
    from .served import value

    left = [0] * len(hits)
    for key, label, color in SOURCES:
        widths = [sum(max(0, r[key] or 0) for r in rows if value(r, "hit") == h) for h in hits]
        ax.barh([plain(h[:20]) for h in hits], widths, left=left, color=color, label=label)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.locator_params(axis="x", nbins=4)
    ax.xaxis.set_major_formatter(lambda x, _: f"{x:,.0f}")
    ax.set_xlabel("prompt tokens (all requests)")
    ax.legend(frameon=False, fontsize=7, ncols=3, handlelength=1, columnspacing=0.8, **ABOVE)
