"""proxy.kind: vllm-router — the topology's refusals, the router's command line, the unpinned check's proof."""

from pathlib import Path

import pytest

from pdctl.gates.fleet import ROUTER_ID, UnpinnedReport, per_decode_problems
from pdctl.gates.parity import PromptResult, TransferProof
from pdctl.plan import ROUTER_MODULE, build_plan
from pdctl.topology import ModelInfo, Topology, compatibility_problems


def topo(proxy=None, **pools):
    base = {"name": "t", "model": {"path": "m/m"}, "prefill": {"block_size": 32, "devices": [0]},
            "decode": {"block_size": 64, "devices": [1]}, "proxy": {"kind": "vllm-router", **(proxy or {})}}
    base.update(pools)
    return Topology.model_validate(base)


def errors(t):
    return [(".".join(map(str, p.path)), p.message) for p in compatibility_problems(t, ModelInfo())
            if p.severity == "error"]


def argv(t):
    proxy = build_plan(t, base_dir=Path("/b"), state_dir=Path("/s"), python="py").get("proxy")
    return proxy, proxy.argv


def flag(args, name):
    return args[args.index(name) + 1]


def test_the_router_runs_in_vllm_pd_mode_over_every_instance_with_its_metrics_on_port_plus_one():
    t = topo(prefill=[{"name": "a", "block_size": 32, "count": 2}, {"name": "b", "block_size": 128}],
             decode=[{"name": "d", "block_size": 64, "count": 2}])
    proxy, args = argv(t)
    assert args[:3] == ["py", "-m", ROUTER_MODULE] and "--vllm-pd-disaggregation" in args
    assert flag(args, "--kv-connector") == "nixl" and flag(args, "--port") == "8000"
    assert flag(args, "--prometheus-port") == "8001" and proxy.ports == {"http": 8000, "metrics": 8001}
    prefills = [args[i + 1] for i, a in enumerate(args) if a == "--prefill"]
    decodes = [args[i + 1] for i, a in enumerate(args) if a == "--decode"]
    assert len(prefills) == 3 and len(decodes) == 2 and all(u.startswith("http://127.0.0.1:") for u in prefills)
    assert proxy.env.get("NO_COLOR") == "1"
    assert errors(t) == []


@pytest.mark.parametrize("policy,theirs", [("round_robin", "round_robin"), ("prefix_affinity", "cache_aware"),
                                           ("least_outstanding", "power_of_two")])
def test_policies_map_onto_the_routers(policy, theirs):
    assert flag(argv(topo({"policy": policy}))[1], "--policy") == theirs


def test_breaker_and_timeout_map_onto_its_flags():
    args = argv(topo({"breaker_failures": 7, "breaker_open_s": 4.4, "first_byte_timeout_s": 90}))[1]
    assert (flag(args, "--cb-failure-threshold"), flag(args, "--cb-timeout-duration-secs"),
            flag(args, "--request-timeout-secs")) == ("7", "4", "90")


@pytest.mark.parametrize("proxy,field", [
    ({"exclude_pairs": [["default", "default"]]}, "proxy.exclude_pairs"),
    ({"read_timeout_s": 5}, "proxy.read_timeout_s"),
    ({"connect_timeout_s": 5}, "proxy.connect_timeout_s"),
    ({"affinity_epsilon": 1.0}, "proxy.affinity_epsilon"),
    ({"on_prefill_down": "fallback"}, "proxy.on_prefill_down"),
])
def test_what_the_router_cannot_do_is_refused_by_field(proxy, field):
    assert any(path == field and "vllm-router" in msg for path, msg in errors(topo(proxy)))


def test_a_weighted_pool_is_refused_and_the_gates_reject_setting_is_not():
    t = topo(prefill={"block_size": 32, "weight": 2.0})
    assert [p for p, _ in errors(t)] == ["prefill.0.weight"]
    assert errors(topo({"on_prefill_down": "reject", "read_timeout_s": 600.0})) == []  # defaults' values pass


def test_metrics_port_belongs_to_the_router_and_must_not_collide():
    pdctl = Topology.model_validate({"name": "t", "model": {"path": "m/m"}, "prefill": {"block_size": 32},
                                     "decode": {"block_size": 64}, "proxy": {"metrics_port": 9000}})
    assert [p for p, _ in errors(pdctl)] == ["proxy.metrics_port"]
    clash = topo({"metrics_port": 8200}, decode={"block_size": 64, "http_port": 8200})
    assert any(p == "proxy.metrics_port" and "also used" in m for p, m in errors(clash))
    # Ports left out are assigned around it.
    assert build_plan(topo({"metrics_port": 8100}), base_dir=Path("/b"), state_dir=Path("/s")).get(
        "prefill-0").ports["http"] != 8100


def test_the_routers_request_id_names_the_instances_it_chose():
    m = ROUTER_ID.search("cmpl-___prefill_addr_127.0.0.1:8100___decode_addr_127.0.0.1:8200_"
                         "f17ee5c2b9a347328b07ffc8e041ea8a")
    assert m and m.groups() == ("127.0.0.1:8100", "127.0.0.1:8200")
    assert ROUTER_ID.search("cmpl-pdctl-check-0123") is None


def grown(external=0.0, local=0.0, cache_hit=0.0, failed=0.0):
    return {"external": external, "local": local, "cache_hit": cache_hit, "bytes": external * 1024,
            "failed": failed, "requests": 1}


def test_each_decode_that_served_must_have_received_kv():
    assert per_decode_problems({"decode-0": grown(external=300, local=3), "decode-1": grown()}) == []
    bad = per_decode_problems({"decode-0": grown(external=300, local=3), "decode-1": grown(local=200)})
    assert bad == ["decode-1: served 200 prompt tokens, none by KV transfer"]  # negative control
    assert per_decode_problems({"decode-0": grown(external=300, failed=1)}) == ["decode-0: 1 NIXL transfers failed"]


def test_an_unpinned_report_fails_on_a_per_decode_problem_and_says_it_was_unpinned():
    proof = TransferProof(200, 2, 2048, 202, requests=2)
    results = [PromptResult("random-101", 101, True, None, [1], [1])]
    good = UnpinnedReport(results, proof, {"decode-0": grown(external=200)}, [])
    assert good.passed and good.to_dict()["pinned"] is False and "per decode instance" in good.to_dict()["note"]
    assert not UnpinnedReport(results, proof, {}, ["decode-1: served 5 prompt tokens, none by KV transfer"]).passed
