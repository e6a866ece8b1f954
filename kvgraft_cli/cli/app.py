"""The ``kvgraft`` root command: the command table and :func:`main`, where every error is rendered (once).

Each top-level command is a plain function in a module named after it; each group (manifest, store, ledger, prereg)
is a module with its own ``app``. Commands import torch inside their body, so ``kvgraft --help``, ``verify``,
``ledger`` and ``score`` never load it.
"""

from __future__ import annotations

import sys

import typer

from . import deposit, graft, ledger, manifest, matrix, model_hash, prereg, probe, replay, score, solve, store, verify
from ._errors import render

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Deposit a frozen model's KV cache as byte-exact artifacts, graft them back, keep a ledger.")

COMMANDS = {
    "deposit": deposit.deposit,
    "graft": graft.graft,
    "probe": probe.probe,
    "matrix": matrix.matrix,
    "replay": replay.replay,
    "score": score.score,
    "verify": verify.verify,
    "solve": solve.solve,
    "model-hash": model_hash.model_hash,
}
GROUPS = {
    "manifest": manifest.app,
    "store": store.app,
    "ledger": ledger.app,
    "prereg": prereg.app,
}
for _name, _fn in COMMANDS.items():
    app.command(_name)(_fn)
for _name, _group in GROUPS.items():
    app.add_typer(_group, name=_name)


def main() -> None:
    """Console-script entry point: run the command; any error becomes one ``Error:`` line and its exit code."""
    try:
        code = app(standalone_mode=False)
    except BaseException as e:  # noqa: BLE001  (SystemExit from typer.Exit is handled by Click already)
        if isinstance(e, SystemExit):
            raise
        code = render(e)
    sys.exit(code if isinstance(code, int) else 0)
