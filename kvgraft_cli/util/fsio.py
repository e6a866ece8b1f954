"""Crash-safe file writes: atomic replace (temporary file, fsync, rename) and directory fsync."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write_bytes(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file or the whole new one, never a part.

    Temporary file in the same directory, fsync, rename, fsync of the directory. ``mode`` defaults to what a plain
    open() would give (0666 less the umask); mkstemp's own 0600 would make shared files unreadable to others.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    if mode is None:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    try:
        os.chmod(tmp, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """fsync a directory so a rename inside it survives a crash (no-op where the OS does not allow it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def user_cache_dir() -> Path | None:
    """kvgraft's folder in the user's cache directory: ``$XDG_CACHE_HOME/kvgraft`` when that is an absolute path
    (the XDG Base Directory rule: a relative one is ignored), else ``~/.cache/kvgraft``; None without a home."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "kvgraft"
    try:
        return Path.home() / ".cache" / "kvgraft"
    except RuntimeError:  # no HOME and no passwd entry: run without a cache
        return None


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file: the same inode when both exist (hard and symbolic links included), else the
    same path once links are resolved. What an output check compares against the files kvgraft keeps."""
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    except OSError:
        pass
    return os.path.abspath(os.path.realpath(a)) == os.path.abspath(os.path.realpath(b))


def inside(path: Path, folder: Path) -> bool:
    """``path`` is ``folder`` or lies inside it, links resolved."""
    p, f = os.path.realpath(path), os.path.realpath(folder)
    return p == f or p.startswith(f.rstrip(os.sep) + os.sep)
