"""`kvgraft serve`: the library behind an OpenAI-compatible endpoint (torch and Starlette inside the command)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from ._common import at_most_max_count, batch_option, context, engine_options
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

    ctx = context(manifest, store, ledger, allow_drift)
    options = Options(k, min_score, not no_prompt_cache, chunk, requests_log, warm << 20, sync_every, batch)
    settings = ServeSettings(
        host, port, queue, max_body, replicas=replicas, ray_address=ray_address, replica_restarts=replica_restarts
    )

    def ready(server, url: str) -> None:
        info = {
            "url": url,
            "model": server.model_id,
            "manifest": ctx.manifest.source,
            "store": ctx.store_name,
            "ledger": str(ctx.ledger),
            "requests_log": str(server.requests_log),
            "prompt_cache_chunk": server.chunk,
            "prompt_cache_warmed": server.warmed.to_json(),
            "library": server.library,
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
            err.print(
                f"kvgraft serve: {server.model_id} on {url}/v1  (ledger {ctx.ledger}; store {ctx.store_name}; "
                f"prompt cache {cache}; library {'on' if server.library else 'empty'}; "
                f"{_batch_text(info['batch'], info['batch_note'])}"
                f"{'; ' + str(info['replicas']) + ' replicas (Ray)' if info['replicas'] else ''})",
                highlight=False,
                soft_wrap=True,
            )
            print(f"listening on {url}", flush=True)

    run_serve(ctx, options, settings, on_ready=ready)


def _batch_text(batch: int, note: str | None) -> str:
    """How the server decodes, as said at start."""
    if note:
        return f"one request at a time ({note})"
    return f"up to {batch} requests decoded together" if batch > 1 else "one request at a time"
