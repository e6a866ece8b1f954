"""`kvgraft matrix`: graft vs fresh over the tiny architecture zoo, one child process per kernel-flag profile."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ..errors import CheckFailed, InputError, KvgraftError
from ._common import JSON_OPT
from ._output import err, out, print_json


def matrix(
    arch: list[str] = typer.Option([], "--arch", help="Architecture (repeatable; default: all of the tiny zoo)."),
    dtype: list[str] = typer.Option([], "--dtype", help="float32, bfloat16, float16 (repeatable; default: all)."),
    profile: list[str] = typer.Option([], "--profile", help="portable, native (repeatable; default: both on cpu, native on cuda)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    attn: str = typer.Option("eager", "--attn", help="Attention implementation: eager or sdpa."),
    sdpa_backend: Optional[str] = typer.Option(None, "--sdpa-backend", help="With --attn sdpa: math, efficient, flash or cudnn (default math)."),
    samples: int = typer.Option(50, "--samples", min=1, help="Samples per cell."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="Pin this many threads (default: the profile's)."),
    workdir: Optional[Path] = typer.Option(None, "--workdir", help="Where the tiny models are written (default: a temporary folder)."),
    markdown: bool = typer.Option(False, "--markdown", help="Print the README's table (one row per architecture)."),
    as_json: bool = JSON_OPT,
    in_process: bool = typer.Option(False, "--in-process", hidden=True, help="Run one profile here, cells as JSON lines."),
) -> None:
    """Graft-vs-fresh over the tiny architecture zoo: samples SHA-equal (n/N), largest KL and argmax agreement per
    architecture x dtype x profile. Exit 1 if a supported cell is not byte-exact."""
    from ..engine.zoo import ARCHS
    from ..runs.matrix import DTYPES, Cell, check_selection, describe, markdown_table, run_profile

    if device not in ("cpu", "cuda"):
        raise InputError(f"--device must be cpu or cuda, got {device!r}")
    archs = arch or list(ARCHS)
    dtypes = dtype or list(DTYPES)
    profiles = profile or (["portable", "native"] if device == "cpu" else ["native"])
    check_selection(archs, dtypes, profiles)
    if in_process:  # the child: one profile, one JSON line per cell as it finishes
        if len(profiles) != 1 or workdir is None:
            raise InputError("--in-process takes exactly one --profile and a --workdir")
        run_profile(profiles[0], workdir, archs, dtypes, samples, device=device, attn=attn, sdpa_backend=sdpa_backend,
                    threads=threads, on_cell=lambda c: print(json.dumps(c.to_json()), flush=True))
        return

    cells: list[Cell] = []
    with tempfile.TemporaryDirectory(prefix="kvgraft-matrix-") as tmp:
        base = workdir or Path(tmp)
        total = len(archs) * len(dtypes) * len(profiles)
        with err.status(f"matrix: 0/{total} cells") as status:
            done = [0]

            def progress(c: Cell) -> None:
                done[0] += 1
                status.update(f"matrix: {done[0]}/{total} cells ({c.arch} {c.dtype} {c.profile}: {describe(c)})")

            for prof in profiles:
                args = [sys.executable, "-m", "kvgraft_cli", "matrix", "--in-process", "--profile", prof,
                        "--device", device, "--attn", attn, "--samples", str(samples), "--workdir", str(base / prof)]
                args += [f"--arch={a}" for a in archs] + [f"--dtype={d}" for d in dtypes]
                args += ["--sdpa-backend", sdpa_backend] if sdpa_backend else []
                args += ["--threads", str(threads)] if threads else []
                cells += _run_child(args, progress)
    if as_json:
        print_json({"cells": [c.to_json() for c in cells], "samples": samples,
                     "exact": sum(c.exact for c in cells), "unsupported": sum(c.unsupported is not None for c in cells),
                     "total": len(cells)})
    elif markdown:
        out.print(markdown_table(cells), markup=False, soft_wrap=True)
    else:
        t = Table(title=f"graft vs fresh, {samples} samples per cell ({device}, {attn})", title_justify="left")
        for c in ("architecture", "dtype", "profile", "SHA-equal", "max KL", "argmax", "fingerprint", "s"):
            t.add_column(c, justify="right" if c in ("SHA-equal", "max KL", "argmax", "s") else "left")
        for c in cells:
            if c.unsupported:
                t.add_row(c.arch, c.dtype, c.profile, "[yellow]unsupported[/]", c.unsupported, "", "", "")
                continue
            mark = "green" if c.exact else "red"
            t.add_row(c.arch, c.dtype, c.profile, f"[{mark}]{c.sha_equal}/{c.samples}[/]", f"{c.max_kl:.3g}",
                      f"{100 * c.argmax_agreement:.1f}%", c.fingerprint[:16], f"{c.seconds:.1f}")
        out.print(t)
    bad = [c for c in cells if c.unsupported is None and not c.exact]
    if bad:
        raise CheckFailed(f"{len(bad)} cell(s) not byte-exact: " + ", ".join(f"{c.arch}/{c.dtype}/{c.profile}"
                                                                            for c in bad))


def _run_child(args: list[str], on_cell) -> list:
    """Run one profile in a child process (fresh kernel flags), collecting its cells as they arrive."""
    from ..config.profiles import environ_without_pins

    env = environ_without_pins()  # the child pins its profile's flags itself
    cells = []
    profile = args[args.index("--profile") + 1]
    with tempfile.TemporaryFile("w+") as errfile:  # a file, not a pipe: a chatty child cannot block on it
        with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=errfile, text=True, env=env) as proc:
            try:
                assert proc.stdout is not None
                for line in proc.stdout:
                    if line.startswith("{"):
                        cells.append(_parse_cell(line, profile))
                        on_cell(cells[-1])
            except BaseException:
                proc.kill()  # never leave a worker running behind an error or Ctrl-C
                raise
        errfile.seek(0)
        stderr = errfile.read()
    if proc.returncode != 0:
        last = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit {proc.returncode}"
        message, _, hint = last.removeprefix("Error: ").partition(" Hint: ")
        # Keep the worker's meaning: its bad input (exit 2, e.g. no GPU for --device cuda) is the user's bad input.
        kind = InputError if proc.returncode == 2 else KvgraftError
        raise kind(f"matrix worker for profile {profile}: {message.rstrip('.')}",
                   hint.rstrip(".") or None)
    return cells


def _parse_cell(line: str, profile: str):
    """One worker output line as a Cell (KvgraftError naming the line if it is not one)."""
    from ..runs.matrix import Cell

    try:
        d = json.loads(line)
        d.pop("exact", None)
        return Cell(**d)
    except (ValueError, TypeError) as e:
        raise KvgraftError(f"matrix worker for profile {profile} printed an unreadable cell ({e}): {line[:200]!r}") \
            from None
