"""The report as one self-contained HTML page: inline CSS, inline SVG plots, no script, nothing fetched.

Everything that comes from the ledger (ids, paths, names, hashes, messages) goes through :func:`esc`
(``html.escape``, quotes included) before it reaches the page; numbers are formatted here from the values
report/collect.py read, each with its recorded value in full in a ``title`` (shown on hover).
"""

from __future__ import annotations

import html
from collections.abc import Callable, Iterable
from pathlib import PureWindowsPath
from typing import Any

from . import plots
from .collect import ReportData, absolute_anywhere

MARKER = "<!-- kvgraft report -->"  # the first line of every report: what `-o` may overwrite (report/destination.py)
MAX_DEPOSIT_ROWS = 2000

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;margin:0;color:#1d1d1f;
background:#fafafa;line-height:1.4}
main{max-width:1100px;margin:0 auto;padding:24px}
h1{font-size:1.6em;margin:0 0 4px}h2{margin-top:36px;border-bottom:1px solid #ddd;padding-bottom:4px}
h3{margin:22px 0 6px;font-size:1.05em}
.sub{color:#555;font-size:.9em}.mono,code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;
font-size:.85em;word-break:break-all}
.badge{display:inline-block;padding:6px 14px;border-radius:6px;font-weight:700;font-size:1.1em;color:#fff}
.ok{background:#1a7f37}.bad{background:#cf222e}.warn{background:#fff8c5;border:1px solid #d4a72c;padding:8px 12px;
border-radius:6px}
table{border-collapse:collapse;margin:8px 0;background:#fff;font-size:.88em}
th,td{border:1px solid #e1e1e1;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3}td.n{text-align:right;font-variant-numeric:tabular-nums}
figure{margin:10px 0;background:#fff;border:1px solid #e1e1e1;padding:8px}
figure svg{max-width:100%;height:auto}figcaption{font-size:.8em;color:#444}
.pass{color:#1a7f37;font-weight:600}.fail{color:#cf222e;font-weight:600}
"""


def esc(value: Any) -> str:
    """Ledger text for the page: escaped, quotes included; None as an empty string."""
    return "" if value is None else html.escape(str(value), quote=True)


def flt(x: float | None, spec: str = ".4f") -> str:
    """A recorded float, formatted, with its full value in a title."""
    if x is None:
        return "n/a"
    return f'<span title="{esc(repr(x))}">{format(x, spec)}</span>'


def cnt(x: int | None) -> str:
    """A recorded count with thousands separators."""
    return "n/a" if x is None else f"{x:,}"


def sha(value: str | None, n: int = 16) -> str:
    """A hash's prefix, the whole hash in the title."""
    if not value:
        return ""
    return f'<span class="mono" title="{esc(value)}">{esc(value[:n])}</span>'


def yes_no(v: bool | None, yes: str = "yes", no: str = "no") -> str:
    """A recorded flag, coloured; n/a when not recorded."""
    if v is None:
        return "n/a"
    return f'<span class="pass">{yes}</span>' if v else f'<span class="fail">{no}</span>'


def model_caption(m: dict[str, Any], full: bool = True) -> str:
    """Which model and manifest produced a number: plain text (escape it for HTML). Short (``full=False``, a
    figure's title): hash prefixes and the manifest's file name."""
    # manifest_shown, never the recorded source: a manifest given by absolute path is recorded with its author's
    # folder, which the shared page must not show (collect.shown_path).
    name = m.get("manifest_name") or m.get("manifest_shown") or "manifest not recorded"
    path = f" ({m['model_path']})" if m.get("model_path") else ""
    n = None if full else 16
    msha = (m.get("model_sha256") or "not recorded")[:n]
    fsha = (m.get("manifest_sha256") or "not recorded")[:n]
    source = m.get("manifest_shown") or "?"
    source = source if full else source.replace("\\", "/").rsplit("/", 1)[-1]
    return f"model {name}{path}, model sha256 {msha}, manifest {source} sha256 {fsha}"


def _model_cell(m: dict[str, Any]) -> str:
    """The model column of a table: the manifest's name (or source) and the model hash prefix."""
    name = m.get("manifest_name") or m.get("manifest_shown") or ""
    return f"{esc(name)}<br>{sha(m.get('model_sha256'))}"


def _table(head: Iterable[str], rows: Iterable[Iterable[str]], numeric: Iterable[int] = ()) -> str:
    """An HTML table from cells that are already HTML (escape ledger values before)."""
    numeric = set(numeric)
    out = ["<table><thead><tr>", *(f"<th>{h}</th>" for h in head), "</tr></thead><tbody>"]
    for row in rows:
        out.append(
            "<tr>"
            + "".join(f'<td class="n">{c}</td>' if i in numeric else f"<td>{c}</td>" for i, c in enumerate(row))
            + "</tr>"
        )
    out.append("</tbody></table>")
    return "".join(out)


class _Figures:
    """Figures as inline SVG, or a line saying the plots need the extra."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __call__(self, kind: str, item: dict[str, Any], model: dict[str, Any], what: str) -> str:
        caption = f"{what}. Produced by {model_caption(model)}."
        if not self.enabled:
            return (
                f'<p class="sub">[plot: {esc(what)}: needs matplotlib, <code>{esc(plots.REPORT_EXTRA_HINT)}</code>]</p>'
            )
        svg = plots.draw(kind, item, model_caption(model, full=False))
        return f"<figure>{svg}<figcaption>{esc(caption)}</figcaption></figure>"


def render(data: ReportData, with_plots: bool) -> str:
    """The whole page."""
    fig = _Figures(with_plots)
    # The ledger as given to `kvgraft report`; an absolute path by its file name (the page is shared).
    ledger = PureWindowsPath(data.ledger).name if absolute_anywhere(data.ledger) else data.ledger
    parts = [
        MARKER,
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>kvgraft report: {esc(ledger)}</title><style>{CSS}</style></head><body><main>",
        "<h1>kvgraft report</h1>",
        f'<p class="sub">Ledger <code>{esc(ledger)}</code>. Every number on this page is read from a '
        "line of this ledger (cited as <em>line N</em>); each plot names the model and manifest that "
        "produced it.</p>",
    ]
    if not with_plots:
        parts.append(
            f'<p class="warn">Tables only: plots need matplotlib (<code>{esc(plots.REPORT_EXTRA_HINT)}</code>).</p>'
        )
    sections: list[tuple[str, Callable[[], str]]] = [
        ("verification", lambda: _verification(data)),
        ("solve comparisons", lambda: _comparisons(data, fig)),
        ("graft checks", lambda: _graft_checks(data)),
        ("probes", lambda: _probes(data, fig)),
        ("scores", lambda: _scores(data)),
        ("served", lambda: _served(data, fig)),
        ("deposits", lambda: _deposits(data)),
    ]
    for _, make in sections:
        parts.append(make())
    if data.unreadable or data.skipped:
        parts.append("<h2>Lines not shown</h2>")
        if data.unreadable:
            parts.append(
                f"<p>Not a JSON object: lines {esc(', '.join(map(str, data.unreadable[:50])))}"
                f"{' ...' if len(data.unreadable) > 50 else ''}.</p>"
            )
        parts.append(
            _table(
                ["line", "kind", "why"],
                ([str(s["line"]), esc(s["kind"]), esc(s["reason"])] for s in data.skipped[:200]),
            )
            if data.skipped
            else ""
        )
    parts.append("</main></body></html>\n")
    return "\n".join(parts)


def _verification(data: ReportData) -> str:
    """The first section: the verifier's verdict and what it checked."""
    v = data.verification
    badge = '<span class="badge ok">VERIFIED</span>' if v["passed"] else '<span class="badge bad">NOT VERIFIED</span>'
    files = v["files"]
    rows = [
        ["entries", cnt(v["entries"])],
        ["Merkle root (RFC 6962)", f'<span class="mono">{esc(v["root"])}</span>'],
        [
            "referenced files",
            f"{cnt(files['checked'])} checked: {cnt(files['ok'])} ok, "
            f"{cnt(len(files['missing']))} missing, {cnt(len(files['mismatched']))} mismatched",
        ],
        ["scores recomputed", cnt(v["scores_checked"])],
    ]
    cp = v.get("checkpoint")
    if cp is not None:
        signed = ", signed by " + esc(", ".join(cp.get("signed_by") or [])) if cp.get("signed_by") else ", unsigned"
        rows.insert(2, ["checkpoint", f"{esc(cp.get('origin'))} @ {esc(cp.get('size'))} lines{signed}"])
    else:
        rows.insert(2, ["checkpoint", "none given (<code>kvgraft report --checkpoint FILE</code>)"])
    if v.get("first_problem"):
        rows.append(["first problem", f'<span class="fail">{esc(v["first_problem"])}</span>'])
    for w in v.get("warnings") or []:
        rows.append(["warning", esc(w)])
    kinds = ", ".join(f"{esc(k)} {n:,}" for k, n in sorted(data.kinds.items()))
    rows.append(["entries by kind", kinds or "none"])
    return (
        '<h2 id="verification">Verification</h2>'
        f'<p>{badge} <span class="sub">by the torch-free verifier of <code>kvgraft verify</code></span></p>'
        + _table(["check", "result"], rows)
    )


def _run_row(r: dict[str, Any]) -> list[str]:
    """One solve run as a table row (RUN_HEAD)."""
    label = "with library" if r["mode"] == "library" else "without library"
    return [
        f'{label}<br><span class="sub">line {r["line"]}</span>',
        f"{cnt(r['correct'])}/{cnt(r['scored'])}",
        flt(r["accuracy"]),
        f"[{flt(r['wilson95_low'])}, {flt(r['wilson95_high'])}]",
        cnt(r["decode_tokens"]),
        cnt(r["prefill_tokens"]),
        cnt(r["grafted_tokens"]),
        f"{cnt(r['exact_hits'])} / {cnt(r['related_hits'])}",
        flt(r["wall_s"], ".2f"),
        _model_cell(r["model"]),
    ]


RUN_HEAD = [
    "run",
    "correct",
    "accuracy",
    "Wilson 95%",
    "decode tokens",
    "prefill tokens",
    "grafted tokens",
    "exact / related hits",
    "wall s",
    "model",
]


def _comparisons(data: ReportData, fig: _Figures) -> str:
    """Each library run against its baseline: table, bar chart, per-problem plot; then the unpaired runs."""
    out = ['<h2 id="solve">Solve: with vs without the library</h2>']
    if not data.comparisons and not data.runs:
        return out[0] + "<p>No <code>solve-outputs</code> entries.</p>"
    for c in data.comparisons:
        base, lib = c["baseline"], c["library"]
        out.append(
            f'<h3>{esc(lib["problems_file"]["path"])} <span class="sub">(lines {base["line"]} and '
            f"{lib['line']}; problems file sha256 {sha(lib['problems_file']['sha256'])})</span></h3>"
        )
        out.append(_table(RUN_HEAD, [_run_row(base), _run_row(lib)], numeric=range(1, 9)))
        if base["decode_tokens"] and lib["decode_tokens"]:
            out.append(
                f"<p>{lib['decode_tokens']:,} decode tokens with the library instead of "
                f"{base['decode_tokens']:,} without ({base['decode_tokens'] / lib['decode_tokens']:.2f}x "
                "fewer).</p>"
            )
        out.append(
            fig("comparison", c, lib["model"], "Accuracy (Wilson 95%) and decode tokens, without vs with the library")
        )
        n_per = (len(base["per_problem"]), len(lib["per_problem"]))
        if any(n_per):
            out.append(
                fig(
                    "per_problem",
                    c,
                    lib["model"],
                    f"Decode tokens per problem ({n_per[0]} and {n_per[1]} solve lines), without vs with the library",
                )
            )
    if data.runs:
        out.append("<h3>Runs without a partner of the other mode</h3>")
        out.append(
            _table(
                ["problems file"] + RUN_HEAD,
                ([esc(r["problems_file"]["path"])] + _run_row(r) for r in data.runs),
                numeric=range(2, 10),
            )
        )
    return "".join(out)


def _graft_checks(data: ReportData) -> str:
    """One row per `graft --check` line."""
    out = ['<h2 id="graft-checks">Graft checks (<code>graft --check</code>)</h2>']
    if not data.graft_checks:
        return out[0] + "<p>No <code>graft-check</code> entries.</p>"
    rows = [
        [
            str(g["line"]),
            sha(g["artifact"]) + (f"<br>chain of {g['chain_links']}" if g["chain_links"] else ""),
            f"{cnt(g['sha_equal'])}/{cnt(g['samples'])}",
            flt(g["max_kl"], ".3g"),
            flt(g["argmax_agreement"]),
            f"{cnt(g['generated_equal'])}/{cnt(g['samples'])}",
            yes_no(g["deposit_reproduced"]),
            cnt(g["prefix_tokens"]),
            esc(g["schedule"]),
            flt(g["single_pass_max_abs_diff"], ".3g"),
            yes_no(g["passed"], "PASS", "FAIL"),
            _model_cell(g["model"]),
        ]
        for g in data.graft_checks
    ]
    return out[0] + _table(
        [
            "line",
            "artifact",
            "SHA-equal",
            "max KL",
            "argmax agreement",
            "decode equal",
            "deposit reproduced",
            "prefix tokens",
            "schedule",
            "single-pass max |diff|",
            "result",
            "model",
        ],
        rows,
        numeric=(2, 3, 4, 5, 7, 9),
    )


def _probes(data: ReportData, fig: _Figures) -> str:
    """Each probe: its offsets as a table and |diff| against offset as a plot."""
    out = ['<h2 id="probes">Probes: |diff| against offset</h2>']
    if not data.probes:
        return out[0] + "<p>No <code>probe</code> entries.</p>"
    for p in data.probes:
        out.append(
            f'<h3>line {p["line"]}: artifact {sha(p["artifact"])} <span class="sub">({esc(p["positions"])} '
            f"positions, {esc(p['method'])}, {cnt(p['prefix_tokens'])} prefix tokens; offset 0 the only "
            f"exact point: {yes_no(p['own_position_unique'])})</span></h3>"
        )
        rows = [
            [
                cnt(r["offset"]),
                f"{cnt(r['sha_equal'])}/{cnt(r['samples'])}",
                flt(r["max_abs_diff"], ".3g"),
                flt(r["max_kl"], ".3g"),
                flt(r["argmax_agreement"]),
                flt(r["unmoved_max_abs_diff"], ".3g"),
                flt(r["unmoved_argmax_agreement"]),
            ]
            for r in p["offsets"]
        ]
        out.append(
            _table(
                ["offset", "SHA-equal", "max |diff|", "max KL", "argmax", "unmoved max |diff|", "unmoved argmax"],
                rows,
                numeric=range(7),
            )
        )
        out.append(fig("probe", p, p["model"], f"max |diff| against offset, log scale (probe, line {p['line']})"))
        if p["note"]:
            out.append(f'<p class="sub">{esc(p["note"])}</p>')
    return "".join(out)


def _scores(data: ReportData) -> str:
    """One row per score line, with the solve run whose outputs it scored."""
    out = ['<h2 id="scores">Scores</h2>']
    if not data.scores:
        return out[0] + "<p>No <code>score</code> entries.</p>"
    rows = []
    for s in data.scores:
        run = s["run"]
        of = (
            f"solve line {run['line']} ({esc(run['mode'])})<br>{_model_cell(run['model'])}"
            if run
            else "not a solve run's outputs in this ledger"
        )
        grader = esc(s["grader"]) + (f" {esc(s['grader_version'])}" if s["grader_version"] else "")
        rows.append(
            [
                str(s["line"]),
                f"<code>{esc(s['outputs']['path'])}</code>",
                of,
                f"{cnt(s['correct'])}/{cnt(s['n'])}",
                flt(s["accuracy"]),
                f"[{flt(s['wilson95_low'])}, {flt(s['wilson95_high'])}]",
                f"{cnt(s['answered'])} / {cnt(s['unanswered'])}",
                grader,
                f"rules {esc(s['rules'])}, extractor {esc(s['extractor_version'])}"
                + (", answered only" if s["answered_only"] else ""),
                sha(s["records"]["sha256"]),
            ]
        )
    return out[0] + _table(
        [
            "line",
            "outputs",
            "run",
            "correct",
            "accuracy",
            "Wilson 95%",
            "answered / unanswered",
            "grader",
            "rules",
            "records sha256",
        ],
        rows,
        numeric=(3, 4, 5, 6),
    )


def _served(data: ReportData, fig: _Figures) -> str:
    """`kvgraft serve`'s requests, per model and manifest (report/served.py), then the `replay --served` lines; no
    section at all when the ledger holds neither."""
    if not data.served and not data.served_replays:
        return ""
    out = ['<h2 id="served">Served (<code>kvgraft serve</code>)</h2>']
    out.extend(_served_group(g, fig) for g in data.served)
    if data.served_replays:
        out.append(_served_replays(data.served_replays))
    return "".join(out)


def _tally(counts: dict[str, int], n: int) -> str:
    """Requests by a recorded value, e.g. ``exact 3 (30.0%), none 7 (70.0%)``."""
    return ", ".join(f"{esc(k)} {v:,}" + (f" ({100 * v / n:.1f}%)" if v and n else "") for k, v in counts.items())


def _settings(s: dict[str, list]) -> str:
    """The server settings a group's lines record (each value seen), as text."""
    chunks = ", ".join("off" if c is None else f"chunks of {c} tokens" for c in s["chunk"])
    k = ", ".join("n/a" if v is None else f"{v} (exact hits only)" if v < 1 else str(v) for v in s["k"])
    min_score = ", ".join("none" if v is None else str(v) for v in s["min_score"])
    return f"library k {k}, min score {min_score}; prompt cache {chunks}"


def _pct(p: dict[str, Any] | None) -> str:
    """A latency percentile: one request's recorded seconds, its value in full and its line in the title."""
    if p is None:
        return "n/a"
    return f'<span title="{esc(repr(p["value"]))} (line {p["line"]})">{p["value"]:.4f}</span>'


def _share(part: int | None, whole: int | None) -> str:
    """A token count as a percentage of the prompt tokens."""
    return f"{100 * part / whole:.1f}%" if part is not None and whole else ""


def _served_group(g: dict[str, Any], fig: _Figures) -> str:
    """One model and manifest's requests: counts, tokens, latency and the plot."""
    s, m = g["summary"], g["model"]
    n, t, cache = s["requests"], s["tokens"], s["prompt_cache"]
    name = m.get("manifest_name") or m.get("manifest_shown") or "manifest not recorded"
    out = [
        f'<h3>{esc(name)}: {n:,} request{"s" if n != 1 else ""} <span class="sub">(lines {s["first_line"]} to '
        f"{s['last_line']}; {esc(_settings(s['settings']))})</span></h3>",
        f'<p class="sub">Served by {esc(model_caption(m))}, compute pin {sha(m.get("compute_sha256"))}.</p>',
    ]
    restored = (
        f"{cache['restored_requests']:,} of {n:,} requests restored from it ({cache['chunks_restored']:,} chunks)"
    )
    off = f", {cache['off_requests']:,} served without it" if cache["off_requests"] else ""
    out.append(
        _table(
            ["requests", "count"],
            [
                ["by library hit", _tally(s["by_hit"], n)],
                ["by finish reason", _tally(s["by_finish"], n)],
                ["by endpoint", _tally(s["by_endpoint"], n)],
                [
                    "prompt cache",
                    f"{restored}{off}; {cache['chunks_deposited']:,} chunks deposited, "
                    f"{cache['chunks_refused']:,} refused by their check",
                ],
            ],
        )
    )
    prompt = t["prompt_tokens"]
    out.append(
        _table(
            ["tokens", "total", "share of prompt"],
            [
                ["prompt tokens", cnt(prompt), _share(prompt, prompt)],
                ["&nbsp;grafted from the library", cnt(t["grafted_tokens"]), _share(t["grafted_tokens"], prompt)],
                ["&nbsp;restored from the prompt cache", cnt(t["cached_tokens"]), _share(t["cached_tokens"], prompt)],
                ["&nbsp;computed (prefill)", cnt(t["prefill_tokens"]), _share(t["prefill_tokens"], prompt)],
                ["decode tokens", cnt(t["decode_tokens"]), ""],
            ],
            numeric=(1, 2),
        )
    )
    rows = [
        [esc(lat["group"]), cnt(lat["requests"])]
        + [_pct(lat[k][f"p{p}"]) for k in ("first_token_s", "wall_s", "queue_s") for p in (50, 99)]
        for lat in s["latency"]
    ]
    head = ["not cancelled", "requests"] + [f"{k} s p{p}" for k in ("first token", "wall", "queue") for p in (50, 99)]
    out.append(_table(head, rows, numeric=range(1, 8)))
    out.append(
        '<p class="sub">Percentiles by nearest rank: each is the recorded seconds of one request (hover for its '
        "line); p99 of fewer than 100 requests is the slowest.</p>"
    )
    out.append(
        fig(
            "served",
            g,
            m,
            f"First-token seconds of each request not cancelled ({s['by_finish'].get('cancelled', 0):,} cancelled), "
            "in ledger order, by library hit, filled when restored from the prompt cache; prompt tokens by where "
            "they came from",
        )
    )
    return "".join(out)


def _served_replays(replays: list[dict[str, Any]]) -> str:
    """One row per `kvgraft replay --served` line."""
    rows = [
        [
            str(r["line"]),
            f"<code>{esc(r['ledger'])}</code> seq {cnt(r['first_seq'])} to {cnt(r['last_seq'])}",
            cnt(r["count"]),
            cnt(r["matched"]),
            cnt(r["mismatched"]),
            yes_no(None if r["mismatched"] is None else r["mismatched"] == 0, "PASS", "FAIL"),
            sha(r["lines_sha256"]),
            _model_cell(r["model"]),
        ]
        for r in replays
    ]
    return "<h3>Served requests computed again (<code>kvgraft replay --served</code>)</h3>" + _table(
        ["line", "served lines", "requests", "matched", "mismatched", "result", "lines sha256", "model"],
        rows,
        numeric=(0, 2, 3, 4),
    )


def _deposits(data: ReportData) -> str:
    """One row per deposit line (the first MAX_DEPOSIT_ROWS)."""
    out = [f'<h2 id="deposits">Deposits ({len(data.deposits):,})</h2>']
    if not data.deposits:
        return out[0] + "<p>No <code>deposit</code> entries.</p>"
    rows = [
        [
            str(d["line"]),
            esc(d["id"]),
            esc(d["status"]),
            esc(d["verification"]),
            cnt(d["tokens"]),
            sha(d["artifact"]),
            cnt(d["payload_bytes"]),
            _model_cell(d["model"]),
        ]
        for d in data.deposits[:MAX_DEPOSIT_ROWS]
    ]
    more = (
        f"<p>... and {len(data.deposits) - MAX_DEPOSIT_ROWS:,} more (<code>kvgraft ledger log --kind deposit"
        "</code>).</p>"
        if len(data.deposits) > MAX_DEPOSIT_ROWS
        else ""
    )
    return (
        out[0]
        + _table(
            ["line", "id", "status", "verification", "tokens", "artifact", "payload bytes", "model"],
            rows,
            numeric=(0, 4, 6),
        )
        + more
    )
