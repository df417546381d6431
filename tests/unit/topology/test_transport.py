"""pdctl.topology.transport: the UCX settings each pool's servers get for where its pairs run, what a pool's own
`env` may not turn them into (refused before launch, naming the field), the read timeout the lease must hold, and
UCX_NET_DEVICES from the topology."""

from pathlib import Path

import pytest

from pdctl.plan import build_plan
from pdctl.topology import ModelInfo, Topology, compatibility_problems
from pdctl.topology.transport import UCX_ACROSS_HOSTS, UCX_ONE_HOST, pool_ucx, transport_env, ucx_problem


def topo(engine: str = "local", **kw) -> Topology:
    base = {"name": "t", "model": {"path": "m/m"}, "prefill": {"block_size": 32, "devices": [0]},
            "decode": {"block_size": 64, "devices": [1]}, "engine": {"kind": engine}}
    if engine == "ray":
        base["engine"]["address"] = "10.0.0.1:6379"
    for k, v in kw.items():
        section, _, key = k.partition("__")
        base.setdefault(section, {})[key] = v
    return Topology.model_validate(base)


def problems(t: Topology) -> list:
    return [p for p in compatibility_problems(t, ModelInfo()) if p.severity == "error"]


def test_one_host_gets_shared_memory_lanes_a_cluster_the_across_hosts_set():
    assert transport_env(topo()) == UCX_ONE_HOST
    assert transport_env(topo("ray")) == UCX_ACROSS_HOSTS
    assert transport_env(topo(connector__kv_buffer_device="cuda")) == UCX_ACROSS_HOSTS  # device memory


@pytest.mark.parametrize("env, crosses, why", [
    ({"UCX_TLS": "posix,cma,self", "UCX_MM_ERROR_HANDLING": "y"}, False, None),
    ({"UCX_TLS": "tcp,self"}, True, None),
    ({"UCX_TLS": "^tcp"}, True, None),  # an exclusion list: UCX decides
    ({"UCX_TLS": "all"}, True, None),
    ({"UCX_TLS": "posix,cma,self", "UCX_MM_ERROR_HANDLING": "y"}, True, "only transports within one host"),
    ({"UCX_TLS": "sm,self"}, False, "UCX_MM_ERROR_HANDLING=y"),
    ({"UCX_TLS": "cma,self"}, False, "no transport for NIXL's notifications"),
])
def test_ucx_settings_that_cannot_carry_nixl_are_said(env, crosses, why):
    found = ucx_problem(env, crosses)
    assert (found is None) if why is None else (why in found[0])


def test_a_pools_env_that_breaks_the_transfer_is_refused_before_launch_naming_it():
    # pdctl's one-host set allows shared memory (UCX_MM_ERROR_HANDLING=y); a pool that takes that back cannot run
    assert not [p for p in problems(topo(decode__env={"UCX_TLS": "sm,self"})) if "UCX" in p.message]
    t = topo(decode__env={"UCX_TLS": "sm,self", "UCX_MM_ERROR_HANDLING": "n"})
    (p,) = [p for p in problems(t) if "UCX" in p.message]
    assert p.path == ("decode", 0, "env", "UCX_TLS") and "no peer failure handler" in p.message
    assert "UCX_MM_ERROR_HANDLING=y" in p.hint
    # the same list on a cluster engine cannot reach the other hosts
    t = topo("ray", decode__env={"UCX_TLS": "posix,cma,self", "UCX_MM_ERROR_HANDLING": "y"})
    assert any("pairs cross hosts" in p.message for p in problems(t))
    # control: pdctl's own one-host settings, and a TCP lane added by the user, pass
    assert not [p for p in problems(topo()) if "UCX" in p.message]
    assert not [p for p in problems(topo(decode__env={"UCX_TLS": "tcp,posix,cma,self"})) if "UCX" in p.message]


def test_net_devices_reach_the_servers_environment_and_nothing_else_does():
    t = topo("ray", decode__net_devices="mlx5_0:1,mlx5_1:1")
    assert pool_ucx(t, t.pools("decode")[0])["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_1:1"
    plan = build_plan(t, base_dir=Path("."), state_dir=Path("/tmp/t"), python="python")
    assert plan.get("decode-0").env["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_1:1"
    assert "UCX_NET_DEVICES" not in plan.get("prefill-0").env  # unset: UCX picks
    with pytest.raises(ValueError, match="net_devices"):
        topo(decode__net_devices="mlx5_0:1; rm -rf /")


def test_a_read_timeout_the_kv_lease_cannot_hold_is_refused():
    (p,) = [p for p in problems(topo(connector__kv_read_timeout_s=20)) if "lease" in p.message]
    assert p.path == ("connector", "kv_read_timeout_s") and "at most 14 s" in p.message
    ok = topo(connector__kv_read_timeout_s=20, connector__extra_config={"kv_lease_duration": 120})
    assert not [p for p in problems(ok) if "lease" in p.message]
    assert not [p for p in problems(topo()) if "lease" in p.message]  # the defaults fit
    bad = topo(connector__extra_config={"kv_lease_duration": "soon"})
    assert any(p.path == ("connector", "extra_config", "kv_lease_duration") for p in problems(bad))


def test_pdctl_settings_in_extra_config_must_be_ones_the_connector_reads():
    ok = topo(connector__extra_config={"pdctl": {"progress_delay_us": 200}})
    assert not [p for p in problems(ok) if "pdctl" in p.path]
    (p,) = problems(topo(connector__extra_config={"pdctl": {"pin_transfer_thread": True}}))
    assert p.path == ("connector", "extra_config", "pdctl", "pin_transfer_thread") and "unknown setting" in p.message
    (p,) = problems(topo(connector__extra_config={"pdctl": {"trace": "yes"}}))
    assert p.path == ("connector", "extra_config", "pdctl", "trace") and "'yes' is not true or false" in p.message
    (p,) = problems(topo(connector__extra_config={"pdctl": 3}))
    assert p.path == ("connector", "extra_config", "pdctl") and "a mapping" in p.message
    assert not problems(topo(connector__kind="nixl", connector__extra_config={"pdctl": {"x": 1}}))  # not read
