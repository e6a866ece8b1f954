"""`kvgraft graft`: restore an artifact and continue it, or prove the graft byte-exact (`--check`)."""

from __future__ import annotations

import typer

from ..errors import CheckFailed
from ._common import ARTIFACT_ARG, artifact_and_engine, at_most_max_count, engine_options
from ._output import err, out, print_json, printable, short, table


@engine_options
def graft(
    artifact: str | None = ARTIFACT_ARG,
    query: str = typer.Option(
        "What is the final answer?", "--query", "-q", help="Query text for the manifest's query template."
    ),
    max_new_tokens: int | None = typer.Option(
        None,
        "--max-new-tokens",
        "-n",
        min=0,
        callback=at_most_max_count,
        # 16: runs.graft.CHECK_MAX_NEW_TOKENS (the CLI imports run modules only when a command runs; test_graft pins it)
        help="Tokens to decode (default: the manifest's decode.max_new_tokens; with --check: 16 per sample, "
        "the check's own budget).",
    ),
    check: bool = typer.Option(
        False,
        "--check",
        help="Prove byte-exactness against a fresh computation instead of generating (16 decode steps per sample "
        "unless -n says otherwise).",
    ),
    samples: int = typer.Option(
        50, "--samples", min=1, callback=at_most_max_count, help="With --check: how many different suffixes."
    ),
    manifest=None,
    store=None,
    ledger=None,
    allow_drift=False,
    as_json=False,  # engine_options
) -> None:
    """Restore an artifact at its own position and continue it; with --check, compare against fresh computation."""
    from ..runs.graft import CHECK_MAX_NEW_TOKENS

    s, loaded = artifact_and_engine(manifest, store, ledger, allow_drift, artifact)
    # A graft decodes the manifest's answer budget; a check its own (CHECK_MAX_NEW_TOKENS: the manifest's may be
    # hundreds of tokens a sample, and the check proves exactness, not an answer). -n overrides either.
    if max_new_tokens is not None:
        n_new = max_new_tokens
    else:
        n_new = CHECK_MAX_NEW_TOKENS if check else s.manifest.decode.max_new_tokens
    if not check:
        r = s.generate(loaded, query, n_new)
        if as_json:
            print_json(
                {
                    "artifact": r.artifact,
                    "identity": r.identity,
                    "prefix_tokens": r.prefix_tokens,
                    "query": r.query,
                    "generated_ids": r.generated_ids,
                    "text": r.text,
                    "ledger_seq": r.ledger_seq,
                }
            )
        else:
            _identity_note(r.identity)
            err.print(
                f"artifact {r.artifact} ({r.prefix_tokens} prefix tokens) + query {printable(r.query, False)!r}",
                markup=False,
                soft_wrap=True,
            )
            # The model's text, with control characters escaped (the random default model emits them).
            out.print(printable(r.text), markup=False, soft_wrap=True)
        return

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(
        TextColumn("checking"),
        BarColumn(),
        MofNCompleteColumn(),
        console=err,
        transient=True,
        disable=as_json or not err.is_terminal,
    ) as progress:
        task = progress.add_task("", total=samples)
        report = s.check_graft(
            loaded, samples=samples, max_new_tokens=n_new, on_sample=lambda _: progress.advance(task)
        )
    if as_json:
        print_json(report.to_json())
    else:
        _identity_note(report.identity)
        _render_check(report)
    if not report.passed:
        raise CheckFailed(
            f"graft is not byte-exact: {report.sha_equal}/{report.n} samples SHA-equal, "
            f"largest KL {report.max_kl:.3g}, deposit reproduced: {report.deposit_reproduced}"
        )


def _identity_note(identity: str) -> None:
    if identity == "file":
        err.print(
            "note: this .kvg file is not named by its hash and the store does not hold it: its identity is its "
            "own payload hash, checked against nothing recorded",
            markup=False,
            soft_wrap=True,
        )


def _render_check(report) -> None:
    t = table(
        f"graft --check {report.artifact} ({report.prefix_tokens} prefix tokens, "
        f"schedule {report.schedule['schedule']})",
        ("sample", "suffix tokens", "logits SHA-256 (fresh)", "equal", "KL", "argmax", "decode"),
    )
    for s in report.samples:
        mark = "[green]yes[/]" if s.sha_equal else "[red]NO[/]"
        t.add_row(
            str(s.index),
            str(s.suffix_tokens),
            short(s.fresh_sha256),
            mark,
            f"{s.max_kl:.3g}",
            f"{100 * s.argmax_agreement:.0f}%",
            "same" if s.generated_equal else "[red]differs[/]",
        )
    out.print(t)
    ok = "[green]PASS[/]" if report.passed else "[red]FAIL[/]"
    out.print(
        f"{ok}  {report.sha_equal}/{report.n} samples SHA-equal, largest KL {report.max_kl}, "
        f"argmax agreement {100 * report.argmax_agreement:.1f}%, deposit reproduced: "
        f"{'yes' if report.deposit_reproduced else 'NO'}"
    )
    if report.schedule.get("schedule") == "invariant":
        same = "[green]SHA-equal[/]" if report.single_pass_sha_equal else "[red]NOT SHA-equal[/]"
        out.print(
            f"single forward over prefix+suffix (token by token) vs graft: {same}, max |diff| "
            f"{report.single_pass_max_abs_diff:.3g}; one batched call of the model's own kernels differs by "
            f"{report.batched_max_abs_diff:.3g} (informative)"
        )
        return
    out.print(
        f"single forward over prefix+suffix vs this schedule: max |diff| {report.single_pass_max_abs_diff:.3g} "
        "(informative: exactness is defined against the manifest's prefill schedule; the invariant schedule "
        "makes it 0)"
    )
