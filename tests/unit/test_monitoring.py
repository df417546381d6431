"""Monitoring (`pdctl up --monitoring`): the topology section, Prometheus in the plan, the config and rules pdctl
writes (checked by promtool and by a real Prometheus over fake targets), and the Grafana dashboard's queries."""

from __future__ import annotations

import copy
import io
import json
import re
import shutil
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from rich.console import Console

from pdctl import monitoring, render
from pdctl.api import DASHBOARD, StatusReport
from pdctl.launch import run as run_mod
from pdctl.launch.local import LocalEngine
from pdctl.plan import Plan, build_plan, monitoring_dir
from pdctl.topology import MONITORING_ON, Override, load_topology
from tests import prom
from tests.conftest import CONFIGS, REPO, processes_with_arg

DASHBOARD_FILE = REPO / DASHBOARD
VLLM_SNAPSHOT = Path(__file__).parent / "data" / "vllm-0.32-decode-metrics.txt"
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool missing (bash scripts/install_tools.sh)")


def _plan(state_dir: Path, *sets: str, config: str = "cpu-demo", monitoring_on: bool = True) -> Plan:
    overrides = [Override.parse_set(s) for s in sets] + ([MONITORING_ON] if monitoring_on else [])
    loaded = load_topology(CONFIGS / f"{config}.yaml", overrides)
    return build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=state_dir, python="py")


# ----------------------------------------------------------------------------------------------------------------
# Topology and plan


def test_monitoring_off_plans_no_prometheus_and_leaves_the_plan_json_as_it_was(tmp_path):
    p = _plan(tmp_path, monitoring_on=False)
    assert not p.by_role("monitor") and "monitoring" not in p.to_dict()["topology"]
    assert monitoring.prometheus_url(p) is None


def test_monitoring_on_plans_prometheus_with_its_files_in_the_state_dir(tmp_path):
    p = _plan(tmp_path / "s")
    (spec,) = p.by_role("monitor")
    d = tmp_path / "s" / "monitoring"
    assert spec.name == "prometheus" and spec.argv[0] == "prometheus" and spec.ports == {"http": 9090}
    assert f"--config.file={d / 'prometheus.yml'}" in spec.argv and f"--storage.tsdb.path={d / 'data'}" in spec.argv
    assert "--web.listen-address=127.0.0.1:9090" in spec.argv and "--storage.tsdb.retention.time=1d" in spec.argv
    assert spec.readiness_url == "http://127.0.0.1:9090/-/ready" and spec.log_path == str(tmp_path / "s" / "logs" /
                                                                                         "prometheus.log")
    assert monitoring.prometheus_url(p) == "http://127.0.0.1:9090"
    back = Plan.from_dict(json.loads(p.to_json()))  # state.json keeps it
    assert back.topology.monitoring.enabled and back.to_dict() == p.to_dict()


def test_pool_ports_assigned_automatically_skip_the_monitoring_port(tmp_path):
    p = _plan(tmp_path, "monitoring.port=8100")
    assert p.get("prefill-0").ports["http"] == 8101 and p.get("prometheus").ports["http"] == 8100
    off = _plan(tmp_path, "monitoring.port=8100", monitoring_on=False)  # control: off, it claims nothing
    assert off.get("prefill-0").ports["http"] == 8100


def test_up_monitoring_flag_turns_monitoring_on(run_cli):
    """--monitoring is monitoring.enabled: its port collision is reported only with the flag (the other, bad, value
    makes both runs stop at validation: nothing starts)."""
    bad = ["--set", "monitoring.port=8000", "--set", "decode.block_size=33"]
    code, _, err = run_cli("up", CONFIGS / "cpu-demo.yaml", *bad)
    assert code == 1 and "decode.block_size" in err and "monitoring.port" not in err
    code, _, err = run_cli("up", CONFIGS / "cpu-demo.yaml", "--monitoring", *bad)
    assert code == 1 and "monitoring.port: port 8000 of Prometheus (monitoring) is also used by the proxy" in err


def test_preflight_names_a_missing_prometheus(tmp_path, monkeypatch):
    p = _plan(tmp_path)
    loaded = p.topology.origin
    engine = SimpleNamespace(preflight=lambda plan: [], liveness=lambda *a: None)
    monkeypatch.setattr(run_mod.shutil, "which", lambda name: None)
    assert any("'prometheus' is not on PATH" in x for x in run_mod.preflight(loaded, p, engine))
    monkeypatch.setattr(run_mod.shutil, "which", lambda name: f"/usr/bin/{name}")  # control
    assert not any("prometheus" in x for x in run_mod.preflight(loaded, p, engine))


def test_write_monitoring_writes_config_and_rules_only_with_monitoring(tmp_path):
    run_mod.write_monitoring(_plan(tmp_path / "off", monitoring_on=False))
    assert not (tmp_path / "off").exists()
    p = _plan(tmp_path / "on")
    run_mod.write_monitoring(p)
    d = monitoring_dir(p.state_dir)
    assert {str(f.relative_to(d)) for f in d.rglob("*") if f.is_file()} == set(monitoring.files(p))


def test_status_prints_the_prometheus_url(tmp_path):
    def shown(url):
        buf = io.StringIO()
        render.status(Console(file=buf, width=80), StatusReport("t", "/s", "local", None, [], url))
        return buf.getvalue()

    assert "monitoring: Prometheus http://127.0.0.1:9090" in shown("http://127.0.0.1:9090")
    assert "monitoring" not in shown(None)


# ----------------------------------------------------------------------------------------------------------------
# prometheus.yml and the rules


def test_config_scrapes_every_instance_and_the_proxy_with_pdctl_labels(tmp_path):
    p = _plan(tmp_path, config="cpu-fleet")
    cfg = yaml.safe_load(monitoring.prometheus_config(p))
    assert cfg["global"]["scrape_interval"] == cfg["global"]["evaluation_interval"] == "2s"
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    targets = {t["labels"]["instance_name"]: (t["targets"], t["labels"]) for j in jobs.values()
               for t in j["static_configs"]}
    servers = [s for s in p.processes if s.role in ("prefill", "decode")]
    assert set(targets) == {s.name for s in servers} | {"proxy"}
    for s in servers:
        assert targets[s.name] == ([f"127.0.0.1:{s.ports['http']}"], {
            "instance_name": s.name, "role": s.role, "pool": s.pool, "block_size": str(s.block_size), "tp": "1",
            "platform": "cpu"})
    assert jobs["pdctl_proxy"]["honor_labels"] and targets["proxy"][0] == ["127.0.0.1:8000"]
    assert cfg["rule_files"] == [str(monitoring_dir(p.state_dir) / f) for f in (monitoring.RECORDING_FILE,
                                                                               monitoring.ALERTING_FILE)]


def test_rate_windows_follow_the_scrape_interval(tmp_path):
    assert (monitoring.duration(2), monitoring.duration(7.5), monitoring.duration(0.5)) == ("2s", "7500ms", "500ms")
    fast = _plan(tmp_path, "monitoring.scrape_interval_s=0.5")
    assert "[7500ms]" in yaml.safe_dump(monitoring.recording_rules(fast))
    assert "[30s]" in yaml.safe_dump(monitoring.recording_rules(_plan(tmp_path)))


def test_rules_read_only_series_the_proxy_vllm_or_other_rules_provide(tmp_path):
    p = _plan(tmp_path, config="cpu-fleet")
    recorded = monitoring.recorded_names(p)
    assert len(recorded) == len(set(recorded))
    exprs = [r["expr"] for f in (monitoring.recording_rules, monitoring.alerting_rules) for g in f(p)["groups"]
             for r in g["rules"]]
    assert prom.unknown_series([("rule", e) for e in exprs], recorded) == []
    assert set(monitoring.alert_names(p)) >= {"PdctlInstanceDown", "PdctlDecodeOnlyFallbacks", "PdctlInstanceRestarted",
                                              "PdctlKvTransferFailures", "PdctlKvTransferMissing"}


def test_known_proxy_series_are_what_the_proxy_exposes():
    from prometheus_client.parser import text_string_to_metric_families

    from pdctl.proxy.metrics import Metrics
    from pdctl.proxy.routing import Instance

    inst = Instance("decode-0", "http://127.0.0.1:8200", "decode", "default")
    m = Metrics(lambda: [inst])
    m.request_done("/v1/completions", 200, 0.5, "default", "default", ttft_s=0.1)
    m.prefill_done(0.05, "default")
    m.upstream_error(inst.url)
    m.reject("prefill_down")
    names = {s.name for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}
    assert set(monitoring.PROXY_SERIES) <= names, set(monitoring.PROXY_SERIES) - names
    assert "process_start_time_seconds" in names  # what pdctl:instance_restarts:10m reads, as on vLLM


def test_known_vllm_series_are_in_vllms_own_registry():
    """The snapshot was built by vLLM 0.32's own PrometheusStatLogger with pdctl's connector configured."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {s.name for f in text_string_to_metric_families(VLLM_SNAPSHOT.read_text()) for s in f.samples}
    assert set(monitoring.VLLM_SERIES) | {"process_start_time_seconds"} <= names
    assert "vllm:num_requests_runnin" not in names  # control: the check compares whole names


def test_the_installed_vllm_still_defines_the_series_pdctl_reads():
    """Drift: a vLLM upgrade that renames a series fails here, not on a dashboard."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm is not installed")
    root = Path(next(iter(spec.submodule_search_locations)))
    source = "".join((root / f).read_text() for f in ("v1/metrics/loggers.py",
                                                      "distributed/kv_transfer/kv_connector/v1/nixl/stats.py"))
    bases = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in monitoring.VLLM_SERIES}
    assert [b for b in sorted(bases) if f'"{b}"' not in source] == []


@needs_promtool
def test_promtool_accepts_the_config_and_the_rules(tmp_path):
    p = _plan(tmp_path, config="cpu-fleet")
    run_mod.write_monitoring(p)
    d = monitoring_dir(p.state_dir)
    r = subprocess.run([PROMTOOL, "check", "config", str(d / "prometheus.yml")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{len(monitoring.recorded_names(p))} rules found" in r.stdout
    r = subprocess.run([PROMTOOL, "check", "rules", str(d / monitoring.ALERTING_FILE)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_promtool_refuses_a_broken_rule(tmp_path):
    """Control: the check above can fail."""
    bad = tmp_path / "bad.yml"
    bad.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [{"record": "pdctl:x", "expr": "sum by ("}]}]}))
    r = subprocess.run([PROMTOOL, "check", "rules", str(bad)], capture_output=True, text=True)
    assert r.returncode != 0


# Inputs for promtool's rule unit tests: a 2 s scrape, 20 samples (0 .. 38 s).
_TARGET = 'job="vllm", instance="127.0.0.1:{port}", instance_name="{name}", role="{role}", pool="default"'
_PREFILL = _TARGET.format(port=8100, name="prefill-0", role="prefill")
_DECODE = _TARGET.format(port=8200, name="decode-0", role="decode")
_PROXY = 'job="pdctl_proxy", instance="127.0.0.1:8000", instance_name="proxy", role="proxy"'
_PAIR = 'prefill_pool="{p}", decode_pool="default", status="{s}"'
RULE_TEST_SERIES = [
    (f"up{{{_PREFILL}}}", "1x9 0x9"),  # down from 20 s
    (f"up{{{_DECODE}}}", "1x19"),
    (f"process_start_time_seconds{{{_PREFILL}}}", "100x19"),
    (f"process_start_time_seconds{{{_DECODE}}}", "100x9 200x9"),  # restarted at 20 s
    (f'pdctl_decode_only_fallback_total{{{_PROXY}, reason="prefill_down"}}', "0x9 1+1x9"),  # from 20 s
    (f'pdctl_decode_only_fallback_total{{{_PROXY}, reason="no_kv_params"}}', "0x19"),
    (f"vllm:nixl_num_failed_transfers_total{{{_DECODE}}}", "0x9 1+1x9"),
    (f"pdctl_proxy_kv_transfer_missing_total{{{_PROXY}}}", "0x19"),
    (f"pdctl_proxy_pair_requests_total{{{_PROXY}, {_PAIR.format(p='default', s='200')}}}", "0+4x19"),
    (f"pdctl_proxy_pair_requests_total{{{_PROXY}, {_PAIR.format(p='p2', s='503')}}}", "0+1x19"),
]


def _labels(series: str) -> dict[str, str]:
    return dict(re.findall(r'(\w+)="([^"]*)"', series))


def _rule_tests(early: list, late: list, exprs: list) -> dict:
    return {"rule_files": [monitoring.RECORDING_FILE, monitoring.ALERTING_FILE], "evaluation_interval": "2s",
            "tests": [{"interval": "2s", "input_series": [{"series": s, "values": v} for s, v in RULE_TEST_SERIES],
                       "alert_rule_test": early + late, "promql_expr_test": exprs}]}


@needs_promtool
def test_alerts_fire_when_they_should_and_not_before(tmp_path):
    p = _plan(tmp_path)
    run_mod.write_monitoring(p)
    d = monitoring_dir(p.state_dir)
    down = {**_labels(_PREFILL), "severity": "critical"}
    restarted = {**_labels(_DECODE), "severity": "warning"}
    # Before anything went wrong (or, for instance-down, before its 10 s `for`): nothing fires.
    early = [{"eval_time": t, "alertname": a, "exp_alerts": []} for t, a in
             (("18s", "PdctlInstanceRestarted"), ("18s", "PdctlDecodeOnlyFallbacks"),
              ("18s", "PdctlKvTransferFailures"), ("24s", "PdctlInstanceDown"))]
    late = [
        {"eval_time": "38s", "alertname": "PdctlInstanceDown", "exp_alerts": [{"exp_labels": down, "exp_annotations": {
            "summary": "prefill-0 (prefill) does not answer /metrics"}}]},
        {"eval_time": "38s", "alertname": "PdctlInstanceRestarted", "exp_alerts": [{
            "exp_labels": restarted, "exp_annotations": {"summary": "decode-0 restarted 1 times in 10m"}}]},
        {"eval_time": "38s", "alertname": "PdctlDecodeOnlyFallbacks", "exp_alerts": [{
            "exp_labels": {"reason": "prefill_down", "severity": "warning"}, "exp_annotations": {
                "summary": "decodes computing prompts themselves (no prefill answered with KV: prefill_down)"}}]},
        {"eval_time": "38s", "alertname": "PdctlKvTransferFailures", "exp_alerts": [{
            "exp_labels": {"role": "decode", "pool": "default", "severity": "critical"}, "exp_annotations": {
                "summary": "NIXL KV transfers failing in decode pool default"}}]},
        {"eval_time": "38s", "alertname": "PdctlKvTransferMissing", "exp_alerts": []},  # its counter never moved
    ]
    pair = 'pdctl:{}{{prefill_pool="{}", decode_pool="default"}}'
    exprs = [
        {"expr": "pdctl:pair_requests:rate", "eval_time": "38s", "exp_samples": [
            {"labels": pair.format("pair_requests:rate", "default"), "value": 2},
            {"labels": pair.format("pair_requests:rate", "p2"), "value": 0.5}]},
        # Errors: the failing pair's rate, and 0 (not nothing) for the pair without errors.
        {"expr": "pdctl:pair_errors:rate", "eval_time": "38s", "exp_samples": [
            {"labels": pair.format("pair_errors:rate", "default"), "value": 0},
            {"labels": pair.format("pair_errors:rate", "p2"), "value": 0.5}]},
        {"expr": "pdctl:proxy_rejected:rate", "eval_time": "38s", "exp_samples": [
            {"labels": "pdctl:proxy_rejected:rate", "value": 0}]},
        {"expr": "pdctl:pool_instances_up", "eval_time": "38s", "exp_samples": [
            {"labels": 'pdctl:pool_instances_up{role="prefill", pool="default"}', "value": 0},
            {"labels": 'pdctl:pool_instances_up{role="decode", pool="default"}', "value": 1}]},
    ]
    (d / "tests.yml").write_text(yaml.safe_dump(_rule_tests(early, late, exprs), sort_keys=False))
    r = subprocess.run([PROMTOOL, "test", "rules", "tests.yml"], capture_output=True, text=True, cwd=d)
    assert r.returncode == 0, r.stdout + r.stderr
    # Control: expecting the instance-down alert while it is still pending fails.
    wrong = [{**late[0], "eval_time": "24s"}]
    (d / "wrong.yml").write_text(yaml.safe_dump(_rule_tests([], wrong, []), sort_keys=False))
    r = subprocess.run([PROMTOOL, "test", "rules", "wrong.yml"], capture_output=True, text=True, cwd=d)
    assert r.returncode != 0 and "PdctlInstanceDown" in r.stdout + r.stderr


# ----------------------------------------------------------------------------------------------------------------
# PromQL names


@pytest.mark.parametrize("expr,names", [
    ('sum by (prefill_pool, le) (rate(pdctl_proxy_ttft_seconds_bucket{pool=~"$pool"}[$__rate_interval]))',
     {"pdctl_proxy_ttft_seconds_bucket"}),
    ("histogram_quantile(0.99, sum(rate(vllm:nixl_xfer_time_seconds_bucket[30s])) by (le, pool))",
     {"vllm:nixl_xfer_time_seconds_bucket"}),
    ('(sum by (instance) (rate(a_total[30s]))) or on() vector(0)', {"a_total"}),
    ('up{job=~"a|b"} == 0 and on(instance) b offset 5m', {"up", "b"}),
    ("a / ignoring(status) group_left(le) b * 1e3 > bool 0", {"a", "b"}),
    ('label_replace(x, "a", "$1", "b", "(.*)")', {"x"}),
    ("sum without (engine) (pdctl:pool_kv_cache_usage:max)", {"pdctl:pool_kv_cache_usage:max"}),
])
def test_series_names(expr, names):
    assert prom.series_names(expr) == names


def test_expand_sets_every_variable_to_all():
    dash = {"templating": {"list": [{"name": "pool", "type": "query", "allValue": ".*"}]}}
    got = prom.expand('rate(x{pool=~"$pool", p=~"${pool}"}[$__rate_interval])', dash, rate_interval="7s")
    assert got == 'rate(x{pool=~".*", p=~".*"}[7s])'


# ----------------------------------------------------------------------------------------------------------------
# The Grafana dashboard


def test_dashboard_loads_and_every_panel_queries_prometheus():
    dash = prom.load_dashboard(DASHBOARD_FILE)
    assert dash["schemaVersion"] >= 36 and dash["uid"] == "pdctl-fleet"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert {"pool", "prefill_pool", "decode_pool"} <= set(variables)
    panels = prom.dashboard_panels(dash)
    assert len(panels) >= 15 and len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
        assert p["targets"] and all(t.get("expr") for t in p["targets"]), p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]


def test_dashboard_reads_only_recorded_or_known_series(tmp_path):
    recorded = monitoring.recorded_names(_plan(tmp_path, config="cpu-fleet"))
    queries = prom.dashboard_queries(DASHBOARD_FILE)
    assert prom.unknown_series(queries, recorded) == []
    used = {n for _, e in queries for n in prom.series_names(e)}
    # Every pool and pair view the issue asks for is on it.
    assert {"pdctl:pair_requests:rate", "pdctl:pair_ttft_seconds:p99", "pdctl:pool_ttft_seconds:p50",
            "pdctl:pool_tpot_seconds:p99", "pdctl:pool_kv_transfer_seconds:p99", "pdctl:pool_kv_transfer_bytes:rate",
            "pdctl:decode_only_fallbacks:rate", "pdctl:instance_restarts:10m", "up",
            "pdctl:pool_kv_cache_usage:max"} <= used


def test_a_misspelt_metric_in_the_dashboard_is_caught(tmp_path):
    dash = prom.load_dashboard(DASHBOARD_FILE)
    bad = copy.deepcopy(dash)
    target = prom.dashboard_panels(bad)[3]["targets"][0]
    target["expr"] = target["expr"].replace("pdctl:pool_", "pdctl:poool_", 1)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    recorded = monitoring.recorded_names(_plan(tmp_path, config="cpu-fleet"))
    problems = prom.unknown_series(prom.dashboard_queries(path), recorded)
    assert len(problems) == 1 and "pdctl:poool_kv_transfer_failures:rate" in problems[0]


# ----------------------------------------------------------------------------------------------------------------
# A real Prometheus with pdctl's config and rules, over fake instances (vLLM's registry, the real proxy metrics)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _growing(text: str, n: int) -> str:
    """The snapshot with every counter and histogram series n higher: rates are not all 0 (buckets stay
    cumulative: each bucket, the sum and the count grow alike)."""
    out = []
    for line in text.splitlines():
        m = re.match(r"^([^#\s{]+(?:_total|_bucket|_sum|_count))(\{[^}]*\})? (\S+)$", line)
        out.append(f"{m.group(1)}{m.group(2) or ''} {float(m.group(3)) + n}" if m else line)
    return "\n".join(out) + "\n"


class _Fake(BaseHTTPRequestHandler):
    body = staticmethod(lambda: b"")

    def do_GET(self):  # noqa: N802 (http.server's name)
        data = self.body()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def _serve(port: int, body) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", port), type("Fake", (_Fake,), {"body": staticmethod(body)}))
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus missing (bash scripts/install_tools.sh)")
@pytest.mark.unit_time_limit(15, reason="Prometheus scrapes its first targets 5 s after it starts (its scrape "
                             "manager's fixed reload tick), and rules need two scrapes after that")
def test_a_real_prometheus_scrapes_every_target_and_evaluates_every_rule_and_panel(tmp_path):
    from pdctl.proxy.metrics import Metrics
    from pdctl.proxy.routing import Instance

    pf, dc, px, pm = _free_ports(4)
    p = _plan(tmp_path / "s", f"prefill.http_port={pf}", f"decode.http_port={dc}", f"proxy.port={px}",
              f"monitoring.port={pm}", "monitoring.scrape_interval_s=0.5")
    snapshot = VLLM_SNAPSHOT.read_text()
    scrapes = {"n": 0}

    def vllm_body():
        scrapes["n"] += 1
        return _growing(snapshot, scrapes["n"]).encode()

    insts = [Instance("prefill-0", f"http://127.0.0.1:{pf}", "prefill", "default"),
             Instance("decode-0", f"http://127.0.0.1:{dc}", "decode", "default")]
    metrics = Metrics(lambda: insts)

    def proxy_body():  # a request per scrape: the proxy's rates are not 0
        metrics.request_done("/v1/completions", 200, 0.4, "default", "default", ttft_s=0.2)
        metrics.prefill_done(0.1, "default")
        return metrics.render()

    servers = [_serve(pf, vllm_body), _serve(dc, vllm_body), _serve(px, proxy_body)]
    run_mod.write_monitoring(p)
    spec = p.get("prometheus")
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 (closed in finally)
    proc = subprocess.Popen(spec.argv, stdout=log, stderr=subprocess.STDOUT)
    url = spec.http_url
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and run_mod.probe.http_get(spec.readiness_url, timeout=1)[0] != 200:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
            time.sleep(0.2)
        recorded = monitoring.recorded_names(p)
        missing = prom.wait_until_all_answer(url, recorded, timeout_s=20)
        assert missing == [], f"recording rules without a series: {missing}"
        targets = prom.targets(url)
        assert sorted(t["labels"]["instance_name"] for t in targets) == ["decode-0", "prefill-0", "proxy"]
        assert all(t["health"] == "up" for t in targets), [(t["scrapeUrl"], t["lastError"]) for t in targets]
        loaded = prom.rules(url)
        assert {r["name"] for r in loaded} == set(recorded) | set(monitoring.alert_names(p))
        assert [(r["name"], r["lastError"]) for r in loaded if r["health"] != "ok"] == []
        dash = prom.load_dashboard(DASHBOARD_FILE)
        panels = [(t, prom.expand(e, dash, rate_interval=monitoring.window(p)))
                  for t, e in prom.dashboard_queries(DASHBOARD_FILE)]
        assert [t for t, e in panels if not prom.query(url, e)] == []
        # Control: a misspelt series answers nothing, so the checks above can fail.
        assert prom.query(url, "pdctl:pair_request:rate") == []
        assert prom.query(url, "pdctl:pair_requests:rate")[0]["metric"] == {
            "__name__": "pdctl:pair_requests:rate", "prefill_pool": "default", "decode_pool": "default"}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        for s in servers:
            s.shutdown()


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus missing (bash scripts/install_tools.sh)")
def test_the_local_engine_starts_prometheus_waits_for_it_and_down_stops_it(tmp_path):
    """The launch path `pdctl up` takes (files, guard, readiness, status, down) with the plan's Prometheus alone:
    no vLLM server is needed to start and stop it."""
    (port,) = _free_ports(1)
    full = _plan(tmp_path / "s", f"monitoring.port={port}")
    p = full.with_processes(full.by_role("monitor"))
    engine = LocalEngine()
    assert engine.preflight(p) == []
    state = run_mod.up(p, engine, attached=True, timeout_s=60)
    try:
        assert (monitoring_dir(p.state_dir) / "prometheus.yml").is_file()
        (row,) = run_mod.status(state, engine)
        assert (row.name, row.role, row.healthy, row.http_port) == ("prometheus", "monitor", True, port)
        assert prom.api(f"http://127.0.0.1:{port}", "status/config")["yaml"]  # it read pdctl's config
    finally:
        report = run_mod.down(state, engine)
    assert report.stopped == ["prometheus"] and not report.killed  # SIGTERM was enough
    assert processes_with_arg(str(monitoring_dir(p.state_dir))) == []
    assert (monitoring_dir(p.state_dir) / "data").is_dir()
