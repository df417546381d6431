"""The README's two-host recipe (configs/cuda-to-gaudi-2hosts.yaml: CUDA prefill block 16 -> Gaudi decode block
128 on a Ray cluster, UCX across hosts) held by goldens of what `pdctl validate`, `pdctl plan` and
`pdctl render k8s` say of it. UPDATE_GOLDEN=1 rewrites them."""

import json
import os
import sys
from pathlib import Path

import yaml

from tests.conftest import CONFIGS, REPO

GOLDEN = Path(__file__).parent / "golden" / "recipes"
RECIPE = CONFIGS / "cuda-to-gaudi-2hosts.yaml"


def _golden(name: str, got: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(got)
    assert got == path.read_text(), f"{name} changed; rerun with UPDATE_GOLDEN=1 if intended"


def _normalized(text: str) -> str:
    return text.replace(sys.executable, "$PYTHON").replace(str(REPO), "$REPO")


def test_validate_says_what_it_says_of_the_two_host_recipe(run_cli, monkeypatch):
    monkeypatch.setenv("PD_API_KEY", "k")
    code, out, err = run_cli("validate", RECIPE)
    assert code == 0, err
    _golden("cuda-to-gaudi-2hosts.validate.txt", _normalized(out + err))


def test_the_two_host_recipes_plan_carries_ucx_across_hosts_and_its_placement(run_cli):
    code, out, err = run_cli("plan", RECIPE, "--json", "--state-dir", "/tmp/pdctl-golden")
    assert code == 0, err
    got = json.loads(_normalized(out))
    _golden("cuda-to-gaudi-2hosts.plan.json", json.dumps(got, indent=2) + "\n")
    env = {p["name"]: p["env"] for p in got["processes"]}
    for server in ("prefill-0", "decode-0"):
        assert env[server]["UCX_TCP_CONN_NB"] == "y" and env[server]["UCX_NET_DEVICES"] == "mlx5_0:1"
        assert "UCX_TLS" not in env[server]  # across hosts UCX picks its transports (RDMA where there is some)
    assert got["topology"]["engine"]["placement"]["decode"]["labels"] == {"accelerator": "gaudi"}


def test_the_two_host_recipe_renders_for_kubernetes(run_cli, tmp_path):
    code, _, err = run_cli("render", "k8s", RECIPE, "-o", tmp_path, "--namespace", "pd")
    assert code == 0, err
    manifests = {p.name: yaml.safe_load(p.read_text()) for p in sorted(tmp_path.glob("*.yaml"))}
    _golden("cuda-to-gaudi-2hosts.k8s.yaml", _normalized(yaml.safe_dump(manifests, sort_keys=True)))
