"""The proxy's Prometheus metrics, kept by hand: a few counters and histograms need no client library."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# Why a request went to a decode alone: no prefill was usable, the ones tried failed, or one answered without KV.
FALLBACK_REASONS = ("prefill_down", "prefill_failed", "no_kv_params")

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))


@dataclass
class Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * len(BUCKETS))
    total: float = 0.0
    n: int = 0

    def observe(self, v: float) -> None:
        self.total += v
        self.n += 1
        for i, b in enumerate(BUCKETS):
            if v <= b:
                self.counts[i] += 1
                break

    def render(self, name: str) -> list[str]:
        lines, cum = [f"# TYPE {name} histogram"], 0
        for b, c in zip(BUCKETS, self.counts, strict=True):
            cum += c
            le = "+Inf" if b == float("inf") else repr(b)
            lines.append(f'{name}_bucket{{le="{le}"}} {cum}')
        return [*lines, f"{name}_sum {self.total}", f"{name}_count {self.n}"]


@dataclass
class Metrics:
    requests: Counter = field(default_factory=Counter)  # (route, status) -> n
    upstream_errors: Counter = field(default_factory=Counter)  # instance url -> n
    pairs: Counter = field(default_factory=Counter)  # (prefill pool, decode pool, status) -> n
    kv_transfer_missing: int = 0
    fallbacks: Counter = field(default_factory=Counter)  # reason -> decode-only requests
    prefill_retries: int = 0
    rejected: Counter = field(default_factory=Counter)  # reason -> requests refused (on_prefill_down: reject)
    prefill_latency: Histogram = field(default_factory=Histogram)
    first_decode_byte_latency: Histogram = field(default_factory=Histogram)
    e2e_latency: Histogram = field(default_factory=Histogram)

    def request_done(self, route: str, status: int, seconds: float) -> None:
        self.requests[(route, status)] += 1
        self.e2e_latency.observe(seconds)

    def prefill_done(self, seconds: float) -> None:
        self.prefill_latency.observe(seconds)

    def first_decode_byte(self, seconds: float) -> None:
        self.first_decode_byte_latency.observe(seconds)

    def pair_done(self, prefill_pool: str, decode_pool: str, status: int) -> None:
        self.pairs[(prefill_pool, decode_pool, status)] += 1

    def upstream_error(self, url: str) -> None:
        self.upstream_errors[url] += 1

    def render(self, instances: list) -> str:
        lines = ["# TYPE pdctl_proxy_requests_total counter"]
        lines += [f'pdctl_proxy_requests_total{{route="{r}",status="{s}"}} {n}'
                  for (r, s), n in sorted(self.requests.items())]
        lines.append("# TYPE pdctl_proxy_pair_requests_total counter")
        lines += [f'pdctl_proxy_pair_requests_total{{prefill_pool="{p}",decode_pool="{d}",status="{s}"}} {n}'
                  for (p, d, s), n in sorted(self.pairs.items())]
        lines.append("# TYPE pdctl_proxy_upstream_errors_total counter")
        lines += [f'pdctl_proxy_upstream_errors_total{{instance="{u}"}} {n}'
                  for u, n in sorted(self.upstream_errors.items())]
        lines += ["# TYPE pdctl_proxy_kv_transfer_missing_total counter",
                  f"pdctl_proxy_kv_transfer_missing_total {self.kv_transfer_missing}",
                  "# HELP pdctl_decode_only_fallback_total requests a decode served alone (computing the "
                  "prompt) because no prefill answered with usable KV",
                  "# TYPE pdctl_decode_only_fallback_total counter"]
        lines += [f'pdctl_decode_only_fallback_total{{reason="{r}"}} {self.fallbacks[r]}'
                  for r in sorted({*FALLBACK_REASONS, *self.fallbacks})]
        lines += ["# TYPE pdctl_proxy_prefill_retries_total counter",
                  f"pdctl_proxy_prefill_retries_total {self.prefill_retries}",
                  "# TYPE pdctl_proxy_rejected_total counter"]
        lines += [f'pdctl_proxy_rejected_total{{reason="{r}"}} {n}' for r, n in sorted(self.rejected.items())]
        lines += ["# TYPE pdctl_proxy_inflight gauge"]
        for i in instances:
            lines.append(f'pdctl_proxy_inflight{{role="{i.role}",pool="{i.pool}",name="{i.name}",'
                         f'instance="{i.url}"}} {i.inflight}')
        lines.append("# TYPE pdctl_proxy_breaker_open gauge")
        lines += [f'pdctl_proxy_breaker_open{{role="{i.role}",name="{i.name}"}} '
                  f'{int(i.breaker.opened_at is not None)}' for i in instances]
        lines.append("# TYPE pdctl_proxy_breaker_trips_total counter")
        lines += [f'pdctl_proxy_breaker_trips_total{{role="{i.role}",name="{i.name}"}} {i.breaker.trips}'
                  for i in instances]
        lines += self.prefill_latency.render("pdctl_proxy_prefill_seconds")
        lines += self.first_decode_byte_latency.render("pdctl_proxy_first_decode_byte_seconds")
        lines += self.e2e_latency.render("pdctl_proxy_e2e_seconds")
        return "\n".join(lines) + "\n"
