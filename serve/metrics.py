"""Prometheus metrics for /metrics: requests, tokens, time to first token, decode speed, queue, KV cache,
policy version, speculative decoding's drafted and accepted tokens."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from serve.engine.base import EngineStats

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
RATE_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500)
disable_created_metrics()  # *_created series only add noise to scrapes


class Metrics:
    def __init__(self, stats: Callable[[], EngineStats]):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("composer_requests", "Finished requests", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("composer_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generated_tokens = Counter("composer_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("composer_time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.decode_rate = Histogram("composer_decode_tokens_per_second", "Per-request decode speed",
                                     buckets=RATE_BUCKETS, registry=r)
        self.running = Gauge("composer_requests_running", "Requests being generated", registry=r)
        self.waiting = Gauge("composer_requests_waiting", "Requests queued (queue depth)", registry=r)
        self.kv_usage = Gauge("composer_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use", registry=r)
        self.prefix_hits = Gauge("composer_prefix_cache_hit_ratio", "Prefix-cache hits / queries", registry=r)
        self.policy_version = Gauge("composer_policy_version", "Version of the weights serving now", registry=r)
        self.spec_drafted = Gauge("composer_spec_draft_tokens", "Speculative decoding: draft tokens verified since "
                                  "start", registry=r)
        self.spec_accepted = Gauge("composer_spec_accepted_tokens", "Speculative decoding: draft tokens accepted "
                                   "since start", registry=r)
        self.spec_length = Gauge("composer_spec_mean_accepted_length", "Speculative decoding: tokens a sequence "
                                 "got per verifying step (1 + accepted drafts), mean since start", registry=r)
        self._stats = stats

    def render(self) -> bytes:
        s = self._stats()
        self.running.set(s.running)
        self.waiting.set(s.waiting)
        self.kv_usage.set(s.kv_cache_usage)
        self.policy_version.set(s.policy_version)
        self.prefix_hits.set(s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0)
        self.spec_drafted.set(s.spec_drafted)
        self.spec_accepted.set(s.spec_accepted)
        self.spec_length.set(1 + s.spec_accepted / s.spec_verifies if s.spec_verifies else 0.0)
        return generate_latest(self.registry)
