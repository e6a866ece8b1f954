"""Commands around the engine that never load torch: manifests, model hashes, the store's index."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ._common import (JSON_OPT, MANIFEST_OPT, STORE_OPT, _context, _human_bytes, _print_json, app, err,
                         handle_errors, manifest_app, out, prereg_app, store_app)
from ..errors import InputError

# ---------------------------------------------------------------------------------------------------------------
@manifest_app.command("validate")
@handle_errors
def manifest_validate(
    path: Optional[Path] = typer.Argument(None, help="Manifest YAML (default: the embedded one)."),
    as_json: bool = JSON_OPT,
) -> None:
    """Report every problem of a manifest, with its path and line, in one pass."""
    from ..errors import ManifestError
    from ..config.manifest import load_manifest

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
    from ..util.fsio import atomic_write_bytes
    from ..config.manifest import BUILTIN_PREFIX, data_dir, dump_yaml, make_manifest
    from ..config.modelhash import hash_model_dir

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
    from ..config.manifest import dump_yaml, load_manifest

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
    from ..config.modelhash import hash_model_dir

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
    from ..store.local import Store

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


# ---------------------------------------------------------------------------------------------------------------
@app.command()
@handle_errors
def score(
    outputs: Path = typer.Argument(..., help="Model outputs, JSON Lines with an id and an output text per line."),
    answers_file: Path = typer.Option(..., "--answers", help="Problems file with the reference answers (read with the manifest's input mapping)."),
    records: Optional[Path] = typer.Option(None, "--records", help="Per-sample records file (default: OUTPUTS with .scores.jsonl)."),
    id_field: str = typer.Option("id", "--id-field", help="Id field of the outputs file."),
    output_field: str = typer.Option("output", "--output-field", help="Text field of the outputs file."),
    field: list[str] = typer.Option([], "--field", help="Map a role of the answers file: ROLE=NAME (as for deposit)."),
    answer_extract: Optional[str] = typer.Option(None, "--answer-extract", help="Read reference answers: verbatim, boxed or trailer."),
    manifest: Optional[Path] = MANIFEST_OPT,
    ledger: Optional[Path] = typer.Option(None, "--ledger", help="Ledger file (default: the manifest's paths.ledger)."),
    as_json: bool = JSON_OPT,
) -> None:
    """Score outputs: last \\boxed{} (or 'The answer is:' / 'Answer:'), normalized, compared exactly; Wilson 95%."""
    from ._common import _field_overrides
    from ..runs.score import score_and_record

    ctx = _context(manifest, None, ledger, False, _field_overrides(field, answer_extract))
    rec_path = records or outputs.with_suffix(".scores.jsonl")
    result, rec_sha, written = score_and_record(ctx, outputs, answers_file, rec_path, id_field, output_field)
    summary = result.summary()
    if as_json:
        _print_json({**summary, "records": str(rec_path), "records_sha256": rec_sha, "ledger_seq": written["seq"]})
        return
    t = Table(title=f"score {outputs} against {answers_file}", title_justify="left")
    for col in ("id", "extracted", "reference", "correct"):
        t.add_column(col, overflow="fold")
    for r in result.records:
        t.add_row(r.id, "" if r.extracted is None else r.extracted, r.reference,
                  "[green]yes[/]" if r.correct else "[red]no[/]")
    out.print(t)
    out.print(f"accuracy {result.correct}/{result.n} = {float(summary['accuracy']):.4f}, Wilson 95% "
              f"[{float(summary['wilson95_low']):.4f}, {float(summary['wilson95_high']):.4f}]; records: {rec_path}",
              markup=False, soft_wrap=True)


@prereg_app.command("make")
@handle_errors
def prereg_make(
    ledger: Optional[Path] = typer.Argument(None, help="Ledger of the finished run (default: the manifest's paths.ledger)."),
    target: str = typer.Option(..., "--target", help="Name of the target these hashes were produced on, e.g. cpu-portable."),
    output: Path = typer.Option(..., "--output", "-o", help="Prereg YAML to write."),
    name: Optional[str] = typer.Option(None, "--name", help="The prereg's name."),
    from_seq: int = typer.Option(0, "--from-seq", min=0, help="Use entries from this 0-based line on."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing output file."),
    manifest: Optional[Path] = MANIFEST_OPT,
) -> None:
    """Turn a finished run's ledger entries into a prereg.yaml that another machine or target can replay."""
    from ..runs.replay import prereg_from_ledger, write_prereg

    if output.exists() and not force:
        raise InputError(f"{output} exists", "pass --force to overwrite it (then register the new version)")
    path = ledger or Path(_context(manifest, None, None, False).ledger)
    data = prereg_from_ledger(path, target, output, name, from_seq)
    write_prereg(output, data)
    out.print(f"wrote {output}: {len(data['runs'])} runs, target {target}; register it with "
              f"`kvgraft replay --register {output}`", markup=False)
