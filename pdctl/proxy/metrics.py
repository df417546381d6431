"""The proxy's Prometheus metrics, exposed through prometheus_client (the library vLLM's own /metrics uses), one
registry per proxy: request counts by route and status, per prefill->decode pool pair, fallbacks, retries,
refusals, upstream errors; histograms of the time to first byte (TTFT as the client sees it) and of the whole
request per pair, and of the prefill leg per prefill pool; and, read from the router at each scrape, every
instance's in-flight requests and circuit breaker.

A request only bumps plain counters (dict and list increments, ~2 us); prometheus_client builds the metric families
from them when Prometheus scrapes. Its own Counter/Histogram take a lock per value change and per labels() call:
measured, that cost the proxy 6-12 % of its requests/s on one core (scripts/bench_proxy.py --pdctl-at)."""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from pdctl.protocol import ProxyMetric as PM

# Why a request went to a decode alone: no prefill was usable, the ones tried failed, or one answered without KV.
FALLBACK_REASONS = ("prefill_down", "prefill_failed", "no_kv_params")

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))
NO_POOL = "-"  # the prefill pool of a decode-only request, the decode pool of one that never reached a decode


class _Histograms:
    """One histogram family: per label tuple, the count in each bucket (not cumulative) and the sum."""

    def __init__(self, name: str, doc: str, labels: list[str]):
        self.name, self.doc, self.labels = name, doc, labels
        self.series: dict[tuple, list] = {}  # labels -> [bucket counts..., sum]

    def observe(self, key: tuple, v: float) -> None:
        s = self.series.get(key)
        if s is None:
            s = self.series[key] = [0] * len(BUCKETS) + [0.0]
        s[bisect.bisect_left(BUCKETS, v)] += 1
        s[-1] += v

    def family(self) -> HistogramMetricFamily:
        f = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        for key, s in sorted(self.series.items()):
            cum, buckets = 0, []
            for bound, n in zip(BUCKETS, s, strict=False):
                cum += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cum))
            f.add_metric(list(key), buckets, s[-1])
        return f


def _counter(name: str, doc: str, labels: list[str], counts: Counter) -> CounterMetricFamily:
    f = CounterMetricFamily(name, doc, labels=labels)
    for key, n in sorted(counts.items(), key=lambda kv: tuple(map(str, kv[0]))):
        f.add_metric([str(k) for k in key], n)
    return f


class Metrics:
    def __init__(self, instances: Callable[[], Iterable] = tuple):
        self.instances = instances
        self.requests: Counter = Counter()  # (route, status)
        self.pairs: Counter = Counter()  # (prefill pool, decode pool, status)
        self.upstream_errors: Counter = Counter()  # (instance url,)
        self.fallbacks: Counter = Counter({(r,): 0 for r in FALLBACK_REASONS})  # (reason,): every reason, from 0
        self.rejected: Counter = Counter()  # (reason,)
        self.kv_missing = 0
        self.first_token: Counter = Counter()  # (outcome,): the prefill's token streamed first, or mismatch
        self.retries = 0
        self.ttft = _Histograms(PM.TTFT, "proxy receive -> first byte to the client, per pair",
                                ["prefill_pool", "decode_pool"])
        self.duration = _Histograms(PM.DURATION, "whole request, per pair and route",
                                    ["prefill_pool", "decode_pool", "route"])
        self.prefill_latency = _Histograms(PM.PREFILL, "the prefill leg, per prefill pool",
                                           ["prefill_pool"])
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        # process_start_time_seconds & co. (read from /proc at scrape time), as vLLM's /metrics has them: a restart
        # of the proxy shows in Prometheus as a new start time (pdctl:instance_restarts:10m).
        ProcessCollector(registry=self.registry)

    # -- recording (the request path) ----------------------------------------------------------------------------

    def request_done(self, route: str, status: int, seconds: float, prefill_pool: str | None = None,
                     decode_pool: str | None = None, ttft_s: float | None = None) -> None:
        p, d = prefill_pool or NO_POOL, decode_pool or NO_POOL
        self.requests[(route, status)] += 1
        self.duration.observe((p, d, route), seconds)
        if ttft_s is not None:
            self.ttft.observe((p, d), ttft_s)
        if decode_pool is not None:
            self.pairs[(p, d, status)] += 1

    def prefill_done(self, seconds: float, pool: str | None) -> None:
        self.prefill_latency.observe((pool or NO_POOL,), seconds)

    def upstream_error(self, url: str) -> None:
        self.upstream_errors[(url,)] += 1

    def fallback(self, reason: str) -> None:
        self.fallbacks[(reason,)] += 1

    def reject(self, reason: str) -> None:
        self.rejected[(reason,)] += 1

    # -- exposition (prometheus_client, at scrape time) --------------------------------------------------------

    def collect(self):
        yield _counter(PM.REQUESTS, "requests answered, by route and HTTP status", ["route", "status"],
                       self.requests)
        yield _counter(PM.PAIR_REQUESTS, "requests per prefill->decode pool pair and status",
                       ["prefill_pool", "decode_pool", "status"], self.pairs)
        yield _counter(PM.UPSTREAM_ERRORS, "failed calls to an instance", ["instance"],
                       self.upstream_errors)
        yield CounterMetricFamily(PM.KV_MISSING, "prefill answers without kv_transfer_params",
                                  value=self.kv_missing)
        yield _counter(PM.FALLBACKS, "requests a decode served alone (computing the prompt) "
                       "because no prefill answered with usable KV", ["reason"], self.fallbacks)
        yield CounterMetricFamily(PM.PREFILL_RETRIES, "prefill calls tried again on another prefill",
                                  value=self.retries)
        yield _counter(PM.REJECTED, "requests refused: on_prefill_down: reject's reasons, and "
                       "unauthorized (no or a wrong API key)", ["reason"], self.rejected)
        yield _counter(PM.FIRST_TOKEN, "first_token: streams whose first token came from the "
                       "prefill's answer (from_prefill), and those the decode's first text then contradicted "
                       "(mismatch: ended with an error)", ["outcome"], self.first_token)
        yield from (h.family() for h in (self.ttft, self.duration, self.prefill_latency))
        inflight = GaugeMetricFamily(PM.INFLIGHT, "requests in flight per instance",
                                     labels=["role", "pool", "name", "instance"])
        opened = GaugeMetricFamily(PM.BREAKER_OPEN, "1 while the instance's circuit breaker is open",
                                   labels=["role", "pool", "name"])
        trips = CounterMetricFamily(PM.BREAKER_TRIPS, "times the instance's circuit breaker opened",
                                    labels=["role", "pool", "name"])
        for i in self.instances():
            inflight.add_metric([i.role, i.pool, i.name, i.url], i.inflight)
            opened.add_metric([i.role, i.pool, i.name], int(i.breaker.opened_at is not None))
            trips.add_metric([i.role, i.pool, i.name], i.breaker.trips)
        yield from (inflight, opened, trips)

    def render(self) -> bytes:
        return generate_latest(self.registry)
