"""Start a server: load the engine, bind the socket, run uvicorn until SIGTERM or Ctrl-C, drain, close.

The socket is bound here (port 0 picks a free one) so the address printed is the one listening; uvicorn serves on
it. SIGTERM and Ctrl-C stop new connections, let every request in flight finish (its ledger line written) and
then end the engine's thread.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import InputError
from ..runs.context import RunContext
from .answer import Options, Server
from .app import DEFAULT_MAX_BODY


@dataclass
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    queue: int = 64
    max_body: int = DEFAULT_MAX_BODY
    drain_s: float = 60.0  # how long SIGTERM waits for requests in flight


def check_installed() -> None:
    """Refuse, before any model loads, when the ``serve`` extra is missing."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise InputError("kvgraft serve needs Starlette and uvicorn", "pip install 'kvgraft[serve]'") from None


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one); InputError naming the address when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise InputError(
            f"cannot listen on {host}:{port}: {e.strerror or e}", "pick another --port or --host"
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(
    ctx: RunContext,
    options: Options,
    settings: ServeSettings,
    on_ready: Callable[[Server, str], None] | None = None,
) -> None:
    """Load the engine, open the store, bind, and serve until stopped (see the module docstring)."""
    check_installed()
    from ..engine.engine import load_engine
    from ..ledger import log as ledger

    ledger.check_appendable(ctx.ledger)
    engine = load_engine(ctx.manifest, ctx.allow_drift)
    server = Server(ctx, engine, options)
    from .worker import Worker

    worker = Worker(server, settings.queue)
    worker.start()  # opens the store in the engine's thread (refusals come out here)
    sock = bind(settings.host, settings.port)
    try:
        import uvicorn

        from .app import create_app

        app = create_app(worker, settings.max_body)
        host, port = sock.getsockname()[:2]
        url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        config = uvicorn.Config(
            app,
            log_level="warning",
            timeout_graceful_shutdown=int(settings.drain_s),
            lifespan="on",
            access_log=False,
        )
        userver = uvicorn.Server(config)
        if on_ready is not None:
            on_ready(server, url)
        # uvicorn drains on SIGTERM, then raises the signal again under the handler it found: this one, so a
        # drained server exits 0 (Ctrl-C keeps Python's handler: KeyboardInterrupt, exit 130 once drained).
        previous = signal.signal(signal.SIGTERM, lambda *_: None)
        try:
            userver.run(sockets=[sock])
        finally:
            signal.signal(signal.SIGTERM, previous)
    finally:
        sock.close()
        worker.stop(timeout=settings.drain_s)
