"""The README's two-host recipe (configs/cuda-to-gaudi-2hosts.yaml: CUDA prefill block 16 -> Gaudi decode block
128 on a Ray cluster, UCX across hosts) held by goldens of what `pdctl validate`, `pdctl plan` and
`pdctl render k8s` say of it. UPDATE_GOLDEN=1 rewrites them."""

import json
import os
import sys
from pathlib import Path

import pytest
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


GAUDI_RECIPES = ["cuda-to-gaudi.yaml", "cuda-to-gaudi-2hosts.yaml", "cuda-gaudi-fleet.yaml"]
HARNESS = REPO / "scripts" / "kv_conformance.py"


def recipe_cells(name: str) -> list[tuple[str, str]]:
    """Each P/D pair of a recipe as the conformance harness's --prefill / --decode (form:block), from its plan."""
    sys.path.insert(0, str(HARNESS.parent))
    from kv_conformance import registered_form

    from pdctl import load
    from pdctl.topology.schema import VLLM_CACHE_LAYOUT

    t = load(CONFIGS / name)

    def side(pool):
        form = registered_form(pool.platform, VLLM_CACHE_LAYOUT[pool.kv_layout], t.kv_buffer_device(pool))
        return f"{form}:{pool.block_size}"

    return sorted({(side(p), side(d)) for p in t.prefill for d in t.decode})


@pytest.mark.unit_time_limit(30, reason="runs the conformance harness in a subprocess: torch and NIXL imported by it "
                                        "and by its prefill process, one NIXL READ per cell")
def test_the_cuda_to_gaudi_recipes_use_forms_the_harness_proves_exact():
    import subprocess

    cells = {c for name in GAUDI_RECIPES for c in recipe_cells(name)}
    assert ("host:LBHNC:16", "host:hpu:128") in cells and ("LBHNC:16", "host:hpu:128") in cells
    assert ("host:hpu:128", "LBHNC:16") in cells
    code = (f"import json, sys; sys.path.insert(0, {str(HARNESS.parent)!r}); import kv_conformance as kc\n"
            f"cells = {sorted(cells)!r}\n"
            "side = lambda text: kc.parse_side(text, '--prefill/--decode', 1)\n"
            "cases = [kc.Case(side(p), side(d), tokens=t, prefix_hit=h)\n"
            "         for p, d in cells for t, h in ((449, 0), (449, 1), (500, 2))]\n"
            "print(json.dumps([(c.describe(), o.result) for c, o in kc.run_cases(cases, 'cpu')]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    assert len(results) == 3 * len(cells) and all(r == "exact" for _, r in results), results


def test_the_layout_and_the_handshake_setting_reach_the_servers_that_need_them(run_cli):
    code, out, err = run_cli("plan", CONFIGS / "cuda-to-gaudi.yaml", "--json", "--state-dir", "/tmp/pdctl-golden")
    assert code == 0, err
    env = {s["role"]: s["env"] for s in json.loads(out)["processes"] if s["role"] in ("prefill", "decode")}
    assert env == {**env, "prefill": {**env["prefill"], "VLLM_KV_CACHE_LAYOUT": "LBHNC"},
                   "decode": {**env["decode"], "VLLM_KV_CACHE_LAYOUT": "LBNHC"}}
    assert '\\"enforce_handshake_compat\\":false' in out  # NIXL's hash cannot hold across two kinds of device
    code, out, err = run_cli("plan", CONFIGS / "cpu-demo.yaml", "--json", "--state-dir", "/tmp/pdctl-golden")
    assert code == 0 and "VLLM_KV_CACHE_LAYOUT" not in out and "enforce_handshake_compat" not in out
