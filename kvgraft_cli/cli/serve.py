"""`kvgraft serve`: the library behind an OpenAI-compatible endpoint (torch and Starlette inside the command)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from ._common import at_most_max_count, batch_option, engine_options, session
from ._output import err, print_json


@engine_options
def serve(
    host: str = typer.Option(
        "127.0.0.1", "--host", help="Address to listen on (loopback by default; 0.0.0.0 exposes it to the network)."
    ),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="TCP port (0: a free one, printed at start)."),
    k: int = typer.Option(
        0,
        "--k",
        min=0,
        callback=at_most_max_count,
        help="Graft up to K related library solutions (as a chain) when a question has no exact hit; 0: exact hits only.",
    ),
    min_score: float | None = typer.Option(
        None,
        "--min-score",
        help="With --k: graft related solutions only at this relevance or more (docs/RETRIEVAL.md).",
    ),
    no_prompt_cache: bool = typer.Option(
        False, "--no-prompt-cache", help="Compute every prompt whole; deposit no prompt chunks."
    ),
    chunk: int = typer.Option(
        256,
        "--chunk",
        min=1,
        callback=at_most_max_count,
        help="The prompt cache's chunk under the invariant schedule (a chunked manifest pins its own chunk_size).",
    ),
    queue: int = typer.Option(
        64,
        "--queue",
        min=1,
        callback=at_most_max_count,
        help="Requests that may wait; past them, 429 with Retry-After.",
    ),
    max_body: int = typer.Option(
        1 << 20, "--max-body", min=1024, callback=at_most_max_count, help="Largest request body in bytes (413 past it)."
    ),
    warm: int = typer.Option(
        256,
        "--warm",
        min=0,
        callback=at_most_max_count,
        help="MiB of the newest prompt-cache chains read (each chunk re-hashed) into memory at start; 0: none.",
    ),
    sync_every: float = typer.Option(
        30.0,
        "--sync-every",
        min=0.0,
        max=86400.0,
        help="With an s3:// store: publish the index rows of what this server recorded, and read what other servers "
        "and replicas published, at most every this many seconds (0: around every request).",
    ),
    replicas: int | None = typer.Option(
        None,
        "--replicas",
        min=1,
        callback=at_most_max_count,
        help="Engines in Ray actors behind this endpoint, one ledger (docs/SERVE.md); default: one, in this process.",
    ),
    ray_address: str | None = typer.Option(
        None,
        "--ray-address",
        help="With replicas: join this Ray cluster (auto, HOST:PORT, ray://HOST:10001) instead of a local instance; "
        "the store must be one every node reaches (s3://...).",
    ),
    replica_restarts: int = typer.Option(
        3,
        "--replica-restarts",
        min=0,
        max=100,
        help="With replicas: how often Ray restarts a replica that died before the front retires it (/health "
        "says why; with none left serving, requests get 503).",
    ),
    batch: int = batch_option("requests"),
    cache_max: str = typer.Option(
        "8G",
        "--cache-max",
        help="Bytes of prompt-cache chunks the store keeps (K, M, G, T: binary; 'none': unbounded). Past it the "
        "least recently used chains are evicted after each answer; library entries and deposits never are.",
    ),
    api_key: list[str] = typer.Option(
        [],
        "--api-key",
        help="A key clients must send (Authorization: Bearer KEY; repeatable; also KVGRAFT_API_KEY). Each key is a "
        "tenant with a prompt cache of its own; library answers stay shared.",
    ),
    api_key_file: Path | None = typer.Option(
        None, "--api-key-file", help="A file of keys, one a line (# comments), each a tenant as with --api-key."
    ),
    no_api_key: bool = typer.Option(
        False, "--no-api-key", help="Listen beyond loopback (--host) without a key: only when an open server is meant."
    ),
    no_log_bodies: bool = typer.Option(
        False,
        "--no-log-bodies",
        help="Keep only each request body's hash in the requests log (no prompt in clear on disk); `kvgraft replay "
        "--served` then cannot compute those requests again.",
    ),
    requests_log: Path | None = typer.Option(
        None,
        "--requests-log",
        help="Where request bodies are logged for `kvgraft replay --served` (default: beside the ledger, LEDGER.requests.jsonl).",
    ),
    manifest=None,
    store=None,
    ledger=None,
    allow_drift=False,
    as_json=False,  # engine_options
) -> None:
    """Serve the model behind OpenAI's chat and completion endpoints: greedy answers, the library's exact hits, a
    prompt cache kept in the store, one ledger line per request (docs/SERVE.md)."""
    from ..serve.answer import Options
    from ..serve.run import ServeSettings
    from ..serve.run import serve as run_serve
    from ..serve.tenants import load_keys
    from ..util.limits import parse_size

    keys = load_keys(api_key, api_key_file)
    bound = None if cache_max.strip().lower() == "none" else parse_size(cache_max, "--cache-max")
    s = session(manifest, store, ledger, allow_drift)
    options = Options(
        k,
        min_score,
        not no_prompt_cache,
        chunk,
        requests_log,
        warm << 20,
        sync_every,
        batch,
        cache_max=bound,
        log_bodies=not no_log_bodies,
    )
    settings = ServeSettings(
        host,
        port,
        queue,
        max_body,
        replicas=replicas,
        ray_address=ray_address,
        replica_restarts=replica_restarts,
        keys=keys,
        open_to_network=no_api_key,
    )

    def ready(server, url: str) -> None:
        info = {
            "url": url,
            "model": server.model_id,
            "manifest": s.manifest.source,
            "store": s.run.store_name,
            "ledger": str(s.ledger),
            "requests_log": str(server.requests_log),
            "prompt_cache_chunk": server.chunk,
            "prompt_cache_warmed": server.warmed.to_json(),
            "library": server.library,
            "prompt_cache_max_bytes": bound,
            "api_keys": len(keys),
            "requests_log_bodies": not no_log_bodies,
            "batch": getattr(server, "batch", 1),  # requests decoded together at most
            "batch_note": getattr(server, "batch_note", None),  # why one at a time, when batching was asked
            "replicas": getattr(server, "replicas", None),  # None: one engine, in this process
        }
        if as_json:
            print_json(info)
            sys.stdout.flush()
        else:
            cache = f"chunks of {server.chunk} tokens" if server.chunk else "off (the manifest's schedule is single)"
            if server.warmed.chunks:
                w = server.warmed
                cache += f", {w.chunks} read into memory ({w.bytes / 1e6:.0f} MB in {w.seconds:.1f} s)"
            if server.chunk:
                cache += f", at most {_size(bound)}" if bound is not None else ", unbounded"
            access = f"{len(keys)} API key{'s' if len(keys) != 1 else ''}" if keys else "no API key"
            err.print(
                f"kvgraft serve: {server.model_id} on {url}/v1  (ledger {s.ledger}; store {s.run.store_name}; "
                f"prompt cache {cache}; library {'on' if server.library else 'empty'}; {access}; "
                f"{_batch_text(info['batch'], info['batch_note'])}"
                f"{'; ' + str(info['replicas']) + ' replicas (Ray)' if info['replicas'] else ''})",
                highlight=False,
                soft_wrap=True,
            )
            print(f"listening on {url}", flush=True)

    run_serve(s, options, settings, on_ready=ready)


def _size(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n} bytes"


def _batch_text(batch: int, note: str | None) -> str:
    """How the server decodes, as said at start."""
    if note:
        return f"one request at a time ({note})"
    return f"up to {batch} requests decoded together" if batch > 1 else "one request at a time"
