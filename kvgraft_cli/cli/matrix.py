"""`kvgraft matrix`: graft vs fresh over the tiny architecture zoo, one child process per kernel-flag profile."""

from __future__ import annotations

from pathlib import Path

import typer

from ..errors import CheckFailed
from ._common import JSON_OPT, MAX_THREADS, Attn, Device, Dtype, Profile, Schedule, SdpaBackend, at_most_max_count
from ._output import cell, err, out, print_json, short, table


def matrix(
    arch: list[str] = typer.Option([], "--arch", help="Architecture (repeatable; default: all of the tiny zoo)."),
    dtype: list[Dtype] = typer.Option([], "--dtype", help="Repeatable; default: all."),
    profile: list[Profile] = typer.Option([], "--profile", help="Repeatable; default: both on cpu, native on cuda."),
    device: Device = typer.Option(Device.cpu, "--device"),
    attn: Attn = typer.Option(
        Attn.eager, "--attn", help="Attention implementation (grouped: kvgraft's own, no per-query-head KV copies)."
    ),
    sdpa_backend: SdpaBackend | None = typer.Option(None, "--sdpa-backend", help="With --attn sdpa (default math)."),
    samples: int = typer.Option(50, "--samples", min=1, callback=at_most_max_count, help="Samples per cell."),
    threads: int | None = typer.Option(
        None, "--threads", min=1, max=MAX_THREADS, help="Pin this many threads (default: the profile's)."
    ),
    workdir: Path | None = typer.Option(
        None, "--workdir", help="Where the tiny models are written (default: a temporary folder)."
    ),
    schedule: Schedule = typer.Option(
        Schedule.single,
        "--schedule",
        help="Prefill schedule of every cell's manifest (invariant: one token a forward).",
    ),
    single_pass: bool = typer.Option(
        False,
        "--single-pass",
        help="Fresh side: one forward over prefix+suffix "
        "instead of prefill then suffix (byte-equal only under --schedule invariant).",
    ),
    markdown: bool = typer.Option(
        False, "--markdown", help="Print the table docs/EXACTNESS.md carries (one row per architecture)."
    ),
    as_json: bool = JSON_OPT,
) -> None:
    """Graft-vs-fresh over the tiny architecture zoo: samples SHA-equal (n/N), largest KL and argmax agreement per
    architecture x dtype x profile. Exit 1 if a supported cell is not byte-exact."""
    from ..engine.zoo import ARCHS
    from ..runs.matrix import DTYPES, describe, markdown_table, run_matrix

    profiles = [p.value for p in profile] or (["portable", "native"] if device == Device.cpu else ["native"])
    archs, dtypes = arch or list(ARCHS), [d.value for d in dtype] or list(DTYPES)
    total = len(archs) * len(dtypes) * len(profiles)
    with err.status(f"matrix: 0/{total} cells") as status:
        done = [0]

        def progress(c) -> None:
            done[0] += 1
            status.update(f"matrix: {done[0]}/{total} cells ({c.arch} {c.dtype} {c.profile}: {describe(c)})")

        cells = run_matrix(
            archs,
            dtypes,
            profiles,
            samples,
            device=device.value,
            attn=attn.value,
            sdpa_backend=sdpa_backend.value if sdpa_backend else None,
            threads=threads,
            workdir=workdir,
            schedule=schedule.value,
            single_pass=single_pass,
            on_cell=progress,
        )
    if as_json:
        print_json(
            {
                "cells": [c.to_json() for c in cells],
                "samples": samples,
                "exact": sum(c.exact for c in cells),
                "unsupported": sum(c.unsupported is not None for c in cells),
                "total": len(cells),
            }
        )
    elif markdown:
        out.print(markdown_table(cells), markup=False, soft_wrap=True)
    else:
        fresh = "one forward over prefix+suffix" if single_pass else "fresh"
        t = table(
            f"graft vs {fresh}, {samples} samples per cell ({device.value}, {attn.value}, schedule {schedule.value})",
            ("architecture", "dtype", "profile", "SHA-equal", "max KL", "argmax", "fingerprint", "s"),
            right=("SHA-equal", "max KL", "argmax", "s"),
        )
        for c in cells:
            if c.unsupported:
                t.add_row(c.arch, c.dtype, c.profile, "[yellow]unsupported[/]", cell(c.unsupported), "", "", "")
                continue
            mark = "green" if c.exact else "red"
            t.add_row(
                c.arch,
                c.dtype,
                c.profile,
                f"[{mark}]{c.sha_equal}/{c.samples}[/]",
                f"{c.max_kl:.3g}",
                f"{100 * c.argmax_agreement:.1f}%",
                short(c.fingerprint),
                f"{c.seconds:.1f}",
            )
        out.print(t)
    bad = [c for c in cells if c.unsupported is None and not c.exact]
    if bad:
        raise CheckFailed(
            f"{len(bad)} cell(s) not byte-exact: " + ", ".join(f"{c.arch}/{c.dtype}/{c.profile}" for c in bad)
        )
