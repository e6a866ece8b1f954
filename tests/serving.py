"""Start `kvgraft serve` as a user does (a process of its own, on a loopback port) and talk to it with plain HTTP.

The official ``openai`` client is used by the tests themselves; this module holds what several tests share: the
process, waiting for its "listening on" line, a stop that ends it and its children, and a small HTTP client on
http.client (no library between the test and the bytes on the wire).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from conftest import environ_without_pins

READY_S = 180  # a loaded machine takes long to import torch and load a model


@dataclass
class Served:
    """A running `kvgraft serve` process and its address."""

    proc: subprocess.Popen
    url: str
    folder: Path
    stderr: list[str] = field(default_factory=list)

    def said(self, text: str, timeout: float = 30) -> bool:
        """Whether the server's stderr holds a line containing ``text``, waiting up to ``timeout`` seconds for it:
        the server writes its start line before its address, but the thread that collects stderr may read it after
        :func:`start` has returned (a check made at once was red in one CI run)."""
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.stderr):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def base(self) -> str:
        return self.url + "/v1"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Send ``sig`` and wait for the process to end; returns its exit code (killed if it does not end)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def request(
        self, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None
    ) -> tuple[int, dict, bytes]:
        """One plain HTTP request: (status, headers, body bytes)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        try:
            data = json.dumps(body).encode() if isinstance(body, dict) else body
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def post(self, path: str, body: bytes | dict) -> tuple[int, dict]:
        status, _, data = self.request("POST", path, body)
        return status, json.loads(data)


def start(folder: Path, *args: str, env: dict | None = None) -> Served:
    """`python -m kvgraft_cli serve ARGS --port 0` in ``folder``; returns once it prints its address."""
    full_env = environ_without_pins()
    full_env.pop("KVGRAFT_DEBUG", None)
    full_env.update(env or {})
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvgraft_cli", "serve", "--port", "0", *args],
        cwd=folder,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a signal to the test's process group does not reach it
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr or []), daemon=True).start()
    deadline = time.monotonic() + READY_S
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("listening on "):
            served = Served(proc, line.split()[-1], folder, lines)
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
            return served
        if not line and proc.poll() is not None:
            break
    proc.kill()
    proc.wait(10)
    time.sleep(0.2)
    raise AssertionError(f"kvgraft serve did not start (rc={proc.returncode}):\n{''.join(lines)}")


def ledger_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()] if Path(path).exists() else []


def chat(question: str, system: str | None = None, **extra) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return {"messages": messages, **extra}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True
