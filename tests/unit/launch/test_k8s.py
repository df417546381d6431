"""`pdctl render k8s`: manifests for every example topology pass kubernetes-validate --strict offline (no
cluster runs here to apply them), and say what a cluster needs: device requests, pod-IP side channel, upstreams."""

import copy
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from pdctl.launch import k8s
from pdctl.plan import build_plan
from pdctl.proxy.config import spec_of
from pdctl.topology import load_topology
from tests.conftest import CONFIGS

EXAMPLES = sorted(p for p in CONFIGS.glob("*.yaml") if p.stem not in ("expected",) and "matrix" not in p.stem)


def _render(path):
    loaded = load_topology(path)
    t = loaded.topology
    plan = build_plan(t, base_dir=loaded.base_dir, state_dir=loaded.base_dir / ".s", python="python3")
    return t, k8s.render(t, plan, namespace="pd")


def _strict(m):
    kubernetes_validate.validate(m, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_renders_strictly_valid_manifests(path):
    _, manifests = _render(path)
    assert {m["kind"] for m in manifests.values()} == {"ConfigMap", "Service", "StatefulSet", "Deployment"}
    for m in manifests.values():
        _strict(m)


def test_the_validator_rejects_a_misspelled_field():
    _, manifests = _render(CONFIGS / "cpu-demo.yaml")
    bad = copy.deepcopy(manifests["21-decode-statefulset.yaml"])
    bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        _strict(bad)
    bad = copy.deepcopy(manifests["20-decode-service.yaml"])
    bad["spec"]["ports"][0]["port"] = "eighty"
    with pytest.raises(kubernetes_validate.ValidationError):
        _strict(bad)


def test_cuda_to_gaudi_requests_devices_and_uses_the_pod_ip():
    t, m = _render(CONFIGS / "cuda-to-gaudi.yaml")
    pre = m["11-prefill-statefulset.yaml"]["spec"]["template"]["spec"]["containers"][0]
    dec = m["21-decode-statefulset.yaml"]["spec"]["template"]["spec"]["containers"][0]
    assert pre["resources"]["limits"] == {"nvidia.com/gpu": str(t.prefill[0].tp)}
    assert dec["resources"]["limits"] == {"habana.ai/gaudi": str(t.decode[0].tp)}
    for c in (pre, dec):
        env = {e["name"]: e for e in c["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert "CUDA_VISIBLE_DEVICES" not in env and "HABANA_VISIBLE_MODULES" not in env  # the device plugin's job
        # Pods are hosts of their own: UCX across hosts, not the plan's one-host shared-memory lanes.
        assert env["UCX_TCP_CONN_NB"]["value"] == "y" and "UCX_TLS" not in env and "UCX_MM_ERROR_HANDLING" not in env
        assert c["command"][c["command"].index("--host") + 1] == "0.0.0.0"
    assert dec["command"][dec["command"].index("--block-size") + 1] == str(t.decode[0].block_size)
    proxy = m["30-proxy-deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]["command"]
    cfg = spec_of(proxy)
    assert cfg.decode == ["http://cuda-to-gaudi-decode-0.cuda-to-gaudi-decode.pd.svc:8200"] and cfg.host == "0.0.0.0"
    assert "127.0.0.1" not in " ".join(proxy)


def test_local_model_comes_from_a_volume_and_counts_become_replicas():
    t, m = _render(CONFIGS / "cpu-demo.yaml")
    sts = m["21-decode-statefulset.yaml"]["spec"]
    c = sts["template"]["spec"]["containers"][0]
    assert c["command"][c["command"].index("--model") + 1] == "/models/tiny"
    assert sts["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "pdctl-models"
    assert sts["replicas"] == t.decode[0].count


def test_cli_writes_files_without_yaml_anchors(run_cli, tmp_path):
    code, out, err = run_cli("render", "k8s", CONFIGS / "cuda-to-gaudi.yaml", "-o", tmp_path)
    assert code == 0, err
    files = sorted(tmp_path.glob("*.yaml"))
    assert len(files) == 7
    for f in files:
        assert "&id" not in f.read_text()
        _strict(yaml.safe_load(f.read_text()))
    # And the validator's own command line, as a user would run it.
    tool = Path(sys.executable).parent / "kubernetes-validate"
    r = subprocess.run([str(tool), "--strict", *map(str, files)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.count("passed") == 7, r.stdout + r.stderr


def test_a_fleet_gets_one_statefulset_per_pool_and_the_proxy_names_pools():
    t, m = _render(CONFIGS / "cuda-gaudi-fleet.yaml")
    sts = {v["metadata"]["name"]: v for v in m.values() if v["kind"] == "StatefulSet"}
    assert set(sts) == {"cuda-gaudi-fleet-prefill-cuda16", "cuda-gaudi-fleet-prefill-gaudi128",
                        "cuda-gaudi-fleet-decode-gaudi128", "cuda-gaudi-fleet-decode-cuda16"}
    assert sts["cuda-gaudi-fleet-decode-gaudi128"]["spec"]["replicas"] == 2
    gaudi = sts["cuda-gaudi-fleet-decode-gaudi128"]["spec"]["template"]["spec"]["containers"][0]
    assert gaudi["resources"]["limits"] == {"habana.ai/gaudi": "1"}
    assert gaudi["command"][gaudi["command"].index("--block-size") + 1] == "128"
    # Selectors tell the pools of a role apart.
    selectors = [v["spec"]["selector"]["matchLabels"]["pdctl.dev/pool"] for v in sts.values()]
    assert sorted(selectors) == ["cuda16", "cuda16", "gaudi128", "gaudi128"]
    proxy = spec_of(m["30-proxy-deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]["command"])
    svc = "cuda-gaudi-fleet-decode-gaudi128"
    assert f"gaudi128=http://{svc}-1.{svc}.pd.svc:8200" in proxy.decode and proxy.exclude_pairs == []


def test_every_pod_carries_prometheus_scrape_annotations_for_its_metrics_port():
    t, m = _render(CONFIGS / "cuda-gaudi-fleet.yaml")
    pods = {v["metadata"]["name"]: v["spec"]["template"] for v in m.values()
            if v["kind"] in ("StatefulSet", "Deployment")}
    assert len(pods) == 5  # four pools and the proxy
    for name, pod in pods.items():
        ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
        assert pod["metadata"]["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/path": "/metrics",
                                                  "prometheus.io/port": str(ports["http"])}, name



def test_a_pools_nice_is_refused_for_kubernetes(run_cli, tmp_path):
    code, _, err = run_cli("render", "k8s", CONFIGS / "cpu-fleet.yaml", "-o", tmp_path, "--set",
                           "decode.d32.nice=10")
    assert code != 0 and "decode pool d32's nice" in err and "pod of its own" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())
    code, _, err = run_cli("render", "k8s", CONFIGS / "cpu-fleet.yaml", "-o", tmp_path, "--set", "decode.d32.nice=0")
    assert code == 0, err  # negative control: the same render without a nice
