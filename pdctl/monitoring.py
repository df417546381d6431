"""Monitoring a topology with Prometheus: its config, pdctl's recording and alerting rules, and what a Grafana
dashboard over them may query. Pure: a plan in, text out (pdctl.launch.run writes the files at launch).

Prometheus scrapes two jobs: `vllm` (every prefill, decode and reference server) and `pdctl_proxy` (the proxy).
Every target carries pdctl's names as labels: instance_name, role, pool (servers also block_size, tp, platform). The
proxy's job honours the proxy's own labels: its per-instance series (pdctl_proxy_inflight{role,pool,name,instance})
describe the servers behind it, not the proxy, so they keep their role and pool.

The recording rules aggregate per pool (role, pool), per pool pair (prefill_pool, decode_pool) and per proxy
reason; every rate is over WINDOW_SCRAPES scrape intervals (30 s at the default 2 s), so it has data within seconds.
A rule over a counter that only exists once something went wrong (errors, rejections) answers 0 until then: a
dashboard panel and a check see a series, not nothing.
"""

from __future__ import annotations

import re

import yaml

from pdctl.plan import Plan, ProcessSpec, connect_host, monitoring_dir
from pdctl.protocol import ProxyMetric as P
from pdctl.protocol import VllmMetric as V

VLLM_JOB = "vllm"
PROXY_JOB = "pdctl_proxy"
JOBS = f"{VLLM_JOB}|{PROXY_JOB}"
SERVER_ROLES = ("prefill", "decode", "reference")
WINDOW_SCRAPES = 15  # rate windows in scrape intervals: >= 2 samples even with a few scrapes missed
RESTART_WINDOW = "10m"  # how long a restart stays visible (pdctl:instance_restarts:10m, PdctlInstanceRestarted)

CONFIG_FILE = "prometheus.yml"
RECORDING_FILE = "rules/pdctl-recording.yml"
ALERTING_FILE = "rules/pdctl-alerts.yml"

# Series pdctl's rules and dashboard read. The proxy's are pdctl.proxy.metrics' own; vLLM's are those of vLLM 0.32's
# PrometheusStatLogger and NIXL connector (vllm/v1/metrics/loggers.py, .../kv_connector/v1/nixl/stats.py), as
# exposed (counters end in _total, histograms in _bucket/_sum/_count); process_start_time_seconds comes from
# prometheus_client's process collector (vLLM's default registry, the proxy's own); `up` from Prometheus.
PROXY_SERIES = (
    *(f"{c}_total" for c in (P.REQUESTS, P.PAIR_REQUESTS, P.UPSTREAM_ERRORS, P.KV_MISSING, P.FALLBACKS,
                             P.PREFILL_RETRIES, P.REJECTED)),
    P.INFLIGHT, P.BREAKER_OPEN, f"{P.BREAKER_TRIPS}_total",
    *(f"{h}_{s}" for h in (P.TTFT, P.DURATION, P.PREFILL) for s in ("bucket", "sum", "count")),
)
VLLM_SERIES = (
    V.RUNNING, V.WAITING, V.KV_USAGE,
    *(f"{c}_total" for c in (V.PROMPT_TOKENS, V.GENERATION_TOKENS, V.PROMPT_BY_SOURCE, V.SUCCESS, V.NIXL_FAILED)),
    *(f"{h}_{s}" for h in (V.TTFT, V.ITL, V.E2E, V.NIXL_XFER_TIME, V.NIXL_BYTES) for s in ("bucket", "sum", "count")),
)
OTHER_SERIES = ("up", "process_start_time_seconds")
KNOWN_SERIES = frozenset(PROXY_SERIES + VLLM_SERIES + OTHER_SERIES)


def duration(seconds: float) -> str:
    """Seconds as a Prometheus duration: 2 -> '2s', 7.5 -> '7500ms'."""
    ms = round(seconds * 1000)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def window(plan: Plan) -> str:
    """The recording rules' rate window: WINDOW_SCRAPES scrape intervals."""
    return duration(WINDOW_SCRAPES * plan.topology.monitoring.scrape_interval_s)


# ----------------------------------------------------------------------------------------------------------------
# prometheus.yml


def _target(s: ProcessSpec) -> dict:
    labels = {"instance_name": s.name, "role": s.role}
    if s.role in SERVER_ROLES:
        labels.update(pool=s.pool or s.role, block_size=str(s.block_size), tp=str(s.tp), platform=s.platform)
    # vllm-router serves /metrics on a port of its own (proxy.metrics_port); pdctl's proxy on its HTTP port.
    return {"targets": [f"{connect_host(s.host)}:{s.ports.get('metrics', s.ports['http'])}"], "labels": labels}


def prometheus_config(plan: Plan) -> str:
    m = plan.topology.monitoring
    every = duration(m.scrape_interval_s)
    rules = monitoring_dir(plan.state_dir)
    servers = [_target(s) for s in plan.processes if s.role in SERVER_ROLES]
    proxies = [_target(s) for s in plan.processes if s.role == "proxy"]
    cfg = {
        "global": {"scrape_interval": every, "scrape_timeout": every, "evaluation_interval": every,
                   "external_labels": {"topology": plan.name}},
        "rule_files": [str(rules / RECORDING_FILE), str(rules / ALERTING_FILE)],
        "scrape_configs": [
            {"job_name": VLLM_JOB, "metrics_path": "/metrics", "static_configs": servers},
            # The proxy's per-instance series name the servers behind it (role, pool, instance): kept as they are.
            {"job_name": PROXY_JOB, "metrics_path": "/metrics", "honor_labels": True, "static_configs": proxies},
        ],
    }
    return f"# written by pdctl for topology {plan.name}; rewritten at every `pdctl up`\n" + _yaml(cfg)


def _yaml(data: dict) -> str:
    return yaml.safe_dump(data, sort_keys=False, width=120)


# ----------------------------------------------------------------------------------------------------------------
# Rules


def _quantiles(name: str, by: str, bucket: str, w: str, where: str = "") -> list[dict]:
    return [{"record": f"{name}:p{q}",
             "expr": f"histogram_quantile(0.{q:02d}, sum by ({by}, le) (rate({bucket}{where}[{w}])))"}
            for q in (50, 99)]


def _zero_when_absent(expr: str, by: str | None = None) -> str:
    """expr, or 0 until its counter exists: per `by` group of the counter's base when given, else one series."""
    if by is None:
        return f"({expr}) or on() vector(0)"
    base = re.sub(r"\{[^}]*\}", "", expr, count=1)
    return f"({expr}) or ({base} * 0)"


def recording_rules(plan: Plan) -> dict:
    w = window(plan)
    pair, pool = "prefill_pool, decode_pool", "role, pool"
    pair_rules = [
        {"record": "pdctl:pair_requests:rate",
         "expr": f"sum by ({pair}) (rate({P.PAIR_REQUESTS}_total[{w}]))"},
        {"record": "pdctl:pair_errors:rate", "expr": _zero_when_absent(
            f'sum by ({pair}) (rate({P.PAIR_REQUESTS}_total{{status!~"2.."}}[{w}]))', pair)},
        *_quantiles("pdctl:pair_ttft_seconds", pair, f"{P.TTFT}_bucket", w),
        *_quantiles("pdctl:pair_duration_seconds", pair, f"{P.DURATION}_bucket", w),
    ]
    pool_rules = [
        {"record": "pdctl:pool_instances_up", "expr": f'sum by ({pool}) (up{{job="{VLLM_JOB}"}})'},
        *_quantiles("pdctl:pool_ttft_seconds", pool, f"{V.TTFT}_bucket", w),
        *_quantiles("pdctl:pool_tpot_seconds", pool, f"{V.ITL}_bucket", w, '{role="decode"}'),
        {"record": "pdctl:pool_prompt_tokens:rate", "expr": f"sum by ({pool}) (rate({V.PROMPT_TOKENS}_total[{w}]))"},
        {"record": "pdctl:pool_generation_tokens:rate",
         "expr": f"sum by ({pool}) (rate({V.GENERATION_TOKENS}_total[{w}]))"},
        {"record": "pdctl:pool_prompt_tokens_by_source:rate",
         "expr": f"sum by ({pool}, source) (rate({V.PROMPT_BY_SOURCE}_total[{w}]))"},
        {"record": "pdctl:pool_requests_running", "expr": f"sum by ({pool}) ({V.RUNNING})"},
        {"record": "pdctl:pool_requests_waiting", "expr": f"sum by ({pool}) ({V.WAITING})"},
        {"record": "pdctl:pool_kv_cache_usage:avg", "expr": f"avg by ({pool}) ({V.KV_USAGE})"},
        {"record": "pdctl:pool_kv_cache_usage:max", "expr": f"max by ({pool}) ({V.KV_USAGE})"},
        # NIXL's transfer series are the reader's: decode pools (pdctl's connector pulls the prefill's KV).
        {"record": "pdctl:pool_kv_transfers:rate",
         "expr": f"sum by ({pool}) (rate({V.NIXL_XFER_TIME}_count[{w}]))"},
        {"record": "pdctl:pool_kv_transfer_bytes:rate",
         "expr": f"sum by ({pool}) (rate({V.NIXL_BYTES}_sum[{w}]))"},
        *_quantiles("pdctl:pool_kv_transfer_seconds", pool, f"{V.NIXL_XFER_TIME}_bucket", w),
        {"record": "pdctl:pool_kv_transfer_failures:rate",
         "expr": f"sum by ({pool}) (rate({V.NIXL_FAILED}_total[{w}]))"},
        *_quantiles("pdctl:pool_prefill_leg_seconds", "prefill_pool", f"{P.PREFILL}_bucket", w),
        {"record": "pdctl:pool_proxy_inflight", "expr": f"sum by ({pool}) ({P.INFLIGHT})"},
        {"record": "pdctl:pool_breakers_open", "expr": f"sum by ({pool}) ({P.BREAKER_OPEN})"},
    ]
    proxy_rules = [
        {"record": "pdctl:proxy_requests:rate",
         "expr": f"sum by (route, status) (rate({P.REQUESTS}_total[{w}]))"},
        {"record": "pdctl:decode_only_fallbacks:rate",
         "expr": f"sum by (reason) (rate({P.FALLBACKS}_total[{w}]))"},
        {"record": "pdctl:proxy_kv_missing:rate", "expr": f"sum(rate({P.KV_MISSING}_total[{w}]))"},
        {"record": "pdctl:proxy_prefill_retries:rate",
         "expr": f"sum(rate({P.PREFILL_RETRIES}_total[{w}]))"},
        {"record": "pdctl:proxy_rejected:rate",
         "expr": _zero_when_absent(f"sum by (reason) (rate({P.REJECTED}_total[{w}]))")},
        {"record": "pdctl:proxy_upstream_errors:rate",
         "expr": _zero_when_absent(f"sum by (instance) (rate({P.UPSTREAM_ERRORS}_total[{w}]))")},
    ]
    instance_rules = [
        # A restart is a new process: its start time changes (the supervisor's restarts, or anyone else's).
        {"record": f"pdctl:instance_restarts:{RESTART_WINDOW}",
         "expr": f'changes(process_start_time_seconds{{job=~"{JOBS}"}}[{RESTART_WINDOW}])'},
    ]
    return {"groups": [{"name": f"pdctl-{n}", "rules": r} for n, r in
                       (("pairs", pair_rules), ("pools", pool_rules), ("proxy", proxy_rules),
                        ("instances", instance_rules))]}


def alerting_rules(plan: Plan) -> dict:
    w = window(plan)

    def alert(name: str, expr: str, for_: str, severity: str, summary: str) -> dict:
        return {"alert": name, "expr": expr, "for": for_, "labels": {"severity": severity},
                "annotations": {"summary": summary}}

    rules = [
        alert("PdctlInstanceDown", f'up{{job=~"{JOBS}"}} == 0', "10s", "critical",
              "{{ $labels.instance_name }} ({{ $labels.role }}) does not answer /metrics"),
        alert("PdctlInstanceRestarted", f'changes(process_start_time_seconds{{job=~"{JOBS}"}}[{RESTART_WINDOW}]) > 0',
              "0s", "warning", "{{ $labels.instance_name }} restarted {{ $value }} times in " + RESTART_WINDOW),
        alert("PdctlDecodeOnlyFallbacks", f"sum by (reason) (rate({P.FALLBACKS}_total[{w}])) > 0", "0s",
              "warning", "decodes computing prompts themselves (no prefill answered with KV: {{ $labels.reason }})"),
        alert("PdctlKvTransferFailures", f"sum by (role, pool) (rate({V.NIXL_FAILED}_total[{w}])) > 0",
              "0s", "critical", "NIXL KV transfers failing in {{ $labels.role }} pool {{ $labels.pool }}"),
        alert("PdctlKvTransferMissing", f"sum(rate({P.KV_MISSING}_total[{w}])) > 0", "0s",
              "critical", "prefills answering without kv_transfer_params (their KV cannot travel)"),
        alert("PdctlCircuitBreakerOpen", f"{P.BREAKER_OPEN} == 1", "0s", "warning",
              "the proxy took {{ $labels.name }} out of routing (circuit breaker open)"),
    ]
    return {"groups": [{"name": "pdctl-alerts", "rules": rules}]}


def recorded_names(plan: Plan) -> list[str]:
    return [r["record"] for g in recording_rules(plan)["groups"] for r in g["rules"]]


def alert_names(plan: Plan) -> list[str]:
    return [r["alert"] for g in alerting_rules(plan)["groups"] for r in g["rules"]]


def files(plan: Plan) -> dict[str, str]:
    """Every file Prometheus reads, relative to the monitoring dir (pdctl.plan.monitoring_dir)."""
    return {CONFIG_FILE: prometheus_config(plan), RECORDING_FILE: _yaml(recording_rules(plan)),
            ALERTING_FILE: _yaml(alerting_rules(plan))}


def prometheus_url(plan: Plan) -> str | None:
    """The Prometheus of a plan with monitoring on."""
    spec = next((s for s in plan.processes if s.role == "monitor"), None)
    return spec.http_url if spec else None
