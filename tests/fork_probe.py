"""`python -m fork_probe MODE`, run fresh or forked by tests/forkserver.py, prints what a process can see of how it
was started, for tests/test_forkserver.py to compare.

- ``state``: argv, sys.path, environment, working folder, open descriptors, standard streams, interpreter flags,
  signal dispositions, ``__main__``; then a non-daemon thread and an atexit handler each print a line, and it exits 3.
- ``torch-first`` / ``pins-first``: imports torch before or after applying the portable profile's pins with kvgraft's
  own function, and prints the drift it reports (a fresh process reports torch imported first; a fork must too).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time


def _state() -> dict:
    fds = sorted(int(f) for f in os.listdir("/proc/self/fd"))
    import click.utils

    return {
        "argv": sys.argv,
        "path": sys.path,
        "environ": dict(os.environ),
        "cwd": os.getcwd(),
        "fds": fds,
        "stdin": os.readlink("/proc/self/fd/0"),
        "streams": [sys.stdout.encoding, sys.stderr.encoding, sys.stdout.line_buffering, sys.stdin.encoding],
        "flags": list(sys.flags),
        "signals": {n: repr(signal.getsignal(getattr(signal, n))) for n in ("SIGINT", "SIGTERM", "SIGPIPE", "SIGCHLD")},
        "main": [__name__, __spec__.name if __spec__ else None],
        "prog": click.utils._detect_program_name(),
    }


def main() -> None:
    mode = sys.argv[1]
    if mode == "state":
        print(json.dumps(_state(), sort_keys=True), flush=True)
        atexit.register(lambda: print("atexit", flush=True))
        threading.Thread(target=lambda: (time.sleep(0.2), print("thread", flush=True))).start()
        sys.exit(3)
    from kvgraft_cli.config.profiles import profile_env

    if mode == "torch-first":
        import torch  # noqa: F401
    from kvgraft_cli.engine import determinism

    drift = determinism.apply_environment(profile_env("portable"))
    print(json.dumps(sorted(d["field"] for d in drift.items)))


if __name__ == "__main__":
    main()
