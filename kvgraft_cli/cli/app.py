"""The ``kvgraft`` root command: the command table and :func:`main`, where every error is rendered (once).

Each top-level command is a plain function in a module named after it; each group (manifest, store, ledger, prereg)
is a module with its own ``app``. Commands import torch inside their body, so ``kvgraft --help``, ``verify``,
``inspect``, ``ledger``, ``score`` and ``report`` never load it (tests/test_cli_ux.py checks it).
"""

from __future__ import annotations

import gc
import sys

import typer

from . import (
    deposit,
    graft,
    inspect,
    ledger,
    manifest,
    matrix,
    model_hash,
    prereg,
    probe,
    replay,
    report,
    score,
    serve,
    solve,
    store,
    verify,
)
from ._errors import render
from ._help import Command, Group

app = typer.Typer(
    cls=Group,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Deposit a frozen model's KV cache as byte-exact artifacts, graft them back, keep a ledger.",
)

COMMANDS = {
    "deposit": deposit.deposit,
    "graft": graft.graft,
    "probe": probe.probe,
    "matrix": matrix.matrix,
    "replay": replay.replay,
    "score": score.score,
    "verify": verify.verify,
    "report": report.report,
    "inspect": inspect.inspect,
    "solve": solve.solve,
    "serve": serve.serve,
    "model-hash": model_hash.model_hash,
}
GROUPS = {
    "manifest": manifest.app,
    "store": store.app,
    "ledger": ledger.app,
    "prereg": prereg.app,
}
for _name, _fn in COMMANDS.items():
    app.command(_name, cls=Command)(_fn)
for _name, _group in GROUPS.items():
    app.add_typer(_group, name=_name)


def main() -> None:
    """Console-script entry point: run the command; any error becomes one ``Error:`` line and its exit code."""
    try:
        code = app(standalone_mode=False)
        if code == 130:
            # Typer turns a KeyboardInterrupt into Exit(130) and returns the code without a word (no kvgraft command
            # exits 130 itself): say it, and what the user can rely on (#24.10).
            code = render(KeyboardInterrupt())
    except BaseException as e:  # noqa: BLE001  (SystemExit from typer.Exit is handled by Click already)
        if isinstance(e, SystemExit):
            raise
        code = render(e)
    if "torch" in sys.modules:
        # Skip the interpreter's last collection over torch's and transformers' objects at exit (docs/PERFORMANCE.md,
        # "Start-up time", says what it cost);
        # every file is closed and every ledger line written by now.
        gc.freeze()
    sys.exit(code if isinstance(code, int) else 0)
