"""`kvgraft probe`: graft an artifact away from its own position and measure the difference."""

from __future__ import annotations

import typer

from ..errors import CheckFailed, InputError
from ._common import ARTIFACT_ARG, artifact_and_engine, at_most_max_count, engine_options
from ._output import err, out, print_json, printable, table


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise InputError(f"{what} must be comma-separated integers, got {text!r}", "e.g. 0,1,8,64") from None
    if not values:
        raise InputError(f"{what} is empty", "e.g. 0,1,8,64")
    return values


@engine_options
def probe(
    artifact: str | None = ARTIFACT_ARG,
    offsets: str = typer.Option(
        "0,1,2,3,8,64,512", "--offsets", help="Comma-separated positions to graft at (0 = the artifact's own)."
    ),
    samples: int = typer.Option(8, "--samples", min=1, callback=at_most_max_count, help="Suffixes per offset."),
    manifest=None,
    store=None,
    ledger=None,
    allow_drift=False,
    as_json=False,  # engine_options
) -> None:
    """Graft an artifact at other positions (keys re-rotated by the model's rotary embedding) and measure how far
    that is from computing the prefix there. Exit 1 unless offset 0 is the only exact point."""
    wanted = _int_list(offsets, "--offsets")
    s, loaded = artifact_and_engine(manifest, store, ledger, allow_drift, artifact)
    with err.status("probing") as status:
        report = s.probe(
            loaded, wanted, samples=samples, on_offset=lambda r: status.update(f"probing (offset {r.offset} done)")
        )
    if as_json:
        print_json(report.to_json())
    else:
        title = (
            f"probe {report.artifact} ({report.prefix_tokens} prefix tokens, {report.positions} "
            f"positions, moved by: {report.method})"
        )
        cols = ["offset", "SHA-equal", "max |diff|", "max KL", "argmax"]
        if report.positions == "rotary":
            cols += ["unmoved max |diff|", "unmoved argmax"]
        t = table(title, cols, right=cols)
        for r in report.offsets:
            mark = "green" if r.exact else "yellow"
            row = [
                str(r.offset),
                f"[{mark}]{r.sha_equal}/{r.samples}[/]",
                f"{r.max_abs_diff:.3g}",
                f"{r.max_kl:.3g}",
                f"{100 * r.argmax_agreement:.1f}%",
            ]
            if report.positions == "rotary":
                assert r.unmoved_argmax_agreement is not None  # measured at every offset of a rotary model
                row += [f"{r.unmoved_max_abs_diff:.3g}", f"{100 * r.unmoved_argmax_agreement:.1f}%"]
            t.add_row(*row)
        out.print(t)
        out.print(printable(report.note), markup=False)
        verdict = (
            "[green]offset 0 is the only exact point[/]"
            if report.own_position_unique
            else f"[red]exact offsets: {report.exact_offsets}[/]"
        )
        assert report.ledger_seq is not None  # probe() returns after appending its ledger line
        out.print(f"{verdict}; ledger line {report.ledger_seq + 1}")
    if not report.own_position_unique:
        raise CheckFailed(
            f"expected offset 0 to be the only exact offset, got {report.exact_offsets}",
            "include offset 0; an exact shifted graft would contradict the rounding analysis, report it",
        )
