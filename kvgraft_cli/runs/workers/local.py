"""Run one job in a fresh Python process and collect its structured results.

The parent starts ``python -m kvgraft_cli.runs.workers.local`` with a clean environment (no bit-changing kernel
flags: the job pins its own), writes one JSON request on the child's stdin and reads JSON lines from its stdout:

- ``{"record": {...}}`` for each result, as it is produced (the parent shows progress);
- ``{"done": true}`` at the end; or
- ``{"error": {"type": ..., "message": ..., "hint": ..., "exit_code": ...}}`` when the job raised.

A job's :class:`KvgraftError` comes back as the same class with the same message and hint, so a worker's bad input
(no GPU for ``--device cuda``) is the user's bad input. A child that dies without a last message (a crash, out of
memory) is reported with its exit status and the end of its stderr, which is kept for that alone.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from ... import errors
from ...config.profiles import environ_without_pins
from ...errors import KvgraftError

# Jobs a worker may run: name -> "module:function". The function takes the request's "args" as keyword arguments
# and an ``emit(record: dict)`` callback, and returns nothing.
JOBS = {
    "matrix-profile": "kvgraft_cli.runs.matrix:profile_job",
}


def error_record(exc: BaseException) -> dict[str, Any]:
    """An exception as the structured error a worker reports."""
    if isinstance(exc, KvgraftError):
        return {"type": type(exc).__name__, "message": exc.message, "hint": exc.hint, "exit_code": exc.exit_code}
    return {"type": "internal", "message": f"{type(exc).__name__}: {exc}", "hint": None, "exit_code": 1}


def error_from_record(rec: dict[str, Any], where: str) -> KvgraftError:
    """The parent's exception for a worker's error record: the same KvgraftError class when it is one of ours."""
    cls = getattr(errors, str(rec.get("type")), None)
    message = f"{where}: {str(rec.get('message', '')).rstrip('.')}"
    if isinstance(cls, type) and issubclass(cls, KvgraftError) and cls is not KvgraftError:
        return cls(message, rec.get("hint"))
    err = KvgraftError(
        message if rec.get("type") != "internal" else f"{where}: internal error: {rec.get('message')}", rec.get("hint")
    )
    err.exit_code = int(rec.get("exit_code") or 1)
    return err


def run_job(job: str, args: dict[str, Any], on_record: Callable[[dict], None], where: str) -> list[dict]:
    """Run ``job`` in a child process; return its records (``on_record`` sees each as it arrives)."""
    if job not in JOBS:
        raise ValueError(f"unknown worker job {job!r}")
    request = json.dumps({"job": job, "args": args})
    records: list[dict] = []
    final: dict | None = None
    debug = os.environ.get("KVGRAFT_DEBUG") == "1"  # then the worker's tracebacks go straight to the terminal
    with tempfile.TemporaryFile("w+") as errfile:  # a file, not a pipe: a chatty child cannot block on it
        with subprocess.Popen(
            [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None if debug else errfile,
            text=True,
            env=environ_without_pins(),
        ) as proc:
            try:
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(request)
                proc.stdin.close()
                for line in proc.stdout:
                    msg = _parse(line, where)
                    if msg is None:
                        continue
                    if "record" in msg:
                        records.append(msg["record"])
                        on_record(msg["record"])
                    else:
                        final = msg
            except BaseException:
                proc.kill()  # never leave a worker running behind an error or Ctrl-C
                raise
        if final is not None and "error" in final:
            raise error_from_record(final["error"], where)
        if final is None or not final.get("done") or proc.returncode != 0:
            errfile.seek(0)
            tail = errfile.read().strip().splitlines()[-3:]
            raise KvgraftError(
                f"{where}: the worker process ended without a result (exit status {proc.returncode})"
                + (f"; its stderr ended with: {' | '.join(tail)[:500]}" if tail else ""),
                "re-run with KVGRAFT_DEBUG=1 for the worker's traceback",
            )
    return records


def _parse(line: str, where: str) -> dict | None:
    line = line.strip()
    if not line:
        return None
    try:
        msg = json.loads(line)
    except ValueError:
        raise KvgraftError(f"{where}: the worker wrote a line that is not a JSON message: {line[:200]!r}") from None
    if not isinstance(msg, dict) or not ({"record", "done", "error"} & set(msg)):
        raise KvgraftError(f"{where}: the worker wrote an unknown message: {line[:200]!r}")
    return msg


def _child() -> int:
    """The worker side: read the request, run the job, report records and the outcome on stdout."""
    import traceback

    out = sys.stdout

    def send(msg: dict) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    try:
        request = json.loads(sys.stdin.read())
        module, _, func = JOBS[request["job"]].partition(":")
        fn = getattr(importlib.import_module(module), func)
        fn(**request["args"], emit=lambda record: send({"record": record}))
    except BaseException as e:  # noqa: BLE001  (every outcome is reported as a message)
        if os.environ.get("KVGRAFT_DEBUG") == "1" or not isinstance(e, KvgraftError):
            traceback.print_exc()
        send({"error": error_record(e)})
        return 1
    send({"done": True})
    return 0


if __name__ == "__main__":
    sys.exit(_child())
