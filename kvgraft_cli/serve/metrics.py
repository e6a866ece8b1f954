"""``GET /metrics`` of `kvgraft serve`: Prometheus' text format, where operators look.

Written with ``prometheus_client`` (the Prometheus project's own Python client: its exposition format, label
escaping and histogram conventions are the ones Prometheus parses, which a format of our own would have to match
by hand). Each app has a registry of its own, so two servers in one process (the tests) never share counters.

What is counted, per answered request (the app sees every one, from one engine or from replicas): outcome, prompt
and generated tokens, prompt-cache chunks restored (hits) and computed and deposited (misses), library hits,
first-token latency (queue included: what a client waits) and the mean time per output token after the first.
Errors are counted by HTTP status. At scrape time: queue depth, requests decoding, and the prompt cache's bytes,
bound and evictions as the engine's thread last saw them (one engine in this process; replicas evict in their own
processes, and their evictions are not counted here).
"""

from __future__ import annotations

from typing import Any

# Seconds: a cached prompt's first token is milliseconds, a cold 2,000-token one on 2 cores tens of seconds
FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    """The counters and histograms of one app; :meth:`render` writes them with the gauges read from ``worker``."""

    def __init__(self, worker: Any):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

        disable_created_metrics()  # no *_created series beside each counter: the process start says as much
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.worker = worker
        self.requests = Counter("kvgraft_requests", "Requests answered, by how they ended.", ["outcome"], registry=r)
        self.errors = Counter("kvgraft_request_errors", "Requests refused or failed, by HTTP status.", ["status"], registry=r)  # fmt: skip
        self.prompt_tokens = Counter("kvgraft_prompt_tokens", "Prompt tokens of answered requests.", registry=r)
        self.generation_tokens = Counter("kvgraft_generation_tokens", "Tokens generated.", registry=r)
        self.cached_tokens = Counter("kvgraft_prompt_cache_hit_tokens", "Prompt tokens restored from the prompt cache.", registry=r)  # fmt: skip
        self.cache_hits = Counter("kvgraft_prompt_cache_hits", "Prompt-cache chunks restored.", registry=r)
        self.cache_misses = Counter("kvgraft_prompt_cache_misses", "Prompt-cache chunks computed and deposited.", registry=r)  # fmt: skip
        self.library = Counter("kvgraft_library_hits", "Questions answered from the library, by kind.", ["kind"], registry=r)  # fmt: skip
        self.grafted_tokens = Counter("kvgraft_library_grafted_tokens", "Tokens grafted from the library.", registry=r)  # fmt: skip
        self.first_token = Histogram(
            "kvgraft_time_to_first_token_seconds",
            "Seconds from a request's arrival at the engine's queue to its first token.",
            buckets=FIRST_TOKEN_BUCKETS,
            registry=r,
        )
        self.per_token = Histogram(
            "kvgraft_time_per_output_token_seconds",
            "A request's mean seconds per generated token after the first.",
            buckets=PER_TOKEN_BUCKETS,
            registry=r,
        )
        Gauge("kvgraft_queue_depth", "Requests waiting for the engine.", registry=r).set_function(
            lambda: worker.waiting
        )
        Gauge("kvgraft_requests_decoding", "Requests decoding now.", registry=r).set_function(
            lambda: getattr(worker, "decoding", 0) or 0
        )
        cache = getattr(worker.server, "cache", None)
        if cache is not None:  # one engine in this process: its prompt cache's bound
            Gauge("kvgraft_prompt_cache_bytes", "Bytes of prompt-cache chunks in the store.", registry=r).set_function(
                lambda: cache.bytes
            )
            Gauge(
                "kvgraft_prompt_cache_max_bytes", "The prompt cache's bound (--cache-max; -1: none).", registry=r
            ).set_function(lambda: -1 if cache.max is None else cache.max)
            Gauge(
                "kvgraft_prompt_cache_evicted_chunks", "Prompt-cache chunks this server evicted.", registry=r
            ).set_function(lambda: cache.evicted_chunks)
            Gauge(
                "kvgraft_prompt_cache_evicted_bytes", "Bytes of prompt-cache chunks this server evicted.", registry=r
            ).set_function(lambda: cache.evicted_bytes)

    def answered(self, answer: Any) -> None:
        """Count an answered request (serve.answer.Answer)."""
        self.requests.labels(answer.finish_reason).inc()
        self.prompt_tokens.inc(answer.prompt_tokens)
        self.generation_tokens.inc(len(answer.ids))
        self.cached_tokens.inc(answer.cached_tokens)
        self.cache_hits.inc(len(answer.cache_chunks))
        self.cache_misses.inc(len(answer.deposited_chunks))
        if answer.hit in ("exact", "related"):
            self.library.labels(answer.hit).inc()
            self.grafted_tokens.inc(answer.grafted_tokens)
        t = answer.timings
        if "first_token_s" in t:
            self.first_token.observe(t["first_token_s"] + t.get("queue_s", 0.0))
            if len(answer.ids) > 1 and "wall_s" in t:
                self.per_token.observe(max(0.0, t["wall_s"] - t["first_token_s"]) / (len(answer.ids) - 1))

    def failed(self, status: int) -> None:
        self.errors.labels(str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
