"""The files kvgraft owns, which no output option may overwrite, `--force` or not (issue #24, items 6, 7 and 9).

An output option (`store export -o`, `solve --outputs`, `score --records`, `ledger checkpoint -o`, `prereg make -o`,
`manifest init -o`) names a file kvgraft writes for the user. `--force` lets it replace an earlier *outputs* file; it never lets it
replace the ledger (or its lock file), the store's index or objects, the manifest, or an input of the same run (the
problems file): those are refused before any work, exit 2, with nothing written. So is an output that cannot be
created where it is named (a bundle's missing folder, a file where a folder must be): one `Error:` line, never an
internal error.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InputError
from ..util.fsio import inside, same_file

if TYPE_CHECKING:
    from .context import RunContext


def owner_of(
    path: Path, ctx: RunContext | None = None, ledger: Path | None = None, reads: dict[str, Path] | None = None
) -> str | None:
    """What kvgraft file ``path`` is (``"the ledger"``, ``"the store ..."``, an input's name), or None when it is
    none of them. ``ctx`` gives the ledger, store and manifest; ``ledger`` a ledger without a context."""
    path = Path(path)
    ledgers = [p for p in (ledger, ctx.ledger if ctx is not None else None) if p is not None]
    for led in ledgers:
        led = Path(led)
        if same_file(path, led):
            return f"the ledger {led}"
        if same_file(path, led.with_name(led.name + ".lock")):
            return f"the ledger's lock file {led}.lock"
    if ctx is not None:
        # The store's own files; its scores/ and replay/ folders hold records kvgraft writes for the user.
        store = Path(ctx.store)
        if (
            inside(path, store / "objects")
            or same_file(path, store / "remote.json")
            or (inside(path.parent, store) and path.name.startswith("index.sqlite"))
        ):  # and -wal, -shm, -journal
            return f"the store {store} (its index and objects)"
        source = ctx.manifest.source
        if not source.startswith("builtin:") and same_file(path, Path(source)):
            return f"the manifest {source}"
    for name, p in (reads or {}).items():
        if same_file(path, Path(p)):
            return f"{name} {p}"
    return None


def check_output(
    path: Path,
    option: str,
    ctx: RunContext | None = None,
    ledger: Path | None = None,
    reads: dict[str, Path] | None = None,
    folder_must_exist: bool = False,
) -> None:
    """Refuse an output ``path`` (given as ``option``) that is a file kvgraft owns (:func:`owner_of`), whatever
    ``--force`` says, or whose folder is a file (and, with ``folder_must_exist``, a folder that does not exist: for
    writers that do not create it, as util.fsio.atomic_write_bytes does). Call it before any work."""
    path = Path(path)
    owner = owner_of(path, ctx, ledger, reads)
    if owner is not None:
        raise InputError(
            f"{option} {path} is {owner}; it would be overwritten",
            "write the output elsewhere (--force replaces an earlier output file, never a file kvgraft keeps)",
        )
    # The nearest existing ancestor must be a folder (else creating the path fails); the folder itself must exist
    # for writers that do not create one.
    parent = path.parent
    while not parent.exists() and parent != parent.parent and not folder_must_exist:
        parent = parent.parent
    if not parent.exists():
        raise InputError(
            f"{option} {path}: folder {path.parent} does not exist",
            "create the folder first, or write the output elsewhere",
        )
    if not parent.is_dir():
        raise InputError(f"{option} {path}: {parent} is not a folder", "write the output elsewhere")


def check_manifest_output(path: Path, model: str) -> None:
    """`manifest init -o`, before the model is read: refuse, ``--force`` or not, the files a run under the new
    manifest keeps in this folder (its default ledger and lock file, anything in its default store) and the model it
    names (the .gguf file itself, or any file inside a model folder: a config.json written over would change the
    model it pins)."""
    from ..config.manifest import DEFAULT_PATHS

    path = Path(path)
    check_output(path, "--output", ledger=Path(DEFAULT_PATHS["ledger"]))
    store = Path(DEFAULT_PATHS["store"])
    if inside(path, store):
        raise InputError(
            f"--output {path} is inside the store {store}; it would be overwritten", "write the manifest elsewhere"
        )
    if ":" in model and not Path(model).exists():  # builtin:NAME, package:DIST: nothing of the user's to overwrite
        return
    source = Path(model)
    if same_file(path, source) or (source.is_dir() and inside(path, source)):
        where = "inside the model folder" if source.is_dir() else "the model"
        raise InputError(f"--output {path} is {where} {model}; it would be overwritten", "write the manifest elsewhere")
