"""The one place an error becomes what the user sees: one ``Error: ... Hint: ...`` line on stderr and an exit code.

0 ok, 1 a check ran and failed (:class:`CheckFailed`), 2 bad input or usage (:class:`InputError`, and every command
line usage error), 130 interrupted. Anything else is a bug: one ``internal error`` line, exit 1. ``KVGRAFT_DEBUG=1``
adds the traceback.
"""

from __future__ import annotations

import os
import sys
import traceback

import typer

# Typer (since 0.26) vendors Click as ``typer._click`` and re-exports only some of its exceptions; these two it does
# not. pyproject pins typer to the vendoring releases, and tests/test_cli_errors.py fails loudly if they move.
from typer._click.exceptions import NoArgsIsHelpError, UsageError

from ..errors import KvgraftError
from ._output import err, printable


def _line(message: str, hint: str | None) -> str:
    msg = message if message.endswith(".") else message + "."
    if not hint:
        return f"Error: {msg}"
    return f"Error: {msg} Hint: {hint if hint.endswith('.') else hint + '.'}"


def _say(text: str) -> None:
    # One line, whatever a message quotes from a file: control characters and line breaks are escaped.
    err.print(printable(text, newlines=False), soft_wrap=True, markup=False)


def render(exc: BaseException) -> int:
    """Print ``exc`` the way kvgraft reports errors and return the process exit code."""
    if os.environ.get("KVGRAFT_DEBUG") == "1" and not isinstance(exc, (UsageError, KeyboardInterrupt, typer.Abort)):
        traceback.print_exception(exc)
    if isinstance(exc, KvgraftError):
        _say(_line(exc.message, exc.hint))
        return exc.exit_code
    if isinstance(exc, NoArgsIsHelpError):  # `kvgraft ledger` alone: the group's help, as a usage error
        # Building the exception rendered the help already when rich prints it; plain Click only returned it.
        text = exc.format_message()
        if text.strip():
            sys.stdout.write(text + "\n")
        return 2
    if isinstance(exc, UsageError):
        ctx = getattr(exc, "ctx", None)
        where = ctx.command_path if ctx else "kvgraft"
        msg = " ".join(exc.format_message().split()).rstrip(".")
        _say(f"Error: {where}: {msg}. Hint: see `{where} --help`.")
        return 2
    if isinstance(exc, (KeyboardInterrupt, typer.Abort)):
        _say(
            _line(
                "interrupted",
                "every ledger line written before it is whole and kept; re-run the same command "
                "to resume (`kvgraft verify` checks the ledger)",
            )
        )
        return 130
    _say(
        f"Error: internal error: {type(exc).__name__}: {exc}. Hint: re-run with KVGRAFT_DEBUG=1 for the traceback "
        "and report it."
    )
    return 1
