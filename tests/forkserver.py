"""Run `python -m kvgraft_cli ...` in a process forked from one that has already imported torch and transformers.

Why: a fresh engine command spends about 3 s of CPU importing torch, transformers' lazy-import table and
torch._dynamo (transformers' masking utilities import it) before it computes anything, and the suite starts a few
hundred of them (docs/TESTING.md). A child forked from a warm "zygote" skips those imports and nothing else: it is
still its own process, with the test's argv, working directory, environment, stdin/stdout/stderr and exit status, and
it imports kvgraft itself afresh, so kvgraft's import-time reads of the environment see the test's values.

What a fork cannot reproduce, and how this keeps it out:
- Kernel flags read when torch is imported (``KNOWN_BIT_ENV``: ``ATEN_CPU_CAPABILITY``, ``MKL_CBWR``, ...). A zygote
  imports torch under one set of pins. The child wraps ``determinism.apply_environment``: the first time the command
  applies a manifest's pins, if they differ from its zygote's, the child stops before anything else runs and the
  command is run again in a zygote started under those pins. When they agree, the child sets them as a fresh process
  would have before its torch import, so the command sees no drift.
- Variables read once at interpreter start or by torch/transformers at import (``PYTHONHASHSEED``, ``LC_ALL``,
  ``OMP_NUM_THREADS``, ``HF_*``, ...): :func:`forkable` says no when a test sets any variable outside a short list that
  only kvgraft reads at run time, and the caller then starts a fresh process.
- Whether torch is imported at all: a command that must not load torch is checked with ``fresh=True``.

``KVGRAFT_TEST_FRESH=1`` turns the zygotes off for a whole run (every CLI call a fresh interpreter, as before).
"""

from __future__ import annotations

import atexit
import json
import locale
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# Variables a test may set for one command that are read only at run time (by kvgraft, or by the shell-outs it makes).
FORKABLE_ENV_PREFIXES = ("KVGRAFT_",)
FORKABLE_ENV = frozenset({"COLUMNS", "PATH", "XDG_CACHE_HOME"})
# What the zygote imports: the libraries every engine command loads, not kvgraft itself.
WARM_IMPORTS = (
    "torch",
    "transformers",
    "transformers.masking_utils",
    "transformers.models.llama.modeling_llama",
    "safetensors.torch",
    "numpy",
    "yaml",
    "jsonschema",
    "zstandard",
    "typer",
    "rich.console",
)


def forkable(env_overrides: dict[str, str] | None) -> bool:
    """Whether a command with these extra variables may run in a forked child (else: a fresh interpreter)."""
    if os.environ.get("KVGRAFT_TEST_FRESH") == "1":
        return False
    return all(k in FORKABLE_ENV or k.startswith(FORKABLE_ENV_PREFIXES) for k in env_overrides or {})


class Zygote:
    """One warm process, importing torch under one set of kernel pins; forks a child per command."""

    def __init__(self, pins: dict[str, str | None], base_env: dict[str, str]):
        self.pins = pins
        self.folder = tempfile.mkdtemp(prefix="kvgraft-zygote-")
        self.path = os.path.join(self.folder, "sock")
        env = {k: v for k, v in base_env.items() if k not in pins}
        env.update({k: v for k, v in pins.items() if v is not None})
        self.proc = subprocess.Popen(
            [sys.executable, __file__, self.path, json.dumps(pins)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=self.folder,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != b"ready":
            raise RuntimeError(f"the zygote did not start: {line!r}")

    def run(
        self, argv: list[str], cwd: Path, env: dict[str, str], timeout: float
    ) -> tuple[int, bytes, bytes, dict | None]:
        """Run ``python -m kvgraft_cli ARGV`` in a forked child: (exit status, stdout, stderr, pins it asked for or None)."""
        with (
            open(os.devnull, "rb") as stdin,
            tempfile.TemporaryFile() as out,
            tempfile.TemporaryFile() as err,
            socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn,
        ):
            pins_out = os.path.join(self.folder, f"pins-{os.getpid()}-{id(out)}.json")
            conn.connect(self.path)
            request = {"argv": argv, "cwd": str(cwd), "env": env, "pins_out": pins_out}
            socket.send_fds(conn, [json.dumps(request).encode()], [stdin.fileno(), out.fileno(), err.fileno()])
            conn.settimeout(timeout)
            pid = json.loads(conn.recv(1 << 16))["pid"]
            try:
                status = json.loads(conn.recv(1 << 16))["status"]
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(argv, timeout) from None
            out.seek(0)
            err.seek(0)
            asked = None
            if os.path.exists(pins_out):
                with open(pins_out, encoding="utf-8") as f:
                    asked = json.load(f)
                os.unlink(pins_out)
            return os.waitstatus_to_exitcode(status), out.read(), err.read(), asked

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # the zygote exits on end of input
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


_ZYGOTES: dict[str, Zygote] = {}
_ZYGOTES_LOCK = threading.Lock()  # tests that run commands from several threads at once start one zygote, not two


def _zygote(pins: dict[str, str | None], base_env: dict[str, str]) -> Zygote:
    key = json.dumps(pins, sort_keys=True)
    with _ZYGOTES_LOCK:
        if key not in _ZYGOTES:
            if not _ZYGOTES:
                atexit.register(lambda: [z.close() for z in _ZYGOTES.values()])
            _ZYGOTES[key] = Zygote(pins, base_env)
        return _ZYGOTES[key]


def _text(data: bytes) -> str:
    # As subprocess.run(text=True) decodes: the locale's encoding, universal newlines.
    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


def run_forked(
    args: list[str], cwd: Path, env: dict[str, str], pins: dict[str, str | None], timeout: float = 600
) -> subprocess.CompletedProcess:
    """`python -m kvgraft_cli ARGS` in a child of the zygote for ``pins`` (or of the one its manifest asks for)."""
    argv = [sys.executable, "-m", "kvgraft_cli", *args]
    rc, out, err, asked = _zygote(pins, env).run(argv, cwd, env, timeout)
    if asked is not None:
        # The command pinned other kernel flags before loading torch: run it where torch was imported under them.
        rc, out, err, again = _zygote(asked, env).run(argv, cwd, env, timeout)
        assert again is None, f"the zygote for {asked} asked for {again}"
    return subprocess.CompletedProcess(argv, rc, _text(out), _text(err))


# ---- the zygote process ---------------------------------------------------------------------------------------------


def _child(request: dict, fds: list[int], pins: dict[str, str | None]) -> None:
    """In the forked child: become `python -m kvgraft_cli ARGV` as a fresh interpreter would be; never returns."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["-m", *request["argv"][3:]]  # runpy sets argv[0] to the module's file, as `python -m` does
        sys.path[0] = os.getcwd()  # what `python -m` puts first
        _guard_pins(pins, request["pins_out"])
        import runpy

        try:
            runpy.run_module("kvgraft_cli", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001  (as the interpreter would: print it, exit 1)
            import traceback

            traceback.print_exc()
            code = 1

        threading._shutdown()  # type: ignore[attr-defined]  # the interpreter joins non-daemon threads, then atexit
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _guard_pins(pins: dict[str, str | None], pins_out: str) -> None:
    """Make the first application of a manifest's pins behave as in a fresh process, or hand the command back."""
    from kvgraft_cli.config.kernels import check_capability
    from kvgraft_cli.config.profiles import KNOWN_BIT_ENV
    from kvgraft_cli.engine import determinism

    original = determinism.apply_environment
    first = [True]

    def apply_environment(pinned_env, device="cpu"):  # type: ignore[no-untyped-def]
        if first[0]:
            first[0] = False
            check_capability(pinned_env, device)
            after = {n: pinned_env[n] if n in pinned_env else os.environ.get(n) for n in KNOWN_BIT_ENV}
            if after != pins:
                with open(pins_out, "w", encoding="utf-8") as f:
                    json.dump(after, f)
                os._exit(0)
            # A fresh process would set these before importing torch; torch here was imported under the same values.
            for name, value in pinned_env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        return original(pinned_env, device)

    determinism.apply_environment = apply_environment


def _serve(path: str, pins: dict[str, str | None]) -> None:
    import importlib

    for name in WARM_IMPORTS:
        importlib.import_module(name)
    import gc

    gc.collect()
    gc.freeze()  # keep the warm heap shared with the children (no copy-on-write from the collector)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(16)
    sys.stdout.buffer.write(b"ready\n")
    sys.stdout.flush()
    stdin = sys.stdin.buffer
    while True:
        # Reap finished waiters with waitpid (not SIGCHLD ignored): so their CPU, and their commands', counts in this
        # process's children and, once the test process waits for the zygote, in the suite's own figure.
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        ready, _, _ = select.select([server, stdin], [], [], 1.0)
        if stdin in ready and not os.read(stdin.fileno(), 1 << 10):
            # The test process is gone or done: wait for what still runs, so its CPU is counted, then leave.
            try:
                while True:
                    os.wait()
            except ChildProcessError:
                return
        if server not in ready:
            continue
        conn, _ = server.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        if os.fork() == 0:
            # The waiter: forks the command, reports its pid and then its exit status. Whatever happens (the test
            # process gone, say), it ends here and never returns into this loop.
            try:
                server.close()
                request = json.loads(message)
                pid = os.fork()
                if pid == 0:
                    conn.close()
                    _child(request, fds, pins)
                for fd in fds:
                    os.close(fd)
                conn.send(json.dumps({"pid": pid}).encode())
                _, status = os.waitpid(pid, 0)
                conn.send(json.dumps({"status": status}).encode())
            finally:
                os._exit(0)
        conn.close()
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    # Started by Zygote: argv = socket path, pins (JSON). Nothing on stdout but "ready".
    _serve(sys.argv[1], json.loads(sys.argv[2]))
