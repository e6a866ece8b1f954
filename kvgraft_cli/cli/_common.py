"""What the CLI modules share: the typer apps, consoles, common options, error handling and small helpers."""

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

from ..errors import InputError, KvgraftError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Deposit a frozen model's KV cache as byte-exact artifacts, graft them back, keep a ledger.")
manifest_app = typer.Typer(no_args_is_help=True, help="Validate, write and show run-manifests.")
store_app = typer.Typer(no_args_is_help=True, help="Look into an artifact store.")
ledger_app = typer.Typer(no_args_is_help=True, help="Checkpoint, sign, diff and repair a ledger.")
prereg_app = typer.Typer(no_args_is_help=True, help="Make pre-registrations from finished runs.")
app.add_typer(manifest_app, name="manifest")
app.add_typer(store_app, name="store")
app.add_typer(ledger_app, name="ledger")
app.add_typer(prereg_app, name="prereg")

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

MANIFEST_OPT = typer.Option(None, "--manifest", "-m", help="Run-manifest YAML (default: the embedded tiny Gemma-4).")
STORE_OPT = typer.Option(None, "--store", help="Store directory (default: the manifest's paths.store).")
LEDGER_OPT = typer.Option(None, "--ledger", help="Ledger file (default: the manifest's paths.ledger).")
DRIFT_OPT = typer.Option(False, "--allow-drift", help="Proceed when the environment differs from the pin; the ledger records it.")
JSON_OPT = typer.Option(False, "--json", help="Print a machine-readable JSON result on stdout.")
ARTIFACT_ARG = typer.Argument(None, help="Artifact hash (or unique prefix), problem id, or .kvg path; default: the latest deposit.")


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
    from ..config.manifest import load_manifest, with_overrides
    from ..runs.context import RunContext

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


def _artifact_and_engine(manifest: Optional[Path], store: Optional[Path], ledger: Optional[Path], allow_drift: bool,
                         artifact: Optional[str]):
    """What graft and probe start with: (RunContext, the opened artifact, the loaded engine), in the safe order."""
    from ..engine.engine import load_engine, pin_environment
    from ..runs.graft import open_artifact

    ctx = _context(manifest, store, ledger, allow_drift)
    drift = pin_environment(ctx.manifest)  # kernel flags first: reading the artifact imports torch
    loaded = open_artifact(ctx, artifact)  # re-hashed here, before the (slow) model load
    return ctx, loaded, load_engine(ctx.manifest, ctx.allow_drift, drift)
