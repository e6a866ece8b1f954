"""The ``kvgraft`` command line: parse, call the library, render. torch is imported only inside engine commands."""

from __future__ import annotations

import functools
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from .errors import CheckFailed, InputError, KvgraftError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Deposit a frozen model's KV cache as byte-exact artifacts, graft them back, keep a ledger.")
manifest_app = typer.Typer(no_args_is_help=True, help="Validate, write and show run-manifests.")
store_app = typer.Typer(no_args_is_help=True, help="Look into an artifact store.")
app.add_typer(manifest_app, name="manifest")
app.add_typer(store_app, name="store")

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

MANIFEST_OPT = typer.Option(None, "--manifest", "-m", help="Run-manifest YAML (default: the embedded tiny Gemma-4).")
STORE_OPT = typer.Option(None, "--store", help="Store directory (default: the manifest's paths.store).")
LEDGER_OPT = typer.Option(None, "--ledger", help="Ledger file (default: the manifest's paths.ledger).")
DRIFT_OPT = typer.Option(False, "--allow-drift", help="Proceed when the environment differs from the pin; the ledger records it.")
JSON_OPT = typer.Option(False, "--json", help="Print a machine-readable JSON result on stdout.")


def handle_errors(fn):
    """Turn KvgraftError into one `Error:` line and its exit code; tracebacks only with KVGRAFT_DEBUG=1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except KvgraftError as e:
            if os.environ.get("KVGRAFT_DEBUG") == "1":
                traceback.print_exc()
            msg = e.message if e.message.endswith(".") else e.message + "."
            hint = f" Hint: {e.hint}." if e.hint and not e.hint.endswith(".") else (f" Hint: {e.hint}" if e.hint else "")
            err.print(f"Error: {msg}{hint}", soft_wrap=True, markup=False)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            err.print("Error: interrupted.", markup=False)
            raise typer.Exit(130) from None
        except Exception as e:  # a bug: say so in one line, full detail on request
            if os.environ.get("KVGRAFT_DEBUG") == "1":
                traceback.print_exc()
            err.print(f"Error: internal error: {type(e).__name__}: {e}. Hint: re-run with KVGRAFT_DEBUG=1 for "
                      "the traceback and report it.", soft_wrap=True, markup=False)
            raise typer.Exit(1) from None

    return wrapper


def _context(manifest: Optional[Path], store: Optional[Path], ledger: Optional[Path], allow_drift: bool,
             overrides: dict[str, Any] | None = None):
    from .manifest import load_manifest, with_overrides
    from .runctx import RunContext

    m = with_overrides(load_manifest(manifest), overrides or {})
    return RunContext.make(m, store, ledger, allow_drift)


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _field_overrides(fields: list[str], answer_extract: Optional[str]) -> dict[str, Any]:
    allowed = ("id", "problem", "solution", "answer")
    result: dict[str, Any] = {}
    for f in fields:
        role, sep, name = f.partition("=")
        if not sep or role not in allowed:
            raise InputError(f"--field {f!r}: expected ROLE=NAME with ROLE one of {', '.join(allowed)}",
                             "e.g. --field problem=question --field solution=answer")
        if not name and role in ("problem", "solution"):
            raise InputError(f"--field {f!r}: the {role} field needs a name")
        result[f"input.{role}"] = name or None
    if answer_extract:
        result["input.answer_extract"] = answer_extract
    return result


# ---------------------------------------------------------------------------------------------------------------
@app.command()
@handle_errors
def deposit(
    problems: Path = typer.Argument(..., help="JSON Lines file, one problem per line."),
    manifest: Optional[Path] = MANIFEST_OPT,
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Deposit only the first N problems."),
    field: list[str] = typer.Option([], "--field", help="Map a role to a field name: ROLE=NAME (id, problem, solution, answer); 'id=' derives ids."),
    answer_extract: Optional[str] = typer.Option(None, "--answer-extract", help="Read the reference answer: verbatim, boxed or trailer."),
    allow_unverified: bool = typer.Option(False, "--allow-unverified", help="Also deposit unverifiable or wrong solutions (marked unverified)."),
    recompute: bool = typer.Option(False, "--recompute", help="Prefill again even when the store has the prefix; fail if the bytes differ."),
    store: Optional[Path] = STORE_OPT,
    ledger: Optional[Path] = LEDGER_OPT,
    allow_drift: bool = DRIFT_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Verify, prefill and store each problem's solution as a byte-exact KV artifact; record it in the ledger."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .deposit import deposit as run_deposit

    ctx = _context(manifest, store, ledger, allow_drift, _field_overrides(field, answer_extract))
    progress = Progress(TextColumn("depositing"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.description}"), console=err, transient=True,
                        disable=as_json or not err.is_terminal)
    task = None
    with progress:
        def on_start(n: int) -> None:
            nonlocal task
            task = progress.add_task("", total=n)

        def on_progress(r) -> None:
            progress.update(task, advance=1, description=r.id)

        report = run_deposit(ctx, problems, limit=limit, allow_unverified=allow_unverified, recompute=recompute,
                             on_start=on_start, on_progress=on_progress)
    if as_json:
        _print_json(report.to_json())
        return
    table = Table(title=f"deposit {problems}", title_justify="left")
    for col in ("id", "line", "status", "tokens", "bytes", "artifact", "note"):
        table.add_column(col, justify="right" if col in ("line", "tokens", "bytes") else "left")
    for r in report.results:
        style = {"deposited": "green", "existing": "cyan", "skipped": "yellow"}[r.status]
        note = r.reason if r.status == "skipped" else ("verified" if r.verified else "UNVERIFIED: " + r.reason)
        table.add_row(r.id, str(r.line), f"[{style}]{r.status}[/]", str(r.num_tokens or ""),
                      _human_bytes(r.file_bytes) if r.file_bytes else "", (r.artifact or "")[:12], note)
    out.print(table)
    t = report.totals()
    summary = Table(show_header=True, title="summary", title_justify="left")
    for col in ("problems", "deposited", "already stored", "skipped", "tokens", "bytes written"):
        summary.add_column(col, justify="right")
    summary.add_row(str(t["problems"]), str(t["deposited"]), str(t["existing"]), str(t["skipped"]),
                    str(t["tokens"]), _human_bytes(t["bytes"]))
    out.print(summary)
    out.print(f"store: {ctx.store}   ledger: {ctx.ledger}   manifest: {ctx.manifest.source}")


# ---------------------------------------------------------------------------------------------------------------
@app.command()
@handle_errors
def graft(
    artifact: Optional[str] = typer.Argument(None, help="Artifact hash (or unique prefix), problem id, or .kvg path; default: the latest deposit."),
    query: str = typer.Option("What is the final answer?", "--query", "-q", help="Query text for the manifest's query template."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", "-n", min=0, help="Tokens to decode (default: the manifest's decode.max_new_tokens)."),
    check: bool = typer.Option(False, "--check", help="Prove byte-exactness against a fresh computation instead of generating."),
    samples: int = typer.Option(50, "--samples", min=1, help="With --check: how many different suffixes."),
    manifest: Optional[Path] = MANIFEST_OPT,
    store: Optional[Path] = STORE_OPT,
    ledger: Optional[Path] = LEDGER_OPT,
    allow_drift: bool = DRIFT_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Restore an artifact at its own position and continue it; with --check, compare against fresh computation."""
    from .engine import load_engine, pin_environment
    from .graft import graft_check, graft_generate, open_artifact

    ctx = _context(manifest, store, ledger, allow_drift)
    drift = pin_environment(ctx.manifest)  # kernel flags first: reading the artifact imports torch
    loaded = open_artifact(ctx, artifact)  # re-hashed here, before the (slow) model load
    engine = load_engine(ctx.manifest, ctx.allow_drift, drift)
    n_new = ctx.manifest.data["decode"]["max_new_tokens"] if max_new_tokens is None else max_new_tokens
    if not check:
        r = graft_generate(ctx, engine, loaded, query, n_new)
        if as_json:
            _print_json({"artifact": r.artifact, "prefix_tokens": r.prefix_tokens, "query": r.query,
                         "generated_ids": r.generated_ids, "text": r.text, "ledger_seq": r.ledger_seq})
        else:
            err.print(f"artifact {r.artifact[:16]}... ({r.prefix_tokens} prefix tokens) + query {r.query!r}")
            out.print(r.text, markup=False)
        return

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(TextColumn("checking"), BarColumn(), MofNCompleteColumn(), console=err, transient=True,
                  disable=as_json or not err.is_terminal) as progress:
        task = progress.add_task("", total=samples)
        report = graft_check(ctx, engine, loaded, samples, n_new, on_sample=lambda s: progress.advance(task))
    if as_json:
        _print_json(report.to_json())
    else:
        _render_check(report)
    if not report.passed:
        raise CheckFailed(f"graft is not byte-exact: {report.sha_equal}/{report.n} samples SHA-equal, "
                          f"largest KL {report.max_kl:.3g}, deposit reproduced: {report.deposit_reproduced}")


def _render_check(report) -> None:
    table = Table(title=f"graft --check {report.artifact[:16]}... ({report.prefix_tokens} prefix tokens, "
                        f"schedule {report.schedule['schedule']})", title_justify="left")
    for col in ("sample", "suffix tokens", "logits SHA-256 (fresh)", "equal", "KL", "argmax", "decode"):
        table.add_column(col)
    for s in report.samples:
        mark = "[green]yes[/]" if s.sha_equal else "[red]NO[/]"
        table.add_row(str(s.index), str(s.suffix_tokens), s.fresh_sha256[:16], mark, f"{s.max_kl:.3g}",
                      f"{100 * s.argmax_agreement:.0f}%", "same" if s.generated_equal else "[red]differs[/]")
    out.print(table)
    ok = "[green]PASS[/]" if report.passed else "[red]FAIL[/]"
    out.print(f"{ok}  {report.sha_equal}/{report.n} samples SHA-equal, largest KL {report.max_kl}, "
              f"argmax agreement {100 * report.argmax_agreement:.1f}%, deposit reproduced: "
              f"{'yes' if report.deposit_reproduced else 'NO'}")
    out.print(f"single forward over prefix+suffix vs this schedule: max |diff| {report.single_pass_max_abs_diff:.3g} "
              "(informative: exactness is defined against the manifest's prefill schedule)")


# ---------------------------------------------------------------------------------------------------------------
@manifest_app.command("validate")
@handle_errors
def manifest_validate(
    path: Optional[Path] = typer.Argument(None, help="Manifest YAML (default: the embedded one)."),
    as_json: bool = JSON_OPT,
) -> None:
    """Report every problem of a manifest, with its path and line, in one pass."""
    from .errors import ManifestError
    from .manifest import load_manifest

    try:
        m = load_manifest(path)
    except ManifestError as e:
        if not e.problems:
            raise
        if as_json:
            _print_json({"valid": False, "problems": e.problems})
        else:
            for p in e.problems:
                out.print(p, markup=False, soft_wrap=True)
        raise InputError(f"{path}: {len(e.problems)} problem(s) found", "fix them and run validate again") from None
    if as_json:
        _print_json({"valid": True, "source": m.source, "sha256": m.file_sha256, "compute_sha256": m.compute_sha256})
    else:
        out.print(f"{m.source}: valid (file sha256 {m.file_sha256}, compute pin {m.compute_sha256})", markup=False,
                  soft_wrap=True)


@manifest_app.command("init")
@handle_errors
def manifest_init(
    model_dir: Path = typer.Argument(..., help="Local model directory (Hugging Face layout, safetensors)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write here (default: stdout)."),
    profile: str = typer.Option("portable", "--profile", help="Kernel-flag profile: portable or native."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
    attn: str = typer.Option("eager", "--attn", help="Attention implementation: eager or sdpa."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="Pin this many threads (default: the profile's)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing output file."),
) -> None:
    """Write a pinned manifest for a local model directory (model and tokenizer hashes computed here)."""
    from .hashing import atomic_write_bytes
    from .manifest import BUILTIN_PREFIX, data_dir, dump_yaml, make_manifest
    from .modelhash import hash_model_dir

    if device not in ("cpu", "cuda") or dtype not in ("float32", "bfloat16", "float16") or attn not in ("eager", "sdpa"):
        raise InputError("--device must be cpu|cuda, --dtype float32|bfloat16|float16, --attn eager|sdpa")
    if str(model_dir).startswith(BUILTIN_PREFIX):
        model_path, real = str(model_dir), data_dir() / str(model_dir)[len(BUILTIN_PREFIX):]
    else:
        real = model_dir.resolve()
        base = (output.resolve().parent if output else Path.cwd())
        model_path = os.path.relpath(real, base)
    hashes = hash_model_dir(real)
    gpu = None
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise InputError("--device cuda: no CUDA GPU is visible here", "write the manifest on the GPU machine")
        gpu = torch.cuda.get_device_name(0)
    data = make_manifest(model_path, hashes.model_sha256, hashes.tokenizer_sha256, profile=profile, device=device,
                         dtype=dtype, attn_implementation=attn, threads=threads, gpu_name=gpu)
    text = "# kvgraft run-manifest, written by `kvgraft manifest init`\n" + dump_yaml(data)
    if output is None:
        sys.stdout.write(text)
        return
    if output.exists() and not force:
        raise InputError(f"{output} exists", "pass --force to overwrite it")
    atomic_write_bytes(output, text.encode())
    err.print(f"wrote {output} (model {hashes.model_sha256[:16]}..., profile {profile})")


@manifest_app.command("show")
@handle_errors
def manifest_show(
    path: Optional[Path] = typer.Argument(None, help="Manifest YAML (default: the embedded one)."),
    as_json: bool = JSON_OPT,
) -> None:
    """Print a validated manifest (the embedded default when no path is given) with its hashes."""
    from .manifest import dump_yaml, load_manifest

    m = load_manifest(path)
    if as_json:
        _print_json({"source": m.source, "sha256": m.file_sha256, "compute_sha256": m.compute_sha256,
                     "model_dir": str(m.model_dir), "manifest": m.data})
        return
    sys.stdout.write(f"# source: {m.source}\n# sha256: {m.file_sha256}\n# compute pin: {m.compute_sha256}\n")
    sys.stdout.write(dump_yaml(m.data))


# ---------------------------------------------------------------------------------------------------------------
@app.command("model-hash")
@handle_errors
def model_hash(
    model_dir: Path = typer.Argument(..., help="Local model directory."),
    as_json: bool = JSON_OPT,
) -> None:
    """Print a model directory's per-file SHA-256 listing, model hash and tokenizer hash."""
    from .modelhash import hash_model_dir

    h = hash_model_dir(model_dir)
    if as_json:
        _print_json({"model_sha256": h.model_sha256, "tokenizer_sha256": h.tokenizer_sha256, "files": h.files})
        return
    sys.stdout.write(h.listing() + f"model sha256:     {h.model_sha256}\ntokenizer sha256: {h.tokenizer_sha256}\n")


@store_app.command("list")
@handle_errors
def store_list(
    store: Optional[Path] = STORE_OPT,
    manifest: Optional[Path] = MANIFEST_OPT,
    limit: Optional[int] = typer.Option(None, "--limit", min=1),
    as_json: bool = JSON_OPT,
) -> None:
    """List the store's index: problem id, artifact, tokens, size, verified."""
    from .store import Store

    ctx = _context(manifest, store, None, False)
    with Store(ctx.store, create=False) as s:
        entries, stats = s.entries(limit), s.stats()
    if as_json:
        _print_json({"stats": stats, "entries": [e.__dict__ for e in entries]})
        return
    table = Table(title=f"store {ctx.store}: {stats['objects']} objects, {stats['entries']} entries, "
                        f"{_human_bytes(stats['file_bytes'])}", title_justify="left")
    for col in ("problem id", "artifact", "tokens", "bytes", "verified"):
        table.add_column(col)
    for e in entries:
        table.add_row(e.problem_id, e.artifact[:16], str(e.num_tokens), _human_bytes(e.file_bytes),
                      "yes" if e.verified else "no")
    out.print(table)


def _is(exc: BaseException, name: str) -> bool:
    # Typer 0.29 vendors its own Click (typer._click); match exception classes by name so either works.
    return any(c.__name__ == name for c in type(exc).__mro__)


def main() -> None:
    """Console-script entry point. Usage errors (unknown option, bad value) become one `Error:` line, exit 2."""
    try:
        code = app(standalone_mode=False)
    except typer.Abort:
        err.print("Error: interrupted.", markup=False)
        code = 130
    except Exception as e:
        if _is(e, "NoArgsIsHelpError"):
            sys.stdout.write(e.ctx.get_help() + "\n")
            code = 2
        elif _is(e, "UsageError"):
            where = e.ctx.command_path if getattr(e, "ctx", None) else "kvgraft"
            msg = " ".join(e.format_message().split()).rstrip(".")
            err.print(f"Error: {where}: {msg}. Hint: see `{where} --help`.", soft_wrap=True, markup=False)
            code = 2
        else:
            raise
    sys.exit(code if isinstance(code, int) else 0)
