"""The ledger, first version: append-only JSON Lines, one RFC 8785 canonical entry a line, chained by hash.

Each entry carries ``seq`` (0-based line number), ``prev`` (SHA-256 of the previous line's bytes, without its
newline; null for the first), ``kind``, ``time`` and the run's input and output digests. Appends hold an exclusive
file lock, write one whole line with a single ``write`` on an ``O_APPEND`` descriptor and fsync it. A torn last line
(a writer killed mid-line) stops further appends instead of being silently continued.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckFailed, LedgerError
from ..util import jsonio
from ..util.fsio import fsync_dir
from ..util.hashing import canonical_json, sha256_bytes

if TYPE_CHECKING:
    from filelock import BaseFileLock

TAIL_READ = 1 << 16


LOCK_TIMEOUT = 120.0


class _Lock:
    """The append lock: an exclusive advisory lock (``flock``) on the ledger file itself, so appenders in any number
    of processes serialize and no ``.lock`` file is left beside the ledger. Opening it creates the ledger if it does
    not exist yet (an append is about to); a ledger whose first append then fails is the empty ledger, never a
    missing line. Where ``fcntl`` is missing (Windows) it is a ``filelock`` lock on ``<ledger>.lock``."""

    def __init__(self, path: Path, timeout: float = LOCK_TIMEOUT):
        self.path, self.timeout = Path(path), timeout
        self._fd: int | None = None
        self._fallback: BaseFileLock | None = None

    def __enter__(self) -> _Lock:
        try:
            import fcntl
        except ImportError:  # pragma: no cover (Windows)
            from filelock import FileLock

            self._fallback = FileLock(str(self.path) + ".lock", timeout=self.timeout)
            self._fallback.acquire()
            return self
        import time

        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise LedgerError(
                f"cannot open ledger {self.path}: {os.strerror(e.errno) if e.errno else e}",
                "check that the ledger path is a writable file",
            ) from None
        try:
            deadline = time.monotonic() + self.timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise LedgerError(
                            f"{self.path}: another process has held the ledger's append lock for {self.timeout:.0f} s",
                            "wait for it to finish, or look for a stuck kvgraft process",
                        ) from None
                    time.sleep(0.02)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fallback is not None:  # pragma: no cover (Windows)
            self._fallback.release()
            return
        if self._fd is not None:
            import fcntl

            try:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None


def _lock(path: Path) -> _Lock:
    return _Lock(path)


def _last_line(path: Path) -> tuple[int, bytes | None]:
    """(number of lines, bytes of the last line) of a ledger; raises LedgerError on a torn tail."""
    size = path.stat().st_size if path.exists() else 0
    if size == 0:
        return 0, None
    with open(path, "rb") as f:
        f.seek(max(0, size - 1))
        if f.read(1) != b"\n":
            raise LedgerError(
                f"{path}: the last line is torn (no newline at the end: a writer was interrupted)",
                f"nothing is appended after a torn line; `kvgraft ledger repair {path}` removes the partial line "
                "(only the bytes after the last newline), then run again",
            )
        # Read backwards until the newline before the last line.
        pos, tail = size, b""
        while pos > 0 and tail.count(b"\n") < 2:
            step = min(TAIL_READ, pos)
            pos -= step
            f.seek(pos)
            tail = f.read(step) + tail
        last = tail[:-1].rsplit(b"\n", 1)[-1]
    try:
        seq = jsonio.loads(last)["seq"]
    except (ValueError, KeyError, TypeError):
        raise LedgerError(f"{path}: the last line is not a ledger entry", "is this file a kvgraft ledger?") from None
    return seq + 1, last


def check_appendable(path: Path) -> None:
    """Raise LedgerError now if an append would be refused later (torn tail, not a ledger, not writable)."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise LedgerError(f"ledger path {path} is not a file")
    _last_line(path)
    if path.exists() and not os.access(path, os.W_OK):
        raise LedgerError(f"ledger {path} is not writable")


def without_floats(value: Any) -> Any:
    """The value with every non-integer number written as a string (Python repr: shortest round trip).

    Ledger entries hold no JSON floats, so their RFC 8785 form is what any JSON library prints with sorted keys
    and compact separators: a verifier needs no ECMAScript number formatting (docs/LEDGER.md).
    """
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, dict):
        return {k: without_floats(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [without_floats(v) for v in value]
    return value


def append(
    path: Path,
    kind: str,
    body: dict[str, Any],
    finalize: Callable[[dict[str, Any]], None] | None = None,
    after: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Append one entry (``body`` plus seq, prev, kind, time) and return it as written.

    ``finalize`` runs under the append lock just before the line is written and may set fields that depend on what
    earlier lines recorded (a deposit's ``deposited``/``existing``); ``after`` runs under the same lock once the line
    is written (a deposit notes the artifact as recorded): no other appender runs in between."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _lock(path):
        n, last = _last_line(path)
        if finalize is not None:
            finalize(body)
        entry = without_floats(body)
        entry.update(
            seq=n,
            prev=sha256_bytes(last) if last is not None else None,
            kind=kind,
            time=datetime.now(UTC).isoformat(timespec="microseconds"),
        )
        line = canonical_json(entry) + b"\n"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                written = os.write(fd, line)
                if written != len(line):
                    raise LedgerError(
                        f"{path}: short write ({written} of {len(line)} bytes)",
                        f"the last line is now torn: `kvgraft ledger repair {path}` removes it",
                    )
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise LedgerError(
                f"cannot append to ledger {path}: {os.strerror(e.errno) if e.errno else e}",
                "check free space and permissions; if a partial line was written, "
                f"`kvgraft ledger repair {path}` removes it",
            ) from e
        if n == 0:
            fsync_dir(path.parent)
        if after is not None:
            after(entry)
    return entry


def split_lines(data: bytes) -> tuple[list[bytes], bytes]:
    """(complete lines without their newline, torn tail: the bytes after the last newline, usually b"")."""
    *lines, tail = data.split(b"\n")
    return lines, tail


def read(path: Path) -> list[dict[str, Any]]:
    """All complete entries of a ledger (no verification: that is `kvgraft verify`)."""
    path = Path(path)
    if not path.exists():
        return []
    lines, _ = split_lines(path.read_bytes())
    return [_entry(line, path, i) for i, line in enumerate(lines)]


def _entry(line: bytes, path: Path, index: int) -> dict[str, Any]:
    """One complete line as an entry, or LedgerError naming it (1-based) and pointing to `kvgraft verify`."""
    try:
        entry = jsonio.loads(line)
    except ValueError as e:
        entry, why = None, str(e)[:120]
    else:
        why = "not a JSON object"
    if not isinstance(entry, dict):
        raise LedgerError(f"{path}: line {index + 1} is not a ledger entry ({why})", f"run `kvgraft verify {path}`")
    return entry


def repair(path: Path) -> int:
    """Remove a torn tail (the bytes after the last newline) and nothing else; returns how many bytes were removed.

    Holds the append lock, so it never races a writer. Complete lines are never touched, even invalid ones:
    those are for `kvgraft verify` to report, not for a repair to hide.
    """
    path = Path(path)
    if not path.is_file():
        raise LedgerError(f"ledger not found: {path}")
    with _lock(path):
        data = path.read_bytes()
        lines, tail = split_lines(data)
        if not tail:
            return 0
        keep = len(data) - len(tail)
        with open(path, "r+b") as f:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
        return len(tail)


def appended_since(base_lines: list[bytes], lines: list[bytes]) -> list[dict[str, Any]]:
    """The entries after the base's lines, when the ledger is an append to the base (else CheckFailed)."""
    if len(base_lines) > len(lines) or any(a != b for a, b in zip(base_lines, lines)):
        first = next((i for i, (a, b) in enumerate(zip(base_lines, lines)) if a != b), len(lines))
        raise CheckFailed(
            f"not an append: line {first + 1} of the base is changed or missing in the ledger",
            "the ledger was rewritten; restore it from the base and append instead",
        )
    return [_entry(raw, Path("ledger"), i) for i, raw in enumerate(lines) if i >= len(base_lines)]
