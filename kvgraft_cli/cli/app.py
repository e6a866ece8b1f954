"""The ``kvgraft`` command line: parse, call the library, render. torch is imported only inside engine commands."""

from __future__ import annotations

import sys

import typer

from . import admin_cmds, engine_cmds, exact_cmds, ledger_cmds  # noqa: F401  (registers the commands)
from ._common import app, err

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
