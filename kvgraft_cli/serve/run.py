"""Start a server: load the engine, bind the socket, run uvicorn until SIGTERM or Ctrl-C, drain, close.

The socket is bound here (port 0 picks a free one) so the address printed is the one listening; uvicorn serves on
it. SIGTERM and Ctrl-C stop new connections, let every request in flight finish (its ledger line written) and
then end the engine's thread.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import InputError
from .answer import Options, Server
from .app import DEFAULT_MAX_BODY
from .tenants import Keys, is_loopback

if TYPE_CHECKING:
    from ..api import Session
    from .replicas import Front, Replicas
    from .worker import Worker


@dataclass
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    queue: int = 64
    max_body: int = DEFAULT_MAX_BODY
    drain_s: float = 60.0  # how long SIGTERM waits for requests in flight
    replicas: int | None = None  # engines in Ray actors behind this front (serve.replicas); None: one, in process
    ray_address: str | None = None  # with replicas: a Ray cluster to join (None: a local instance on loopback)
    replica_restarts: int = 3  # with replicas: Ray's restarts of a dead replica before the front retires it
    keys: Keys = field(default_factory=lambda: Keys([]))  # the API keys /v1 takes (serve.tenants); none: open
    open_to_network: bool = False  # listening beyond loopback without a key is meant (--no-api-key)


def check_installed() -> None:
    """Refuse, before any model loads, when the ``serve`` extra is missing."""
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise InputError(
            "kvgraft serve needs Starlette, uvicorn and prometheus_client", "pip install 'kvgraft[serve]'"
        ) from None


def check_exposure(settings: ServeSettings) -> None:
    """Refuse, before any model loads, to listen beyond loopback without an API key unless that is meant: anyone
    who reaches the port could make the server compute, and fill its disk and ledger."""
    if settings.keys or settings.open_to_network or is_loopback(settings.host):
        return
    raise InputError(
        f"--host {settings.host} listens beyond this machine, and no API key is set: anyone who reaches it could "
        "make the server compute, and fill its store and ledger",
        "give keys (--api-key, --api-key-file or KVGRAFT_API_KEY), or pass --no-api-key if an open server is meant",
    )


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
    session: Session,
    options: Options,
    settings: ServeSettings,
    on_ready: Callable[[Server | Front, str], None] | None = None,
) -> None:
    """Load the session's engine (or its replicas'), open the store, bind, and serve until stopped (see the module
    docstring)."""
    check_installed()
    check_exposure(settings)
    from ..ledger import log as ledger

    ctx = session.run
    ledger.check_appendable(ctx.ledger)
    worker: Worker | Replicas
    if settings.replicas is not None or settings.ray_address:
        from .replicas import Replicas

        worker = Replicas(
            ctx, options, settings.replicas, settings.ray_address, settings.queue, settings.replica_restarts
        )
        try:
            worker.start()
        except BaseException:
            worker.close()
            raise
        assert worker.server is not None
        shown: Server | Front = worker.server
    else:
        from .worker import Worker

        worker = Worker(Server(ctx, session.engine, options), settings.queue)
        worker.start()  # opens the store in the engine's thread (refusals come out here)
        shown = worker.server
    sock = bind(settings.host, settings.port)
    try:
        import uvicorn

        from .app import create_app

        app = create_app(worker, settings.max_body, keys=settings.keys)
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
            on_ready(shown, url)
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
