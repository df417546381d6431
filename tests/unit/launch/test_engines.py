"""Engine selection and Ray placement options, without a cluster (the e2e tests run real ones)."""

import inspect
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pdctl.launch import engine_for, engine_of
from pdctl.launch.engine import Engine, RestartableEngine
from pdctl.launch.local import LocalEngine
from pdctl.launch.ray_engine import RayEngine
from pdctl.launch.slurm_engine import SlurmEngine
from pdctl.launch.state import LaunchState
from pdctl.plan import build_plan
from pdctl.topology import EngineSpec, Override, Placement, load_topology
from tests.conftest import CONFIGS


def test_engine_for_each_engine_kind():
    assert engine_for(None).name == "local" and engine_for(EngineSpec(kind="local")).name == "local"
    assert engine_for(EngineSpec(kind="ray", address="127.0.0.2:6390")).name == "ray"
    assert engine_for(EngineSpec(kind="slurm")).name == "slurm"


@pytest.mark.parametrize("cls", [LocalEngine, RayEngine, SlurmEngine])
def test_every_engine_implements_the_whole_interface(cls):
    """No abstract method left, and none answered with NotImplementedError: Ray and Slurm launch a plan as a
    whole and are not restartable (the supervisor never asks them to start or stop one instance)."""
    assert not cls.__abstractmethods__ and issubclass(cls, Engine)
    assert issubclass(cls, RestartableEngine) == cls.restartable == (cls is LocalEngine)
    assert "NotImplementedError" not in inspect.getsource(inspect.getmodule(cls))


def test_importing_the_launch_package_imports_no_engine():
    """engine_for imports the engine it picks: `import pdctl.launch` stays cheap (no ray, no process spawning)."""
    code = ("import sys, pdctl.launch; "
            "print(sorted(m for m in sys.modules if m.endswith(('_engine', '.local')) or m == 'ray'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_engine_of_a_state_reads_its_recorded_kind_also_under_the_older_key():
    loaded = load_topology(CONFIGS / "cpu-ray.yaml", [])
    plan = build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=Path("/s"))
    state = LaunchState(plan, engine_kind="slurm")
    assert engine_of(LaunchState.from_json(state.to_json())).name == "slurm"
    older = json.loads(state.to_json())
    older["backend"] = older.pop("engine_kind")  # a state file an earlier pdctl wrote
    assert engine_of(LaunchState.from_json(json.dumps(older))).name == "slurm"


def test_engine_set_overrides_the_topology():
    assert load_topology(CONFIGS / "cpu-demo.yaml", []).topology.engine.kind == "local"
    o = [Override.parse_set("engine.kind=ray"), Override.parse_set("engine.address=10.0.0.1:6379")]
    t = load_topology(CONFIGS / "cpu-demo.yaml", o).topology
    assert (t.engine.kind, t.engine.address) == ("ray", "10.0.0.1:6379")


def test_ray_actor_options_follow_the_placement():
    loaded = load_topology(CONFIGS / "cpu-ray.yaml", [])
    plan = build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=Path("/s"))
    e = plan.topology.engine
    spec = e.model_copy(update={"placement": {
        **e.placement, "decode": Placement(labels={"accelerator": "gaudi3"}, node="10.0.0.7")}})
    plan = replace(plan, topology=plan.topology.model_copy(update={"engine": spec}))
    ray = engine_for(spec)
    pre = ray._options(plan, plan.get("prefill-0"))
    assert pre["name"] == "prefill-0" and pre["lifetime"] == "detached" and pre["num_cpus"] == 0
    assert pre["resources"] == {"prefill_node": 0.01}  # marks the node kind, does not count instances
    dec = ray._options(plan, plan.get("decode-0"))
    assert dec["label_selector"] == {"accelerator": "gaudi3"} and dec["resources"] == {"node:10.0.0.7": 0.001}
    # The proxy stays where pdctl runs unless placed.
    assert ray._on_ray(plan.get("decode-0")) and not ray._on_ray(plan.get("proxy"))
    placed = engine_for(spec.model_copy(update={"placement": {"proxy": Placement(resources={"cpu_node": 1})}}))
    assert placed._on_ray(plan.get("proxy"))


def test_a_pools_own_placement_wins_over_its_roles():
    o = [Override.parse_set('decode={"name": "d64", "block_size": 64, "devices": [1], '
                            '"placement": {"resources": {"gaudi_node": 1}}}')]
    loaded = load_topology(CONFIGS / "cpu-ray.yaml", o)
    plan = build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=Path("/s"))
    ray = engine_for(plan.topology.engine)
    assert ray._options(plan, plan.get("decode-d64-0"))["resources"] == {"gaudi_node": 0.01}
    assert ray._options(plan, plan.get("prefill-0"))["resources"] == {"prefill_node": 0.01}


def test_local_preflight_refuses_a_negative_nice_the_host_will_not_grant(monkeypatch):
    from pdctl.launch import local
    from pdctl.topology import Override, load_topology

    def plan(nice: int):
        loaded = load_topology(CONFIGS / "cpu-fleet.yaml", [Override.parse_set(f"decode.d32.nice={nice}")])
        return build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=Path("/s"))

    monkeypatch.setattr(local.os, "getpriority", lambda *_: 0)
    asked = []
    monkeypatch.setattr(local, "may_lower_niceness_to", lambda target: asked.append(target) or False)
    [problem] = local.nice_problems(plan(-5))
    assert problem.startswith("decode-d32-0: nice -5 (pool d32) would lower the niceness to -5")
    assert "CAP_SYS_NICE or RLIMIT_NICE >= 25" in problem and asked == [-5]
    assert local.nice_problems(plan(10)) == [] and asked == [-5]  # raising it needs no privilege
    monkeypatch.setattr(local, "may_lower_niceness_to", lambda target: True)
    assert local.nice_problems(plan(-5)) == []  # negative control: a host that grants it


def test_may_lower_niceness_reads_the_capability_and_the_limit(monkeypatch, tmp_path):
    from pdctl.launch import local

    status = tmp_path / "status"
    real_path = local.Path
    monkeypatch.setattr(local, "Path", lambda p: status if p == "/proc/self/status" else real_path(p))
    monkeypatch.setattr(local.resource, "getrlimit", lambda _r: (25, 25))  # lowest niceness allowed: -5
    status.write_text("CapEff:\t0000000000000000\n")
    assert local.may_lower_niceness_to(-5) and not local.may_lower_niceness_to(-6)
    status.write_text("CapEff:\t0000000000800000\n")  # bit 23: CAP_SYS_NICE
    assert local.may_lower_niceness_to(-20)


def test_ray_instance_actor_says_when_the_guard_refused_to_start_the_server(tmp_path, monkeypatch):
    # The guard refuses before it detaches (a nice the node will not grant): no pid on its stdout. The actor
    # answers with the reason and the log's end, which the engine raises as LaunchFailed (not a traceback).
    from pdctl.launch import ray_engine

    actor_cls = ray_engine.InstanceActor.__ray_metadata__.modified_class
    actor = object.__new__(actor_cls)
    actor.name, actor.pgid, actor.log_path = "decode-0", None, None
    monkeypatch.setattr(actor_cls, "node_ip", lambda self: "10.0.0.5")
    monkeypatch.setattr(ray_engine, "guarded", lambda argv, **kw: [
        sys.executable, "-c", "import sys; print('--- pdctl guard: server not started: no', file=sys.stderr); "
        "sys.exit(1)"])
    got = actor.start(["serve"], {}, str(tmp_path / "d.log"), nice=-5)
    assert got["error"].startswith("the guard did not start the server (exit 1") and "10.0.0.5" in got["error"]
    assert got["log"][-1] == "--- pdctl guard: server not started: no"
    monkeypatch.setattr(ray_engine, "guarded", lambda argv, **kw: [sys.executable, "-c", "print(4242)"])
    ok = actor.start(["serve"], {}, str(tmp_path / "d.log"))
    assert ok["pid"] == 4242 and "error" not in ok  # negative control: the guard printed its pid
