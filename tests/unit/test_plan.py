"""The plan is pure and golden-tested: the exact argv/env/ports of every process."""

import json
import os
import sys
from pathlib import Path

import pytest

from pdctl.plan import build_plan
from pdctl.proxy.config import spec_of
from pdctl.topology import Override, load_topology
from tests.conftest import CONFIGS, REPO

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
GOLDEN_CONFIGS = ["cpu-demo", "cpu-router", "qwen3-0.6b-cuda-d64-tp2", "cuda-to-gaudi", "cpu-hybrid",
                  "gpt-oss-20b-cuda-hybrid"]


def _normalized(text: str) -> dict:
    text = text.replace(sys.executable, "$PYTHON").replace(str(REPO), "$REPO")
    return json.loads(text)


@pytest.mark.parametrize("config", GOLDEN_CONFIGS)
def test_plan_json_golden(run_cli, config):
    code, out, err = run_cli("plan", CONFIGS / f"{config}.yaml", "--json", "--state-dir", "/tmp/pdctl-golden")
    assert code == 0, err
    _check_golden(_normalized(out), f"{config}.plan.json")


def _check_golden(got: dict, name: str) -> None:
    path = os.path.join(GOLDEN, name)
    if os.environ.get("UPDATE_GOLDEN"):
        with open(path, "w") as f:
            json.dump(got, f, indent=2)
            f.write("\n")
    with open(path) as f:
        assert got == json.load(f), f"plan changed; rerun with UPDATE_GOLDEN=1 if intended ({path})"


@pytest.mark.parametrize("config", GOLDEN_CONFIGS)
def test_the_typed_plan_writes_the_golden_json_and_reads_it_back(config):
    """The plan holds the typed topology; its JSON (state.json, `plan --json`) is the topology's JSON dump, and
    reading it back gives the same plan (the model is re-validated, the file-reading rules are not re-run)."""
    from pdctl.plan import Plan

    loaded = load_topology(CONFIGS / f"{config}.yaml")
    p = build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=Path("/tmp/pdctl-golden"),
                   python=sys.executable)
    assert p.topology is loaded.topology
    with open(os.path.join(GOLDEN, f"{config}.plan.json")) as f:
        golden = json.load(f)
    assert _normalized(p.to_json()) == golden
    back = Plan.from_dict(json.loads(p.to_json()))
    assert back.to_dict() == p.to_dict() and back.topology.model_dump() == p.topology.model_dump()
    assert back.topology.origin is None  # read back, not loaded from a file


@pytest.mark.parametrize("config", sorted(c.stem for c in CONFIGS.glob("*.yaml")
                                          if c.stem != "expected" and "matrix" not in c.stem))
def test_every_example_plan_reads_back_from_its_json(config):
    from pdctl.plan import Plan

    loaded = load_topology(CONFIGS / f"{config}.yaml")
    p = build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=Path("/s"))
    back = Plan.from_dict(json.loads(p.to_json()))
    assert back.to_json() == p.to_json() and back.topology.model_dump() == p.topology.model_dump()


def test_plans_change_through_methods_not_rebuilds():
    p = _plan()
    ref = p.get("decode-0")
    q = p.with_processes([ref])
    assert [s.name for s in q.processes] == ["decode-0"] and q.topology is p.topology
    assert (q.name, q.state_dir) == (p.name, p.state_dir) and len(p.processes) == 3


def _plan(config="cpu-demo", overrides=()):
    loaded = load_topology(CONFIGS / f"{config}.yaml", overrides)
    return build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=REPO / ".pdctl" / "x", python="py")


def test_plan_is_pure():
    assert _plan().to_json() == _plan().to_json()


def test_vllm_argv_carries_the_kv_transfer_config():
    p = _plan()
    prefill, decode = p.get("prefill-0"), p.get("decode-0")
    assert prefill.argv[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]  # `vllm serve` is broken
    cfg_p = json.loads(prefill.argv[prefill.argv.index("--kv-transfer-config") + 1])
    cfg_d = json.loads(decode.argv[decode.argv.index("--kv-transfer-config") + 1])
    assert (cfg_p["kv_role"], cfg_d["kv_role"]) == ("kv_producer", "kv_consumer")
    assert cfg_p["kv_connector"] == "NixlConnector"
    assert cfg_p["kv_connector_module_path"] == "pdctl.connector.nixl"
    assert decode.argv[decode.argv.index("--block-size") + 1] == "64"
    assert "--enforce-eager" in prefill.argv and "--enforce-eager" in decode.argv
    assert prefill.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != decode.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    assert (prefill.env["VLLM_CPU_OMP_THREADS_BIND"], decode.env["VLLM_CPU_OMP_THREADS_BIND"]) == ("0", "1")
    assert "VLLM_CPU_KVCACHE_SPACE" not in decode.env  # it would override --kv-cache-memory-bytes
    assert prefill.readiness_url == "http://127.0.0.1:8100/health"


def test_stock_connector_has_no_module_path():
    from pdctl.topology import Override

    p = _plan("cpu-homog", [Override(("connector", "kind"), "nixl", "--set connector.kind=nixl")])
    cfg = json.loads(p.get("decode-0").argv[p.get("decode-0").argv.index("--kv-transfer-config") + 1])
    assert "kv_connector_module_path" not in cfg


def test_counts_and_devices_per_instance():
    from pdctl.topology import Override

    p = _plan("qwen3-0.6b-cuda-d64-tp2", [Override(("prefill", "count"), 2, "x"),
                                          Override(("prefill", "devices"), [0, 3], "y")])
    assert [s.name for s in p.processes] == ["prefill-0", "prefill-1", "decode-0", "proxy"]
    assert p.get("prefill-1").env["CUDA_VISIBLE_DEVICES"] == "3"
    assert p.get("decode-0").env["CUDA_VISIBLE_DEVICES"] == "1,2"
    assert p.get("prefill-1").ports == {"http": 8101, "side_channel": 5601}
    cfg = spec_of(p.get("proxy").argv)
    assert len(cfg.prefill) == 2 and len(cfg.decode) == 1


def test_platform_device_env():
    p = _plan("cuda-to-gaudi")
    assert p.get("decode-0").env["HABANA_VISIBLE_MODULES"] == "0"
    assert p.get("prefill-0").env["CUDA_VISIBLE_DEVICES"] == "0"


def test_a_cpu_servers_bound_cores_are_counted_from_the_binding_the_plan_gives_it():
    from dataclasses import replace

    p = _plan("cpu-demo")
    assert p.get("prefill-0").env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and p.get("prefill-0").bound_cores == 1
    one = p.get("decode-0")
    for bind, n in (("0|1", 2), ("0-3|4-7", 8), ("2,3|2", 2)):  # TP ranks' groups; vLLM's ranges; counted once
        assert replace(one, env={**one.env, "VLLM_CPU_OMP_THREADS_BIND": bind}).bound_cores == n, bind
    # Negative controls: unbound, vLLM's own choice, a value that names no cores, a proxy, an accelerator server.
    for bind in (None, "auto", "nobind", "0-x"):
        env = {k: v for k, v in one.env.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
        assert replace(one, env=env if bind is None else {**env, "VLLM_CPU_OMP_THREADS_BIND": bind}).bound_cores \
            is None, bind
    assert p.get("proxy").bound_cores is None and _plan("cuda-to-gaudi").get("prefill-0").bound_cores is None


def test_plan_human_output(run_cli):
    code, out, _ = run_cli("plan", CONFIGS / "cpu-demo.yaml")
    assert code == 0
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT=5600" in out and "--kv-transfer-config" in out


def test_with_hosts_moves_instances_and_the_proxys_upstreams():
    loaded = load_topology(CONFIGS / "cpu-demo.yaml")
    p = build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=Path("/s"), python="python")
    q = p.with_hosts({"prefill-0": "127.0.0.2", "decode-0": "127.0.0.3"})
    pre, dec, px = q.get("prefill-0"), q.get("decode-0"), q.get("proxy")
    assert pre.argv[pre.argv.index("--host") + 1] == "127.0.0.2" and pre.host == "127.0.0.2"
    assert pre.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.2"
    assert dec.readiness_url == "http://127.0.0.3:8200/health" and dec.side_channel == ("127.0.0.3", 5700)
    assert spec_of(px.argv).prefill == ["http://127.0.0.2:8100"]
    assert spec_of(px.argv).decode == ["http://127.0.0.3:8200"]
    assert px.host == p.get("proxy").host  # not named: stays where it was
    # Everything else is untouched, and the original plan is not modified.
    assert [a for a in pre.argv if "127.0.0" not in a] == [a for a in p.get("prefill-0").argv if "127.0.0" not in a]
    assert p.get("prefill-0").host == "127.0.0.1"


def test_slurm_batch_script_places_each_instance_and_defers_its_address_to_the_node():
    import shlex

    from pdctl.launch.slurm_engine import render_batch

    loaded = load_topology(CONFIGS / "cpu-slurm.yaml", [])
    p = build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=Path("/s"), python="python")
    script = render_batch(p, p.topology.engine, python="python")
    lines = script.splitlines()
    assert "#SBATCH --nodelist=node1,node2" in lines and "#SBATCH --partition=debug" in lines
    assert "#SBATCH --ntasks=2" in lines and "#SBATCH --no-kill" in lines
    steps = [shlex.split(line.removesuffix(" &")) for line in lines if line.startswith("srun ")]
    by_name = {next(a for a in s if a.startswith("--job-name=")).split("=")[1]: s for s in steps}
    assert set(by_name) == {"prefill-0", "decode-0"} and "--nodelist=node1" in by_name["prefill-0"]
    dec = by_name["decode-0"]
    assert "--nodelist=node2" in dec and "--output=/s/logs/decode-0.log" in dec
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST={node_addr}" in dec
    server = dec[dec.index("--") + 1 :]
    assert server[server.index("--host") + 1] == "{node_addr}" and server[server.index("--block-size") + 1] == "64"
    assert script.rstrip().endswith("wait")


def test_slurm_places_each_pool_where_its_own_placement_says():
    import shlex

    from pdctl.launch.slurm_engine import render_batch
    from pdctl.topology import Override

    d32 = {"name": "d32", "block_size": 32, "devices": [0], "placement": {"partition": "debug", "nodelist": ["node1"]}}
    d64 = {"name": "d64", "block_size": 64, "devices": [1]}  # the role's placement: node2
    loaded = load_topology(CONFIGS / "cpu-slurm.yaml", [Override(("decode",), [d64, d32], "--set decode=[...]")])
    p = build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=Path("/s"), python="python")
    steps = [shlex.split(line.removesuffix(" &")) for line in render_batch(p, p.topology.engine).splitlines()
             if line.startswith("srun ")]
    by_name = {next(a for a in s if a.startswith("--job-name=")).split("=")[1]: s for s in steps}
    assert set(by_name) == {"prefill-0", "decode-d64-0", "decode-d32-0"}
    assert "--nodelist=node2" in by_name["decode-d64-0"] and "--nodelist=node1" in by_name["decode-d32-0"]


def test_every_cpu_server_gets_calm_executor_queues_and_the_connector_never_sees_it():
    """pdctl's vLLM plugin (PDCTL_QUEUE_SPIN_S) calms vLLM's executor queues; it is not the connector's job."""
    from pdctl.protocol import QUEUE_SPIN_ENV as ENV
    from pdctl.topology import Override

    def extra(p):
        d = p.get("decode-0")
        return json.loads(d.argv[d.argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]["pdctl"]

    p = _plan()
    assert {s.name: s.env.get(ENV) for s in p.processes} == {"prefill-0": "0", "decode-0": "0", "proxy": None}
    assert "worker_spin_s" not in extra(p)
    stock = _plan(overrides=[Override(("connector", "kind"), "nixl", "--set connector.kind=nixl")])
    assert stock.get("prefill-0").env[ENV] == "0"  # not KV-transfer logic: the stock connector's servers too


def test_queue_calming_off_cpu_is_vllms_own():
    loaded = load_topology(CONFIGS / "qwen3-0.6b-cuda-d64-tp2.yaml")
    p = build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=REPO / ".pdctl" / "x", python="py")
    assert all("PDCTL_QUEUE_SPIN_S" not in s.env for s in p.processes)  # vLLM's own 1 s spin off CPU


def test_reference_is_calmed_like_the_pd_servers():
    from pdctl.plan import reference_spec

    loaded = load_topology(CONFIGS / "cpu-demo.yaml")
    ref = reference_spec(loaded.topology, base_dir=loaded.base_dir, state_dir=REPO / ".pdctl" / "x", port=8300)
    assert ref.env["PDCTL_QUEUE_SPIN_S"] == "0" and not any(k.startswith("VLLM_NIXL_") for k in ref.env)


# -- fleets: several pools per role ------------------------------------------------------------------------------


def _fleet(*sets: str):
    from pdctl.topology import Override

    loaded = load_topology(CONFIGS / "cpu-fleet.yaml", [Override.parse_set(s) for s in sets])
    return loaded.topology, build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=Path("/s"))


def test_fleet_instances_are_named_by_pool_with_ports_that_never_collide():
    _, p = _fleet()
    servers = [s for s in p.processes if s.role != "proxy"]
    assert [s.name for s in servers] == ["prefill-p32-0", "prefill-p128-0", "decode-d64-0", "decode-d32-0"]
    assert [s.ports["http"] for s in servers] == [8100, 8101, 8200, 8201]
    assert [s.ports["side_channel"] for s in servers] == [5600, 5601, 5700, 5701]
    assert [s.pool for s in servers] == ["p32", "p128", "d64", "d32"]
    assert p.get("decode-d32-0").log_path == "/s/logs/decode-d32-0.log"


def test_fleet_count_2_pools_get_consecutive_ranges():
    _, p = _fleet("prefill.p32.count=2", "prefill.p32.devices=[0,1]")
    assert [s.ports["http"] for s in p.by_role("prefill")] == [8100, 8101, 8102]
    assert [s.name for s in p.by_role("prefill")] == ["prefill-p32-0", "prefill-p32-1", "prefill-p128-0"]


def _pdctl_extra(spec):
    cfg = json.loads(spec.argv[spec.argv.index("--kv-transfer-config") + 1])
    return cfg, cfg["kv_connector_extra_config"]["pdctl"]


def test_staging_is_sized_for_the_largest_ratio_that_reaches_each_decode_pool():
    t, p = _fleet()
    assert _pdctl_extra(p.get("decode-d64-0"))[1]["staging_blocks"] == 32  # 128 -> 64: ratio 2
    assert _pdctl_extra(p.get("decode-d32-0"))[1]["staging_blocks"] == 96  # 128 -> 32: ratio 4
    assert _pdctl_extra(p.get("prefill-p128-0"))[1]["staging_blocks"] == 0
    _, p = _fleet("proxy.exclude_pairs=[[p128, d32]]")  # only 32 -> 32 reaches d32 now
    assert _pdctl_extra(p.get("decode-d32-0"))[1]["staging_blocks"] == 0


def test_fleet_proxy_spec_names_pools_weights_and_excluded_pairs():
    _, p = _fleet("proxy.exclude_pairs=[[p128, d32]]", "decode.d64.weight=2", "proxy.policy=prefix_affinity",
                  "proxy.affinity_epsilon=0.5")
    argv = p.get("proxy").argv
    assert argv[1:5] == ["-m", "pdctl", "proxy", "--spec"] and len(argv) == 6  # one argument: the whole of it
    cfg = spec_of(argv)
    assert cfg.prefill[0] == "p32=http://127.0.0.1:8100" and "d32=http://127.0.0.1:8201" in cfg.decode
    assert cfg.weights == {"decode/d64": 2.0} and cfg.exclude_pairs == [("p128", "d32")]
    assert cfg.policy == "prefix_affinity" and cfg.affinity_epsilon == 0.5
    assert '"affinity_prefix_chars"' not in argv[5]  # a default is not written: the model holds it


def test_kv_buffer_device_per_pool():
    loaded = load_topology(CONFIGS / "cuda-gaudi-fleet.yaml")
    p = build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=Path("/s"))
    bufs = {s.name: _pdctl_extra(s)[0]["kv_buffer_device"] for s in p.processes if s.role != "proxy"}
    assert bufs == {"prefill-cuda16-0": "cuda", "prefill-cuda16-1": "cuda", "prefill-gaudi128-0": "cpu",
                    "decode-gaudi128-0": "cpu", "decode-gaudi128-1": "cpu", "decode-cuda16-0": "cuda"}
    # Gaudi decodes receive from block-128 prefills only at ratio 1; the CUDA decode from Gaudi's 128 at 8.
    assert _pdctl_extra(p.get("decode-cuda16-0"))[1]["staging_blocks"] == 32 * 7
    assert {_pdctl_extra(p.get(f"decode-gaudi128-{i}"))[1]["staging_blocks"] for i in (0, 1)} == {0}


def test_select_processes_by_instance_role_pool_and_index():
    from pdctl.plan import select

    _, p = _fleet("prefill.p32.count=2", "prefill.p32.devices=[0,1]")
    names = lambda which: [s.name for s in select(p, which)]  # noqa: E731
    assert names("decode-d32-0") == ["decode-d32-0"]
    assert names("prefill/p32") == ["prefill-p32-0", "prefill-p32-1"]
    assert names("prefill/0") == ["prefill-p32-0", "prefill-p128-0"]
    assert names("prefill/p32/1") == ["prefill-p32-1"] and names("proxy") == ["proxy"] and names("x") == []



def test_a_pools_nice_reaches_its_own_instances_only_and_reads_back():
    from pdctl.plan import Plan

    t, p = _fleet("decode.d64.nice=10")
    assert {s.name: s.nice for s in p.processes} == {
        "prefill-p32-0": 0, "prefill-p128-0": 0, "decode-d64-0": 10, "decode-d32-0": 0, "proxy": 0}
    d = p.to_dict()
    assert [s.get("nice") for s in d["processes"]] == [None, None, 10, None, None]  # left out at 0
    assert [g.get("nice") for g in d["topology"]["decode"]] == [10, None]
    assert Plan.from_dict(json.loads(p.to_json())).get("decode-d64-0").nice == 10
    _, plain = _fleet()
    assert "nice" not in plain.to_json()  # negative control: plans without it read as before the field existed


def test_plan_shows_a_nice_as_the_command_that_runs(run_cli):
    code, out, _ = run_cli("plan", CONFIGS / "cpu-demo.yaml", "--set", "decode.nice=10")
    assert code == 0 and out.count("nice -n 10 ") == 1
    assert "nice -n" not in run_cli("plan", CONFIGS / "cpu-demo.yaml")[1]


def test_nice_out_of_range_is_refused_with_its_place(run_cli, tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text((CONFIGS / "cpu-demo.yaml").read_text().replace(
        "  block_size: 64\n", "  block_size: 64\n  nice: 25\n").replace("../.pdctl", str(REPO / ".pdctl")))
    code, out, err = run_cli("validate", f)
    line = f.read_text().splitlines().index("  nice: 25") + 1
    assert code != 0 and f"{f}:{line}: decode.nice" in out + err and "less than or equal to 19" in out + err
    code, out, err = run_cli("validate", f, "--set", "decode.nice=-20")
    assert code == 0 and "nice -20" in out  # the lowest niceness is valid (the host may refuse it at launch)
    for bad in ("true", '"10"', "10.5"):  # no silent coercion (true would be nice +1)
        code, out, err = run_cli("validate", f, "--set", f"decode.nice={bad}")
        assert code != 0 and "decode.nice: Input should be a valid integer" in out + err, bad


def test_slurm_step_runs_at_its_pools_nice():
    import shlex

    from pdctl.launch.slurm_engine import render_batch

    loaded = load_topology(CONFIGS / "cpu-slurm.yaml", [Override.parse_set("decode.nice=5")])
    p = build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=Path("/s"), python="python")
    steps = {s[s.index("--job-name=decode-0") if "--job-name=decode-0" in s else 0]: s
             for s in (shlex.split(x.removesuffix(" &")) for x in render_batch(p, p.topology.engine).splitlines()
                       if x.startswith("srun "))}
    dec, pre = steps["--job-name=decode-0"], steps["srun"]
    step = dec.index("pdctl.launch.slurm_step")
    assert dec[step + 1 : step + 4] == ["--nice", "5", "--"]
    assert "--nice" not in pre  # the prefill's pool has none


def test_slurm_step_adds_the_nice_before_it_becomes_the_server(monkeypatch):
    from pdctl.launch import slurm_step

    calls = []
    monkeypatch.setattr(slurm_step, "node_addr", lambda: "10.0.0.2")
    monkeypatch.setattr(slurm_step.os, "nice", lambda n: calls.append(("nice", n)))
    monkeypatch.setattr(slurm_step.os, "execvp", lambda f, a: calls.append(("exec", a)))
    monkeypatch.setattr(slurm_step.os, "setpgrp", lambda: None)
    slurm_step.main(["--nice", "-3", "--", "serve", "--host", "{node_addr}"])
    assert calls == [("nice", -3), ("exec", ["serve", "--host", "10.0.0.2"])]
    calls.clear()
    slurm_step.main(["--", "serve"])
    assert calls == [("exec", ["serve"])]  # negative control: no --nice, niceness untouched
    calls.clear()
    assert slurm_step.main(["--nice", "x", "--", "serve"]) == 2 and calls == []  # a usage error, nothing run


def test_with_hosts_moves_every_named_pools_upstream_of_a_fleets_proxy():
    """A fleet's proxy names its upstreams POOL=URL: each follows its instance to its node (a fleet on Ray or
    Slurm must not keep its proxy pointed at the addresses from before placement)."""
    _, p = _fleet()
    hosts = {s.name: f"127.0.0.{i + 2}" for i, s in enumerate(p.processes) if s.role in ("prefill", "decode")}
    q = p.with_hosts(hosts)
    cfg = spec_of(q.get("proxy").argv)
    ups = cfg.prefill + cfg.decode
    want = [f"{s.pool}={s.http_url}" for s in q.processes if s.role in ("prefill", "decode")]
    assert ups == want and len(ups) == 4
    assert all("127.0.0.1" not in u for u in ups)  # negative control: before the move, every one was on 127.0.0.1
    before = spec_of(p.get("proxy").argv)
    assert all("127.0.0.1" in u for u in before.prefill + before.decode)


# UCX per placement: shared-memory lanes on one host with KV in host memory, UCX's own choice elsewhere.
def test_servers_on_one_host_with_host_memory_kv_get_shared_memory_ucx_lanes():
    from pdctl.topology.transport import UCX_ONE_HOST

    p = _plan()
    for s in p.processes:
        if s.role in ("prefill", "decode"):
            assert {k: s.env.get(k) for k in UCX_ONE_HOST} == UCX_ONE_HOST, s.name
            assert "UCX_TCP_CONN_NB" not in s.env
    assert not any(k.startswith("UCX_") for k in p.get("proxy").env)


@pytest.mark.parametrize("sets", [("engine.kind=ray", "engine.address=10.0.0.1:6379"), ("engine.kind=slurm",)])
def test_servers_of_a_cluster_engine_keep_ucxs_transports_with_non_blocking_tcp_connects(sets):
    p = _plan(overrides=[Override.parse_set(x) for x in sets])
    for s in p.processes:
        if s.role in ("prefill", "decode"):
            assert s.env["UCX_TCP_CONN_NB"] == "y" and "UCX_TLS" not in s.env, s.name


def test_device_memory_kv_on_one_host_keeps_ucxs_device_transports():
    p = _plan("qwen3-0.6b-cuda-d64-tp2")
    servers = [s for s in p.processes if s.role in ("prefill", "decode")]
    assert servers and all("UCX_TLS" not in s.env and s.env["UCX_TCP_CONN_NB"] == "y" for s in servers)


def test_a_pools_env_overrides_pdctls_ucx_settings_and_the_reference_gets_none():
    from pdctl.plan import reference_spec

    loaded = load_topology(CONFIGS / "cpu-demo.yaml", [Override.parse_set('decode.env={"UCX_TLS": "tcp,self"}')])
    p = build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=Path("/s"), python="py")
    assert p.get("decode-0").env["UCX_TLS"] == "tcp,self" and p.get("prefill-0").env["UCX_TLS"] == "posix,cma,self"
    ref = reference_spec(loaded.topology, base_dir=loaded.base_dir, state_dir=Path("/s"), port=8300)
    assert not any(k.startswith("UCX_") for k in ref.env)


def test_the_baseline_serves_aggregated_on_every_pd_instances_devices_behind_pdctls_proxy_without_prefills():
    from pdctl.plan import baseline_plan

    loaded = load_topology(CONFIGS / "cpu-demo.yaml")
    t = loaded.topology
    pd = build_plan(t, base_dir=loaded.base_dir, state_dir=Path("/s"), python="py")
    b = baseline_plan(t, base_dir=loaded.base_dir, state_dir=Path("/s"), python="py")
    servers = [s for s in b.processes if s.role == "baseline"]
    assert [s.name for s in servers] == ["baseline-prefill-0", "baseline-decode-0"]
    for s, twin in zip(servers, pd.by_role("prefill") + pd.by_role("decode"), strict=True):
        assert s.env["VLLM_CPU_OMP_THREADS_BIND"] == twin.env["VLLM_CPU_OMP_THREADS_BIND"]  # the same cores
        assert "--kv-transfer-config" not in s.argv and s.ports["http"] == twin.ports["http"] + 1000  # beside it
        assert s.argv[s.argv.index("--block-size") + 1] == str(twin.block_size)
        assert not any(k.startswith(("UCX_", "VLLM_NIXL_")) for k in s.env)
    (router,) = [s for s in b.processes if s.role == "proxy"]
    assert router.ports["http"] == pd.get("proxy").ports["http"] + 1000
    cfg = spec_of(router.argv)
    assert cfg.policy == t.proxy.policy  # the topology's routing
    assert cfg.decode == [s.http_url for s in servers] and cfg.prefill == [] and router.argv[2:4] == ["pdctl", "proxy"]


def test_a_topology_moved_to_other_ports_listens_on_none_of_the_firsts_and_keeps_everything_else():
    from pdctl.plan import _ports

    loaded = load_topology(CONFIGS / "cpu-router.yaml", [Override.parse_set("monitoring.enabled=true")])
    t = loaded.topology
    moved = t.ports_moved(1000)
    assert sorted(_ports(moved)) == sorted(p + 1000 for p in _ports(t)) and not set(_ports(moved)) & set(_ports(t))
    assert moved.proxy.router_metrics_port == t.proxy.router_metrics_port + 1000
    assert moved.origin is t.origin and moved.model == t.model and moved.decode[0].block_size == t.decode[0].block_size
    p, q = (build_plan(x, base_dir=loaded.base_dir, state_dir=Path("/s"), python="py") for x in (t, moved))
    busy = {port for s in p.processes for port in s.ports.values()}
    assert busy and not busy & {port for s in q.processes for port in s.ports.values()}
    # Near the top of the port range the baseline moves down instead.
    from pdctl.plan import baseline_plan

    high = load_topology(CONFIGS / "cpu-demo.yaml", [Override.parse_set("proxy.port=65000")]).topology
    b = baseline_plan(high, base_dir=loaded.base_dir, state_dir=Path("/s"), python="py")
    assert b.get("baseline-proxy").ports["http"] == 64000


def test_a_fleets_baseline_has_one_aggregated_server_per_instance():
    from pdctl.plan import baseline_plan

    t, p = _fleet()
    b = baseline_plan(t, base_dir=CONFIGS, state_dir=Path("/s"))
    assert len([s for s in b.processes if s.role == "baseline"]) == len(p.by_role("prefill") + p.by_role("decode"))


def test_the_baseline_of_cuda_to_gaudi_serves_aggregated_on_both_kinds_of_device(run_cli):
    """Goodput's baseline for a CUDA prefill -> Gaudi decode topology: an aggregated server on the CUDA devices and
    one on the Gaudi devices (each with its pool's platform, device visibility and block size), no connector."""
    code, out, err = run_cli("plan", CONFIGS / "cuda-to-gaudi.yaml", "--baseline", "--json", "--state-dir",
                             "/tmp/pdctl-golden")
    assert code == 0, err
    got = _normalized(out)
    _check_golden(got, "cuda-to-gaudi.baseline.plan.json")
    servers = [p for p in got["processes"] if p["role"] == "baseline"]
    assert sorted(p["platform"] for p in servers) == ["cuda", "hpu"]
    assert all("--kv-transfer-config" not in p["argv"] for p in servers)
    assert any("CUDA_VISIBLE_DEVICES" in p["env"] for p in servers)
    assert any("HABANA_VISIBLE_MODULES" in p["env"] for p in servers)


def test_a_cpu_prefill_batches_4096_tokens_unless_its_pool_says_otherwise():
    def batched(plan, name):
        argv = plan.get(name).argv
        return [argv[i + 1] for i, a in enumerate(argv) if a == "--max-num-batched-tokens"]

    p = _plan()
    assert batched(p, "prefill-0") == ["4096"] and batched(p, "decode-0") == []  # the decode keeps vLLM's
    own = _plan(overrides=[Override.parse_set("prefill.extra_args=[--max-num-batched-tokens,'1024']")])
    assert batched(own, "prefill-0") == ["1024"]  # negative control: the pool's own flag, once
    eq = _plan(overrides=[Override.parse_set("prefill.extra_args=[--max-num-batched-tokens=1024]")])
    assert "--max-num-batched-tokens" not in eq.get("prefill-0").argv  # given as --flag=V: not added again
    from pdctl.plan import baseline_plan

    loaded = load_topology(CONFIGS / "cpu-demo.yaml")
    base = baseline_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=REPO / ".pdctl" / "x", python="py")
    assert all("--max-num-batched-tokens" not in s.argv for s in base.processes)  # the baseline: vLLM's default
