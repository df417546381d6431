"""The proxy's Prometheus metrics, through prometheus_client (the library vLLM's own /metrics uses), one registry
per proxy: request counts by route and status, per prefill->decode pool pair, fallbacks, retries, refusals,
upstream errors; histograms of the time to first byte (TTFT as the client sees it) and of the whole request per
pair, and of the prefill leg per prefill pool; and, read from the router at each scrape, every instance's in-flight
requests and circuit breaker."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # no *_created series: pdctl's dashboards and gates do not read them

# Why a request went to a decode alone: no prefill was usable, the ones tried failed, or one answered without KV.
FALLBACK_REASONS = ("prefill_down", "prefill_failed", "no_kv_params")

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))
NO_POOL = "-"  # the prefill pool of a decode-only request, the decode pool of one that never reached a decode


class _Instances:
    """Per-instance gauges, read from the router's instances when Prometheus scrapes (nothing kept per request)."""

    def __init__(self, instances: Callable[[], Iterable]):
        self.instances = instances

    def collect(self):
        inflight = GaugeMetricFamily("pdctl_proxy_inflight", "requests in flight per instance",
                                     labels=["role", "pool", "name", "instance"])
        opened = GaugeMetricFamily("pdctl_proxy_breaker_open", "1 while the instance's circuit breaker is open",
                                   labels=["role", "pool", "name"])
        trips = CounterMetricFamily("pdctl_proxy_breaker_trips", "times the instance's circuit breaker opened",
                                    labels=["role", "pool", "name"])
        for i in self.instances():
            inflight.add_metric([i.role, i.pool, i.name, i.url], i.inflight)
            opened.add_metric([i.role, i.pool, i.name], int(i.breaker.opened_at is not None))
            trips.add_metric([i.role, i.pool, i.name], i.breaker.trips)
        yield from (inflight, opened, trips)


class Metrics:
    def __init__(self, instances: Callable[[], Iterable] = tuple):
        self.registry = r = CollectorRegistry(auto_describe=False)
        self.requests = Counter("pdctl_proxy_requests", "requests answered, by route and HTTP status",
                                ["route", "status"], registry=r)
        self.pairs = Counter("pdctl_proxy_pair_requests", "requests per prefill->decode pool pair and status",
                             ["prefill_pool", "decode_pool", "status"], registry=r)
        self.upstream_errors = Counter("pdctl_proxy_upstream_errors", "failed calls to an instance",
                                       ["instance"], registry=r)
        self.kv_missing = Counter("pdctl_proxy_kv_transfer_missing", "prefill answers without kv_transfer_params",
                                  registry=r)
        self.fallbacks = Counter("pdctl_decode_only_fallback", "requests a decode served alone (computing the "
                                 "prompt) because no prefill answered with usable KV", ["reason"], registry=r)
        for reason in FALLBACK_REASONS:
            self.fallbacks.labels(reason)  # every reason exported from the start, at 0
        self.retries = Counter("pdctl_proxy_prefill_retries", "prefill calls tried again on another prefill",
                               registry=r)
        self.rejected = Counter("pdctl_proxy_rejected", "requests refused (on_prefill_down: reject)", ["reason"],
                                registry=r)
        self.ttft = Histogram("pdctl_proxy_ttft_seconds", "proxy receive -> first byte to the client, per pair",
                              ["prefill_pool", "decode_pool"], buckets=BUCKETS, registry=r)
        self.duration = Histogram("pdctl_proxy_request_duration_seconds", "whole request, per pair and route",
                                  ["prefill_pool", "decode_pool", "route"], buckets=BUCKETS, registry=r)
        self.prefill_latency = Histogram("pdctl_proxy_prefill_seconds", "the prefill leg, per prefill pool",
                                         ["prefill_pool"], buckets=BUCKETS, registry=r)
        r.register(_Instances(instances))
        self._children: dict[tuple, object] = {}

    def _child(self, metric, *labels):
        """metric.labels(*labels), kept: prometheus_client checks and locks on every labels() call, and a
        request touches four labelled series (measured: ~10 % of the proxy's req/s at c=64 without the cache)."""
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def request_done(self, route: str, status: int, seconds: float, prefill_pool: str | None = None,
                     decode_pool: str | None = None, ttft_s: float | None = None) -> None:
        p, d = prefill_pool or NO_POOL, decode_pool or NO_POOL
        self._child(self.requests, route, status).inc()
        self._child(self.duration, p, d, route).observe(seconds)
        if ttft_s is not None:
            self._child(self.ttft, p, d).observe(ttft_s)
        if decode_pool is not None:
            self._child(self.pairs, p, d, status).inc()

    def prefill_done(self, seconds: float, pool: str | None) -> None:
        self._child(self.prefill_latency, pool or NO_POOL).observe(seconds)

    def upstream_error(self, url: str) -> None:
        self.upstream_errors.labels(url).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
