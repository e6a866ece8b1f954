"""Run `python -m kvgraft_cli ...` in a process forked from one that has already imported torch and transformers.

Why: a fresh engine command spends about 3 s of CPU importing torch, transformers' lazy-import table and
torch._dynamo (transformers' masking utilities import it) before it computes anything, and the suite starts a few
hundred of them (docs/TESTING.md). A child forked from a warm "zygote" skips those imports and nothing else: it is
still its own process, with the test's argv, working directory, environment, stdin/stdout/stderr and exit status, and
it imports kvgraft itself afresh, so kvgraft's import-time reads of the environment see the test's values.

What a fork cannot reproduce, and how this keeps it out:
- Kernel flags read when torch is imported (``KNOWN_BIT_ENV``: ``ATEN_CPU_CAPABILITY``, ``MKL_CBWR``, ...). A zygote
  imports torch under one set of pins. The child wraps ``determinism.apply_environment``: the first time the command
  applies a manifest's pins, if they differ from its zygote's, the child stops there and the command is run again in
  a zygote started under those pins (what it did before, such as making its store folder, it does again). When they
  agree, the child sets them as a fresh process would have before its torch import, so the command sees no drift.
- A command that asks for torch before it applies its pins: a fresh process reports that as drift. Until the first
  application the child notes every import of a module the zygote's torch imports brought in (from torch,
  transformers, safetensors, ...); after one, the pins are applied as they are, and the same drift is reported.
- Whether torch (or numpy) is loaded at all: kvgraft reads that in two places (a score's ledger line records torch's
  version only when it is loaded; verify's unshuffle takes numpy's path when numpy is), so conftest.run_cli forks
  only the commands that load torch, and ``fresh=True`` keeps a call fresh.
- Variables read once at interpreter start or by torch/transformers at import (``PYTHONHASHSEED``, ``LC_ALL``,
  ``OMP_NUM_THREADS``, ``HF_*``, ...): :func:`forkable` says no when a test sets any variable outside a short list that
  only kvgraft reads at run time, and the caller then starts a fresh process. The zygote itself starts from the test
  process's environment without pins, never from one test's variables.
- Left as they are: the children of one zygote share its string-hash seed (two fresh runs have two), so a test that
  compares two forked runs would not see an order that depends on it; and the call returns when the child exits,
  where subprocess.run also waits until every process holding its output pipes has closed them.

tests/test_forkserver.py checks a forked child against a fresh interpreter: what it sees (argv, sys.path,
environment, descriptors, streams, flags, signal dispositions, thread and atexit order, exit status), the drift of
torch imported first, and a deposit's output, objects and ledger lines.

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
# What the zygote imports: the libraries every engine command loads, not kvgraft itself. First those that do not load
# torch (`import transformers` alone does not: its table is lazy), then those that do; what the second set brings in
# from the packages below is what a command must not ask for before it applies its pins. (The standard library and
# other dependencies the second set also brings in load no torch.)
TORCH_FREE_IMPORTS = (
    "numpy", "yaml", "jsonschema", "zstandard", "typer", "rich.console", "safetensors", "tokenizers", "transformers",
)  # fmt: skip
TORCH_PACKAGES = frozenset({"torch", "functorch", "torchgen", "transformers", "safetensors", "accelerate"})
WARM_IMPORTS = (
    "torch",
    "transformers",
    "transformers.masking_utils",
    "transformers.models.llama.modeling_llama",
    "safetensors.torch",
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
        # A session of its own: close() can end the zygote, its waiters and their commands at once (killpg).
        self.proc = subprocess.Popen(
            [sys.executable, __file__, self.path, json.dumps(pins)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=self.folder,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 180)
        line = self.proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            self.close()
            raise RuntimeError(f"the zygote did not start within 180 s: {line!r}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(
        self, argv: list[str], cwd: Path, env: dict[str, str], timeout: float
    ) -> tuple[int, bytes, bytes, dict | None]:
        """Run ARGV (``python -m MODULE ...``) in a forked child: (exit status, stdout, stderr, pins it asked for or
        None). Whatever interrupts the wait (a timeout, Ctrl-C, a failed test) kills the child, as subprocess.run does."""
        with (
            open(os.devnull, "rb") as stdin,
            tempfile.TemporaryFile() as out,
            tempfile.TemporaryFile() as err,
            socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn,
        ):
            pins_out = os.path.join(self.folder, f"pins-{os.getpid()}-{threading.get_ident()}.json")
            conn.connect(self.path)
            request = {"argv": argv, "cwd": str(cwd), "env": env, "pins_out": pins_out}
            socket.send_fds(conn, [json.dumps(request).encode()], [stdin.fileno(), out.fileno(), err.fileno()])
            conn.settimeout(timeout)
            pid = json.loads(_message(conn, "pid"))["pid"]
            try:
                status = json.loads(_message(conn, "exit status"))["status"]
            except BaseException as e:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                if isinstance(e, TimeoutError):
                    raise subprocess.TimeoutExpired(argv, timeout) from None
                raise
            out.seek(0)
            err.seek(0)
            asked = None
            if os.path.exists(pins_out):
                with open(pins_out, encoding="utf-8") as f:
                    asked = json.load(f)
                os.unlink(pins_out)
            return os.waitstatus_to_exitcode(status), out.read(), err.read(), asked

    def close(self) -> None:
        """End the zygote: it waits up to 10 s for the commands still running, then ends them and itself."""
        if self.alive():
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # the zygote leaves on end of input
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


def _message(conn: socket.socket, what: str) -> bytes:
    data = conn.recv(1 << 16)
    if not data:
        raise RuntimeError(f"the zygote's waiter ended before it sent the command's {what}")
    return data


_ZYGOTES: dict[str, Zygote] = {}
_ZYGOTES_LOCK = threading.Lock()  # tests that run commands from several threads at once start one zygote, not two


def _zygote(pins: dict[str, str | None]) -> Zygote:
    """The zygote for these pins, started (from this process's environment without pins) if none is alive."""
    key = json.dumps(pins, sort_keys=True)
    with _ZYGOTES_LOCK:
        if key in _ZYGOTES and not _ZYGOTES[key].alive():
            _ZYGOTES.pop(key).close()  # it died (killed by a test, or the machine): start another
        if key not in _ZYGOTES:
            if not _ZYGOTES:
                atexit.register(lambda: [z.close() for z in _ZYGOTES.values()])
            _ZYGOTES[key] = Zygote(pins, {k: v for k, v in os.environ.items() if k not in pins})
        return _ZYGOTES[key]


def _text(data: bytes) -> str:
    # As subprocess.run(text=True) decodes: the locale's encoding, universal newlines.
    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


def run_forked(
    args: list[str],
    cwd: Path,
    env: dict[str, str],
    pins: dict[str, str | None],
    timeout: float = 600,
    module: str = "kvgraft_cli",
) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` in a child of the zygote for ``pins`` (or of the one its manifest asks for)."""
    argv = [sys.executable, "-m", module, *args]
    rc, out, err, asked = _zygote(pins).run(argv, cwd, env, timeout)
    if asked is not None:
        # The command pinned other kernel flags before loading torch: run it where torch was imported under them.
        # (What it did before it applied them, such as making its store folder, it does again there.)
        rc, out, err, again = _zygote(asked).run(argv, cwd, env, timeout)
        assert again is None, f"the zygote for {asked} asked for {again}"
    done = subprocess.CompletedProcess(argv, rc, _text(out), _text(err))
    done.forked_under = asked or pins  # type: ignore[attr-defined]  # the pins of the zygote that ran it
    return done


# ---- the zygote process ---------------------------------------------------------------------------------------------

# Filled in the zygote: the modules its torch-dependent imports brought in. A command that imports one of them before
# it applies its pins would, in a fresh process, have loaded torch before the pins (drift the command must report).
_WARM_WITH_TORCH: frozenset[str] = frozenset()


def _child(request: dict, fds: list[int], pins: dict[str, str | None]) -> None:
    """In the forked child: become `python -m MODULE ARGV` as a fresh interpreter would be; never returns."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        module = request["argv"][2]
        sys.argv = ["-m", *request["argv"][3:]]  # runpy sets argv[0] to the module's file, as `python -m` does
        sys.path[0] = os.getcwd()  # what `python -m` puts first
        _guard_pins(pins, request["pins_out"])
        import runpy

        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
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


def _track_imports(names: frozenset[str]):  # type: ignore[no-untyped-def]
    """Note any import of one of ``names`` (statements and importlib.import_module) until the returned stop() is
    called; stop() restores both and says whether one was asked for."""
    import builtins
    import importlib

    real_import, real_import_module = builtins.__import__, importlib.import_module
    seen = [False]

    def note(name: str, fromlist=()) -> None:  # type: ignore[no-untyped-def]
        if name in names or any(isinstance(f, str) and f"{name}.{f}" in names for f in fromlist or ()):
            seen[0] = True

    def tracking_import(name, globals=None, locals=None, fromlist=(), level=0):  # type: ignore[no-untyped-def]
        if level == 0:
            note(name, fromlist)
        return real_import(name, globals, locals, fromlist, level)

    def tracking_import_module(name, package=None):  # type: ignore[no-untyped-def]
        if not name.startswith("."):
            note(name)
        return real_import_module(name, package)

    builtins.__import__ = tracking_import
    importlib.import_module = tracking_import_module

    def stop() -> bool:
        builtins.__import__, importlib.import_module = real_import, real_import_module
        return seen[0]

    return stop


def _guard_pins(pins: dict[str, str | None], pins_out: str) -> None:
    """Make the first application of a manifest's pins behave as in a fresh process, or hand the command back."""
    from kvgraft_cli.config.kernels import check_capability
    from kvgraft_cli.config.profiles import KNOWN_BIT_ENV
    from kvgraft_cli.engine import determinism

    original = determinism.apply_environment
    first = [True]
    stop_tracking = _track_imports(_WARM_WITH_TORCH)

    def apply_environment(pinned_env, device="cpu"):  # type: ignore[no-untyped-def]
        if first[0]:
            first[0] = False
            if stop_tracking():
                # The command asked for torch (or what loads it) before its pins: a fresh process would have imported
                # torch already, and the real function reports that drift here as it would there.
                return original(pinned_env, device)
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
    global _WARM_WITH_TORCH
    import gc
    import importlib

    for name in TORCH_FREE_IMPORTS:
        importlib.import_module(name)
    before = set(sys.modules)
    assert "torch" not in before, "a torch-free import loaded torch"
    for name in WARM_IMPORTS:
        importlib.import_module(name)
    _WARM_WITH_TORCH = frozenset(m for m in set(sys.modules) - before if m.split(".")[0] in TORCH_PACKAGES)
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
            _leave(path)
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


def _leave(path: str) -> None:
    """The test process is done or gone: wait up to 10 s for the commands still running (so their CPU is counted),
    then end what is left and this process (the zygote leads its own process group)."""
    import shutil
    import time

    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    deadline = time.monotonic() + 10
    try:
        while time.monotonic() < deadline:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.05)
    except ChildProcessError:
        os._exit(0)  # none left
    os.killpg(0, signal.SIGKILL)


if __name__ == "__main__":
    # Started by Zygote: argv = socket path, pins (JSON). Nothing on stdout but "ready".
    _serve(sys.argv[1], json.loads(sys.argv[2]))
