"""`kvgraft solve`: answer problems from the library of verified solutions (torch inside the command)."""

from __future__ import annotations

from pathlib import Path

import typer

from ._common import (
    RAY_ADDRESS_OPT,
    RAY_OPT,
    WORKERS_OPT,
    at_most_max_count,
    batch_option,
    engine_options,
    field_overrides,
    ray_choice,
    session,
)
from ._output import cell, err, out, print_json, table


@engine_options
def solve(
    problems: Path = typer.Argument(
        ..., help="JSON Lines file, one problem per line (same mapping as deposit; a solution field is not needed)."
    ),
    k: int = typer.Option(
        1,
        "--k",
        min=1,
        callback=at_most_max_count,
        help="How many related solutions to graft (as one chain) when there is no exact hit.",
    ),
    min_score: float | None = typer.Option(
        None,
        "--min-score",
        help="Graft related solutions only when their relevance (bm25 x (1 + shared word sequences), docs/RETRIEVAL.md) is at least this; off by default (measured there).",
    ),
    no_library: bool = typer.Option(
        False, "--no-library", help="The baseline: the same problems with nothing grafted."
    ),
    compare: bool = typer.Option(
        False, "--compare", help="Run the baseline and the library run, and print both with the ratios."
    ),
    deposit_verified: bool = typer.Option(
        False, "--deposit-verified", help="Deposit each answer that matches the reference as a verified library entry."
    ),
    outputs: Path | None = typer.Option(
        None,
        "--outputs",
        "-o",
        help="Outputs JSONL (default: PROBLEMS stem + .solve.jsonl, or .baseline.jsonl, in the current folder).",
    ),
    limit: int | None = typer.Option(
        None, "--limit", min=1, callback=at_most_max_count, help="Solve only the first N problems."
    ),
    force: bool = typer.Option(False, "--force", help="Overwrite existing outputs files."),
    field: list[str] = typer.Option(
        [], "--field", help="Map a role to a field name: ROLE=NAME (id, problem, answer); 'id=' derives ids."
    ),
    answer_extract: str | None = typer.Option(
        None, "--answer-extract", help="Read the reference answer: verbatim, boxed or trailer."
    ),
    batch: int = batch_option("problems"),
    ray: bool = RAY_OPT,
    ray_address: str | None = RAY_ADDRESS_OPT,
    workers: int | None = WORKERS_OPT,
    manifest=None,
    store=None,
    ledger=None,
    allow_drift=False,
    as_json=False,  # engine_options
) -> None:
    """Answer each problem from the library: an exact hit in a handful of decode tokens, else the top-k related
    solutions grafted as one chain; --no-library for the baseline, --compare for both side by side."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

    from ..library.solve import Batcher, SolveRecord, check_library, check_outputs, check_sharded, prepare_solve
    from ..library.solve import compare as ratios

    on_ray = ray_choice(ray, ray_address, workers)
    s = session(manifest, store, ledger, allow_drift, field_overrides(field, answer_extract))
    ctx = s.run
    # The library run first: its checks (a store with a library) come before any work, and the baseline never
    # reads the library, so the answers the library run deposits cannot help it.
    modes = ["library", "baseline"] if compare else (["baseline"] if no_library else ["library"])
    targets = {mode: _outputs_path(problems, outputs, mode, len(modes) > 1) for mode in modes}
    for target in targets.values():
        check_outputs(problems, target, force, ctx)
    if "library" in modes:
        check_library(ctx)
    runs = {}
    progress = Progress(
        TextColumn("{task.fields[mode]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=err,
        transient=True,
        disable=as_json or not err.is_terminal,
    )
    with s.ray_pool(on_ray, workers) as pool, progress:
        if pool is not None:
            check_sharded(deposit_verified)  # before any worker starts
        task = progress.add_task(
            "starting Ray workers, loading models" if pool else "loading model, checking hashes",
            total=None,
            mode="solve",
        )
        if pool is not None:
            pool.start()  # one set of workers for both runs of --compare
            engine = None
        else:
            engine = s.engine
        progress.remove_task(task)
        # Both runs of --compare prepared first, sharing one batcher: the baseline's problems decode beside the
        # library run's, begun after them (the ledger and outputs are still the library run's, then the baseline's).
        batcher = Batcher(engine, batch) if engine is not None and batch > 1 and not deposit_verified else None
        finishers = {}
        for mode in modes:
            task = progress.add_task("", total=None, mode=mode)

            def on_start(n: int, t: TaskID = task) -> None:
                progress.update(t, total=n, completed=0)

            def on_progress(r: SolveRecord, t: TaskID = task) -> None:
                progress.update(t, advance=1, description=f"{r.id} ({r.hit})")

            finishers[mode] = prepare_solve(
                ctx,
                problems,
                targets[mode],
                k=k,
                min_score=min_score,
                force=force,
                use_library=mode == "library",
                deposit_verified=deposit_verified and (mode == "library" or not compare),
                limit=limit,
                batch=batch,
                engine=engine,
                pool=pool,
                on_start=on_start,
                on_progress=on_progress,
                batcher=batcher,
            )
        for mode in modes:
            runs[mode] = finishers[mode]()
    runs = {m: runs[m] for m in ("baseline", "library") if m in runs}
    notes = {r.batch_note for r in runs.values() if r.batch_note}
    if not as_json:
        for note in sorted(notes):
            err.print(f"note: one problem at a time: {note}", markup=False, highlight=False)
    result = {m: r.to_json() for m, r in runs.items()}
    if compare:
        result["ratios"] = ratios(runs["baseline"], runs["library"])
    if as_json:
        print_json(result)
        return
    _render(runs, result.get("ratios"))


def _outputs_path(problems: Path, outputs: Path | None, mode: str, several: bool) -> Path:
    """Where a run's outputs go: --outputs (with .library/.baseline before the suffix when both run), else
    PROBLEMS stem + .solve.jsonl / .baseline.jsonl in the current folder."""
    if outputs is not None:
        return outputs.with_name(f"{outputs.stem}.{mode}{outputs.suffix or '.jsonl'}") if several else outputs
    return Path(f"{problems.stem}.{'solve' if mode == 'library' else 'baseline'}.jsonl")


def _render(runs: dict, ratios: dict | None) -> None:
    for mode, run in runs.items():
        t = table(
            f"solve {run.problems} ({mode}) -> {run.outputs}",
            ("id", "hit", "grafted", "prefill", "decode", "answer", "reference", "ok", "s"),
            right=("grafted", "prefill", "decode", "s"),
        )
        for r in run.records[:50]:
            ok = "" if r.correct is None else ("[green]yes[/]" if r.correct else "[red]no[/]")
            # The answer is the model's text: escaped (control characters, rich markup) by cell().
            t.add_row(
                cell(r.id),
                r.hit,
                str(r.grafted_tokens),
                str(r.prefill_tokens),
                str(r.decode_tokens),
                cell((r.extracted or "")[:40]),
                cell((r.reference or "")[:40]),
                ok,
                f"{r.wall_s:.2f}",
            )
        if len(run.records) > 50:
            t.caption = f"(first 50 of {len(run.records)} problems; --json for all)"
        out.print(t)
    # ratio = baseline / library: how many times cheaper
    s = table("summary", ["", *runs, *(["ratio"] if ratios else [])], right=[*runs, "ratio"])
    tot = {m: r.totals() for m, r in runs.items()}

    def acc(t):
        if not t["scored"]:
            return "n/a"
        return f"{t['correct']}/{t['scored']} = {100 * t['accuracy']:.1f}% [{100 * t['wilson95_low']:.1f}, {100 * t['wilson95_high']:.1f}]"

    rows = [
        ("accuracy (Wilson 95%)", acc, None),
        ("exact / related hits", lambda t: f"{t['exact_hits']} / {t['related_hits']}", None),
        ("decode tokens", lambda t: f"{t['decode_tokens']:,}", "decode_tokens"),
        ("prefill tokens computed", lambda t: f"{t['prefill_tokens']:,}", "prefill_tokens"),
        ("tokens grafted from the store", lambda t: f"{t['grafted_tokens']:,}", None),
        ("wall time (s)", lambda t: f"{t['wall_s']:.2f}", "wall_s"),
        ("CPU time (s)", lambda t: f"{t['cpu_s']:.2f}", "cpu_s"),
        ("GPU energy (J)", lambda t: "n/a" if t["energy_j"] is None else f"{t['energy_j']:.1f}", "energy_j"),
        ("verified answers deposited", lambda t: str(t["deposited"]), None),
    ]
    for label, fmt, key in rows:
        cells = [fmt(tot[m]) for m in runs]
        if ratios:
            v = ratios.get(key) if key else None
            cells.append("" if key is None else ("n/a" if v is None else f"{v:,.1f}x"))
        s.add_row(label, *cells)
    out.print(s)
    if ratios and ratios.get("decode_tokens"):
        b, w, r = tot["baseline"]["decode_tokens"], tot["library"]["decode_tokens"], ratios["decode_tokens"]
        how = f"{r:,.1f}x fewer" if r >= 1 else f"{1 / r:,.1f}x more: the baseline stopped sooner"
        out.print(f"{w:,} decode tokens with the library instead of {b:,} without ({how})", markup=False)
