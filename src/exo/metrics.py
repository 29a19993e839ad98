"""Prometheus metrics of one server (its own registry, never prometheus-client's global one).

Counters are updated from the event loop (HTTP requests, errors) and from the device worker thread
(tokens, native-MTP drafts); prometheus-client's metrics are thread-safe.
"""

from __future__ import annotations

import threading

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from exo.engine import NativeMTPStats

_FAST = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_SLOW = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "exo_http_requests", "HTTP requests by route and status", ["method", "route", "status"], registry=r
        )
        self.errors = Counter("exo_api_errors", "Error responses by error code", ["code"], registry=r)
        self.generations = Counter(
            "exo_generations", "Finished generations by model and finish reason", ["model", "finish_reason"], registry=r
        )
        self.prompt_tokens = Counter("exo_prompt_tokens", "Prompt tokens processed", ["model"], registry=r)
        self.completion_tokens = Counter("exo_completion_tokens", "Tokens generated", ["model"], registry=r)
        self.drafted = Counter("exo_native_mtp_drafted_tokens", "MTP draft tokens verified", ["model"], registry=r)
        self.accepted = Counter("exo_native_mtp_accepted_tokens", "MTP draft tokens accepted", ["model"], registry=r)
        self.acceptance = Gauge(
            "exo_native_mtp_acceptance_rate", "Accepted / drafted tokens since start", ["model"], registry=r
        )
        self.queue_depth = Gauge("exo_queue_depth", "Requests waiting for the device", registry=r)
        self.running = Gauge("exo_generations_running", "Generations running on the device", registry=r)
        self.batch_size = Histogram(
            "exo_batch_size", "Generations decoding together at each completion token (1: alone)", registry=r,
            buckets=(1, 2, 4, 8, 16, 32, 64),
        )
        self.models_loaded = Gauge("exo_models_loaded", "Models loaded in memory", registry=r)
        self.queue_wait = Histogram("exo_queue_wait_seconds", "Time from arrival to the device", registry=r, buckets=_SLOW)
        self.ttft = Histogram("exo_ttft_seconds", "Prefill to first token on the device", registry=r, buckets=_FAST)
        self.generation_time = Histogram(
            "exo_generation_seconds", "Device time of one generation", registry=r, buckets=_SLOW
        )
        self.cancel_latency = Histogram(
            "exo_cancel_latency_seconds", "From a cancellation (disconnect, timeout) to the device being free",
            registry=r, buckets=_FAST,
        )
        self.prefix_cached_tokens = Counter(
            "exo_prefix_cache_cached_tokens", "Prompt tokens restored from the prefix cache", ["model"], registry=r
        )
        self.prefix_hits = Counter(
            "exo_prefix_cache_hits", "Generations that restored a cached prefix", ["model"], registry=r
        )
        self.prefix_lookups = Counter(
            "exo_prefix_cache_lookups", "Generations that looked for a cached prefix", ["model"], registry=r
        )
        self.prefix_hit_rate = Gauge(
            "exo_prefix_cache_token_hit_rate", "Cached / prompt tokens of looked-up generations since start",
            ["model"], registry=r,
        )
        self.prefix_bytes = Gauge(
            "exo_prefix_cache_bytes", "Bytes the prefix cache holds per tier (at the last generation)",
            ["model", "tier"], registry=r,
        )
        self.prefix_budget = Gauge(
            "exo_prefix_cache_budget_bytes", "The byte budget each tier of the prefix cache keeps to (RAM: the "
            "setting shrunk to the node's free memory after the instance's weights and KV reservation)",
            ["model", "tier"], registry=r,
        )
        self.prefix_evictions = Gauge(
            "exo_prefix_cache_evictions", "Entries the prefix cache dropped per tier since its runner started",
            ["model", "tier"], registry=r,
        )
        self.prefix_failures = Gauge(
            "exo_prefix_cache_failures", "Prefix cache calls that raised since its runner started (a store out of "
            "memory or disk, an unreadable entry): each a miss or a skipped store, never a failed request",
            ["model"], registry=r,
        )
        self.device_memory = Gauge(
            "exo_device_memory_bytes", "MLX's memory in the process that ran the model's last generation (kind: "
            "active, cache = freed buffers kept for reuse, peak = the most active since that process started)",
            ["model", "kind"], registry=r,
        )
        self._prefix_totals: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self._mtp_totals: dict[str, list[int]] = {}

    def record_generation(self, model: str, finish_reason: str, stats: NativeMTPStats | None) -> None:
        self.generations.labels(model, finish_reason).inc()
        if stats is None:
            return
        self.prompt_tokens.labels(model).inc(stats.prompt_tokens)
        self.completion_tokens.labels(model).inc(stats.completion_tokens)
        self.ttft.observe(stats.ttft_ms / 1000.0)
        batched = 0
        for size, tokens in stats.batch_sizes.items():
            batched += tokens
            for _ in range(tokens):
                self.batch_size.observe(size)
        for _ in range(max(0, stats.completion_tokens - batched)):
            self.batch_size.observe(1)
        if stats.prefix_cache is not None:
            self._record_prefix(model, stats)
        for kind, value in (stats.device_memory or {}).items():
            self.device_memory.labels(model, kind.removesuffix("_bytes")).set(value)
        if stats.drafted_tokens:
            self.drafted.labels(model).inc(stats.drafted_tokens)
            self.accepted.labels(model).inc(stats.accepted_tokens)
            with self._lock:
                totals = self._mtp_totals.setdefault(model, [0, 0])
                totals[0] += stats.drafted_tokens
                totals[1] += stats.accepted_tokens
                self.acceptance.labels(model).set(totals[1] / totals[0])

    def _record_prefix(self, model: str, stats: NativeMTPStats) -> None:
        figures = stats.prefix_cache or {}
        self.prefix_lookups.labels(model).inc()
        if stats.cached_tokens:
            self.prefix_hits.labels(model).inc()
            self.prefix_cached_tokens.labels(model).inc(stats.cached_tokens)
        with self._lock:
            totals = self._prefix_totals.setdefault(model, [0, 0])
            totals[0] += stats.prompt_tokens
            totals[1] += stats.cached_tokens
            if totals[0]:
                self.prefix_hit_rate.labels(model).set(totals[1] / totals[0])
        if "failures" in figures:
            self.prefix_failures.labels(model).set(figures["failures"])
        for tier in ("ram", "disk"):
            if f"{tier}_bytes" in figures:
                self.prefix_bytes.labels(model, tier).set(figures[f"{tier}_bytes"])
                self.prefix_evictions.labels(model, tier).set(figures.get(f"{tier}_evictions", 0))
            if f"{tier}_budget_bytes" in figures:
                self.prefix_budget.labels(model, tier).set(figures[f"{tier}_budget_bytes"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
