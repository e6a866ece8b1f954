"""Where a report may be written: never over the ledger or a file kvgraft owns, only over an earlier report.

Checked before anything is read or written, so a refused ``-o`` leaves no file behind. Owned: the ledger and its
lock file, the checkpoint and key given, every file a ledger line names (manifests, problems, outputs, records,
artifacts) and everything inside a store (the folder above an artifact's ``objects/``). An existing file is
overwritten only when it is a kvgraft report (it starts with :data:`render.MARKER`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from ..errors import InputError
from ..ledger.entries import named_files
from ..util.fsio import inside, same_file
from .collect import read_entries
from .render import MARKER

HINT = "write the report somewhere else (-o report.html)"


def owned_files(ledger: Path, data: bytes) -> tuple[list[Path], list[Path]]:
    """(files, store folders) the ledger names, paths joined to the ledger's folder as `verify` joins them."""
    base = ledger.parent
    files: list[Path] = [ledger, ledger.with_name(ledger.name + ".lock")]
    stores: list[Path] = []
    for _, entry in read_entries(data):
        if entry is None:
            continue
        for _, d in named_files(entry, hashed=False):
            if d["path"] and "\x00" not in d["path"]:
                p = base / d["path"]
                files.append(p)
                if p.suffix == ".kvg" and "objects" in p.parts:
                    stores.append(Path(*p.parts[: len(p.parts) - 1 - p.parts[::-1].index("objects")]))
    return files, sorted(set(stores))


def check(out: Path, ledger: Path, data: bytes, extra: Iterable[Path] = ()) -> None:
    """InputError unless ``out`` is a place a report may be written (module docstring)."""
    out = Path(out)
    files, stores = owned_files(ledger, data)
    for f in [*files, *extra]:
        if same_file(out, f):
            what = "the ledger" if same_file(f, ledger) else f"a file the ledger names or kvgraft owns ({f})"
            raise InputError(f"-o {out} is {what}; a report never overwrites it", HINT)
    for s in stores:
        if inside(out, s):
            raise InputError(f"-o {out} is inside the store {s}; a report is never written there", HINT)
    if out.is_dir():
        raise InputError(f"-o {out} is a directory, expected a file name", HINT)
    if not out.parent.is_dir():
        raise InputError(f"-o {out}: folder {out.parent} does not exist or is not a folder", HINT)
    if out.exists() or out.is_symlink():
        try:
            with open(out, "rb") as fh:
                head = fh.read(len(MARKER))
        except OSError as e:
            raise InputError(f"-o {out}: cannot read the file there ({e.strerror or e})", HINT) from None
        if head != MARKER.encode():
            raise InputError(f"-o {out} exists and is not a kvgraft report; it is left as it is", HINT)
    if not os.access(out.parent, os.W_OK):
        raise InputError(f"-o {out}: folder {out.parent} is not writable", HINT)
