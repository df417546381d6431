"""pdctl's counters in vLLM's own connector metrics: each server's /metrics (and so `pdctl status` and
Prometheus) carries them next to vLLM's vllm:nixl_* series.

vLLM collects a connector's stats on its workers, ships them to the API server as plain lists, and turns them into
Prometheus series through the connector class's build_kv_connector_stats / build_prom_metrics; pdctl's connector
returns these subclasses, which add keys to the same lists.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats, NixlPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine

from pdctl import protocol

# The Prometheus counter (also its key in the stats vLLM ships from the workers) -> what it counts.
COUNTERS = {
    protocol.READS_TIMED_OUT: "KV reads given up after connector.kv_read_timeout_s (then kv_load_failure_policy)",
    protocol.READS_REFUSED_LEASE: "KV reads not started: the prefill's KV lease was not known to be alive",
    protocol.READS_PEER_GONE: "KV reads given up because their prefill is gone (its side channel refuses connections)",
    protocol.RECOMPUTED: "requests whose KV load failed and the decode computed the prompt itself (policy recompute)",
    protocol.FINGERPRINTS_CHECKED: "received KV checked against the prefill's fingerprint (per TP rank)",
    protocol.FINGERPRINT_MISMATCHES: "received KV that was not the prefill's: its load failed (per TP rank)",
    protocol.FINGERPRINT_SECONDS: "seconds spent on KV fingerprints: computing them on a prefill, checking them "
                                  "on a decode (per TP rank)",
}


class PdctlKVConnectorStats(NixlKVConnectorStats):
    def reset(self):
        super().reset()
        self.data.update({k: [] for k in COUNTERS})

    def record(self, key: str, amount: float = 1) -> None:
        """Add to a counter: one event, or `amount` of what it counts (seconds)."""
        self.data.setdefault(key, []).append(amount)

    def is_empty(self) -> bool:
        return super().is_empty() and not any(self.data.get(k) for k in COUNTERS)

    def aggregate(self, other):
        for k in COUNTERS:  # stats from a worker of another build (stock keys only) aggregate too
            self.data.setdefault(k, [])
            other.data.setdefault(k, [])
        return super().aggregate(other)

    def reduce(self):
        out = super().reduce()
        out.update({k.removeprefix("vllm:"): sum(self.data.get(k, ())) for k in COUNTERS})
        return out


class PdctlPromMetrics(NixlPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.pdctl_counters = {
            name: create_metric_per_engine(self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                                           self.per_engine_labelvalues)
            for name, doc in COUNTERS.items()}

    def observe(self, transfer_stats_data, engine_idx: int = 0):
        super().observe(transfer_stats_data, engine_idx)
        for key, counter in self.pdctl_counters.items():
            for n in transfer_stats_data.get(key, ()):
                counter[engine_idx].inc(n)
