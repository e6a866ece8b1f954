"""How bench_peers talks to its workers: one JSON object a line, a request on the worker's stdin, a reply on its
stdout. Each system runs in a process of its own (kvgraft's kernel flags must be set before torch is imported, and
llama.cpp's threads must not share a process with torch's), kept alive across lengths so a model loads once; the
parent asks one worker at a time, so the two never compete for the cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from typing import Any


def serve(handlers: dict[str, Callable[..., dict]]) -> None:
    """The worker's loop: read a request ({"op": NAME, ...args}), reply {"ok": true, ...result} or {"ok": false,
    "error": ...}, until stdin closes. The protocol keeps the real stdout; file descriptor 1 is pointed at stderr
    first, so whatever a C library prints (llama.cpp's logs, oneDNN's verbose lines) cannot break a reply."""
    wire = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        op = req.pop("op")
        try:
            reply = {"ok": True, **handlers[op](**req)}
        except Exception as e:  # reported to the parent, which stops the run and shows it
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        wire.write(json.dumps(reply) + "\n")


class Worker:
    """A worker process as the parent sees it: ``call(op, **args)`` returns its reply or raises with its error."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None, log=None):
        self.name = name
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log or sys.stderr, text=True, env=env, bufsize=1
        )

    def call(self, op: str, **args: Any) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: worker exited ({self.proc.wait()}) during {op}")
        reply = json.loads(line)
        if not reply.pop("ok"):
            raise RuntimeError(f"{self.name}: {op} failed: {reply['error']}\n{reply.get('trace', '')}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
