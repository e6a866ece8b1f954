"""``kvgraft store gc``: delete what no index row and no ledger line names, and nothing else."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError, LedgerError
from ..ledger import log as ledger
from ..store.local import Store
from ..util import jsonio

_HEX64 = re.compile(r"\b[0-9a-f]{64}\b")


@dataclass
class GcReport:
    """What a collection found and (unless a dry run) deleted."""

    store: str
    ledgers: list[str]
    temporary: list[str]
    unindexed: list[str]
    kept_for_ledger: list[str]
    bytes: int
    deleted: bool

    def to_json(self) -> dict:
        return self.__dict__.copy()


def ledger_digests(paths: list[Path]) -> set[str]:
    """Every 64-hex-digit string the ledgers' complete lines hold (artifact hashes, chain links, inputs): more than
    the artifacts they name, never less, so a collection that keeps these keeps every named artifact."""
    found: set[str] = set()
    for path in paths:
        if not path.is_file():  # a ledger gc cannot read could name anything: delete nothing
            raise InputError(
                f"ledger not found: {path}",
                "name every ledger that records this store's artifacts "
                "with --ledger (a missing one would let gc delete what it names)",
            )
        lines, _ = ledger.split_lines(path.read_bytes())
        for i, line in enumerate(lines):
            try:
                jsonio.loads(line)
            except ValueError:
                raise LedgerError(
                    f"{path}: line {i + 1} is not JSON; cannot tell what it names", f"run `kvgraft verify {path}`"
                ) from None
            found.update(_HEX64.findall(line.decode("utf-8", "replace")))
    return found


def collect_garbage(store_path: Path, ledgers: list[Path], grace_s: float = 3600.0, dry_run: bool = False) -> GcReport:
    """Find (and unless ``dry_run`` delete) the store's temporary files and the objects no index row names, keeping
    any object a ledger line names; only files untouched for ``grace_s`` seconds are considered."""
    keep = ledger_digests(ledgers)
    with Store(store_path, create=False) as store:
        garbage = store.garbage(keep, grace_s)
        if not dry_run:
            store.collect(garbage)
    return GcReport(
        str(store_path),
        [str(p) for p in ledgers],
        [str(p) for p, _ in garbage.temporary],
        [str(p) for p, _ in garbage.unindexed],
        garbage.kept,
        garbage.bytes,
        not dry_run,
    )
