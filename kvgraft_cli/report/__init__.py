"""`kvgraft report`: one self-contained HTML page of what a ledger records (torch-free; reads ledger, audit, config).

``collect.py`` reads the ledger into the page's content (every number a recorded value), ``served.py`` summarizes
`kvgraft serve`'s requests (counts, token sums, nearest-rank latency percentiles), ``render.py`` writes the HTML
(every ledger value escaped), ``plots.py`` draws inline SVG with matplotlib when the ``report`` extra is installed,
and ``destination.py`` refuses an ``-o`` that would overwrite the ledger or a file kvgraft owns.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError


def write_report(
    ledger: Path,
    out: Path,
    *,
    checkpoint: Path | None = None,
    keys: list[str] | None = None,
    rehash: bool = True,
    plots: bool | None = None,
):
    """Verify ``ledger`` (as `kvgraft verify` does), render it and write ``out`` atomically; returns the
    :class:`~.collect.ReportData`. ``plots``: None draws them when matplotlib is installed. InputError, with
    nothing written, for a missing ledger or an ``out`` that may not be written."""
    from ..audit.verify import read_ledger_bytes, verify_ledger
    from ..util.fsio import atomic_write_bytes
    from . import destination
    from . import plots as plotting
    from .collect import collect
    from .render import render

    ledger, out = Path(ledger), Path(out)
    data = read_ledger_bytes(ledger)
    extra = [Path(p) for p in (checkpoint, *(keys or [])) if p is not None and Path(p).exists()]
    destination.check(out, ledger, data, extra)
    verification = verify_ledger(ledger, checkpoint=checkpoint, keys=keys, rehash=rehash).to_json()
    report = collect(ledger, data, verification)
    page = render(report, plotting.available() if plots is None else plots)
    try:
        atomic_write_bytes(out, page.encode("utf-8"))
    except OSError as e:
        raise InputError(f"cannot write {out}: {e.strerror or e}", destination.HINT) from None
    return report
