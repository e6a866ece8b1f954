"""The running writers of a store, as `kvgraft store gc` sees them (issue #24, item 12).

A deposit writes each object before its index row; gc deletes unindexed objects untouched for ``--grace`` seconds,
so a grace shorter than a running deposit (``--grace 0``) could delete an object between the two. A deposit
therefore registers while it writes: a file ``STORE/writers/<pid>-<random>`` that it holds an exclusive ``flock``
on, created (and so dated) when it starts. gc keeps every object younger than the oldest registered writer it finds
still holding its lock, whatever the grace; a file nobody holds is a writer that died, and gc removes it.

Where ``fcntl`` is missing (Windows) nothing registers and the grace alone applies.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

WRITERS = "writers"


@contextlib.contextmanager
def registered(root: Path) -> Iterator[None]:
    """Register a writer of the store at ``root`` for as long as the block runs (see the module docstring). A store
    where the file cannot be made (read-only) registers nothing: its writes fail on their own."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    folder = Path(root) / WRITERS
    name = f"{os.getpid()}-{secrets.token_hex(4)}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # Locked under a hidden name, then renamed (the lock stays with the file): gc never sees it unlocked.
        fd = os.open(folder / f".{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.replace(folder / f".{name}", folder / name)
        yield
    finally:
        for p in (folder / name, folder / f".{name}"):
            p.unlink(missing_ok=True)
        os.close(fd)


def oldest_running(root: Path) -> float | None:
    """When the oldest writer still running registered (its file's mtime, seconds since the epoch), or None when no
    writer runs. Files of writers that died (nobody holds their lock) are removed on the way."""
    try:
        import fcntl
    except ImportError:
        return None
    folder = Path(root) / WRITERS
    oldest = None
    for f in sorted(folder.iterdir()) if folder.is_dir() else []:
        if f.name.startswith("."):  # being registered: its writer has not written anything yet
            continue
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:  # gone meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: a running writer
            start = os.fstat(fd).st_mtime
            oldest = start if oldest is None else min(oldest, start)
        else:  # nobody holds it: left by a writer that died
            f.unlink(missing_ok=True)
        finally:
            os.close(fd)
    return oldest
