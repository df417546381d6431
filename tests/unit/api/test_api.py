"""pdctl's Python API before anything starts: names at the package root, overrides in every form, plans with a
reference, and bad input as UserError (never a traceback). Bring-ups are e2e (tests/e2e/test_api.py)."""

import subprocess
import sys

import pytest

import pdctl
from pdctl import api
from pdctl.bench.options import BenchOptions
from pdctl.topology import Override, TopologyError
from tests.conftest import CONFIGS


def test_the_api_is_at_the_package_root_and_plan_and_bench_are_still_modules_too():
    import pdctl.bench.sweep as sweep_mod
    import pdctl.plan as _  # noqa: F401 (the submodule import must not shadow the function)

    t = pdctl.load(CONFIGS / "cpu-demo.yaml")
    assert [s.name for s in pdctl.plan(t).processes] == ["prefill-0", "decode-0", "proxy"]
    assert pdctl.plan.build_plan is not None and sweep_mod.__name__ == "pdctl.bench.sweep"
    assert callable(pdctl.bench) and "The whole job" in pdctl.bench.__doc__
    for name in pdctl.__all__:
        assert getattr(pdctl, name) is not None, name
    with pytest.raises(AttributeError):
        pdctl.no_such_thing  # noqa: B018


@pytest.mark.parametrize("overrides", [{"decode.block_size": 128}, ["decode.block_size=128"],
                                       [Override(("decode", "block_size"), 128, "--set decode.block_size=128")]])
def test_overrides_as_a_mapping_strings_or_override_objects(overrides):
    assert pdctl.load(CONFIGS / "cpu-demo.yaml", overrides).decode[0].block_size == 128


def test_a_bad_override_is_a_topology_error_naming_it():
    with pytest.raises(TopologyError) as e:
        pdctl.load(CONFIGS / "cpu-demo.yaml", {"decode.block_size": 48})
    assert "decode.block_size=48" in e.value.render()


def test_gated_load_says_what_it_runs_with_and_what_the_user_kept():
    t = pdctl.load(CONFIGS / "cpu-demo.yaml", ["proxy.on_prefill_down=fallback"], gated=True)
    assert t.connector.kv_load_failure_policy == "fail" and t.proxy.on_prefill_down == "fallback"
    notes = pdctl.gate_notes(t)
    assert notes[0].startswith("gated: connector.kv_load_failure_policy=fail") and notes[1].startswith("warning:")
    assert pdctl.gate_notes(pdctl.load(CONFIGS / "cpu-demo.yaml")) == []


def test_a_plan_with_a_reference_and_where_its_state_lives(tmp_path):
    p = pdctl.plan(pdctl.load(CONFIGS / "cpu-demo.yaml"), state_dir=tmp_path, reference_port=8399)
    assert p.get("reference").ports["http"] == 8399 and p.state_dir == str(tmp_path)
    assert p.topology.name == "cpu-demo"  # typed, all the way


def test_up_refuses_what_it_cannot_honour_before_anything_starts(tmp_path):
    t = pdctl.load(CONFIGS / "cpu-demo.yaml")
    p = pdctl.plan(t, state_dir=tmp_path)
    with pytest.raises(pdctl.UserError, match="give state_dir and reference_port to pdctl.plan"):
        pdctl.up(p, state_dir=tmp_path / "other")
    with pytest.raises(pdctl.UserError, match="must come from pdctl.load"):
        pdctl.up(pdctl.plan.Plan.from_dict(p.to_dict()))  # read back from JSON: no file to resolve paths from


@pytest.mark.parametrize("kwargs,flag", [({"proxy": "localhost:1", "reference": "http://x"}, "--proxy"),
                                         ({"proxy": "http://x", "reference": "http://x:port"}, "--reference"),
                                         ({"proxy": "http://x", "reference": "http://x", "decodes": ["ftp://d"]},
                                          "--decode")])
def test_check_refuses_a_url_that_is_not_one_naming_the_flag(kwargs, flag):
    with pytest.raises(pdctl.UserError, match=f"^{flag} .*: expected an http URL"):
        pdctl.check(None, **kwargs)


def test_check_and_evaluate_name_what_they_need():
    with pytest.raises(pdctl.UserError, match="give a TOPOLOGY"):
        pdctl.check()
    with pytest.raises(pdctl.UserError, match="cannot check a int"):
        pdctl.check(3, proxy="http://x", reference="http://y")
    with pytest.raises(pdctl.UserError, match="--reference auto needs a TOPOLOGY"):
        pdctl.evaluate(proxy="http://127.0.0.1:9", reference="auto")


def test_renamed_names_say_their_new_name_for_one_release(run_cli):
    """check --gsm8k-dir, eval --url and eval --baseline (and evaluate's url=/baseline=) were renamed: one word per
    concept (--data-dir, --proxy for a running proxy, --reference for the gates' aggregated server)."""
    for args, said in ((("check", "--gsm8k-dir", "d"), "pdctl check --gsm8k-dir: renamed to --data-dir"),
                       (("eval", "--url=http://x:1"), "pdctl eval --url: renamed to --proxy"),
                       (("eval", "--proxy", "http://x:1", "--baseline", "auto"),
                        "pdctl eval --baseline: renamed to --reference")):
        code, _, err = run_cli(*args)
        assert code == 1 and said in err
    with pytest.raises(pdctl.UserError, match=r"evaluate\(url=...\): renamed to proxy="):
        pdctl.evaluate(url="http://127.0.0.1:9")
    with pytest.raises(pdctl.UserError, match=r"evaluate\(baseline=...\): renamed to reference="):
        pdctl.evaluate(baseline="auto")
    assert run_cli("plan", CONFIGS / "cpu-demo.yaml", "--baseline")[0] == 0  # plan's --baseline is another flag


def test_renamed_python_names_warn_and_answer_with_the_new_one():
    """pdctl.topology.InstanceGroup -> Pool and Deployment.backend -> engine: one word per concept (the YAML's pools
    and `engine:`), the old name kept for one release with a DeprecationWarning."""
    import pdctl.topology
    from pdctl.api.deploy import Deployment

    with pytest.warns(DeprecationWarning, match="renamed to pdctl.topology.Pool"):
        assert pdctl.topology.InstanceGroup is pdctl.topology.Pool
    engine = object()
    with pytest.warns(DeprecationWarning, match="renamed to Deployment.engine"):
        assert Deployment(None, engine, attached=False).backend is engine
    with pytest.raises(AttributeError):
        pdctl.topology.NoSuchName  # noqa: B018


REMOVED = [(command, flag, use) for command, flags in api.REMOVED_FLAGS.items() for flag, use in flags.items()]


@pytest.mark.parametrize("command,flag,use", REMOVED, ids=[f"{c} {f}" for c, f, _ in REMOVED])
def test_removed_flags_say_what_replaces_them_for_one_release(run_cli, command, flag, use):
    """The typed overrides (--set), --reference-port (reference.port), bench's --skip-* (--skip) and
    --eval-concurrency: each refused in one line naming its replacement, before the command parses anything."""
    code, out, err = run_cli(*command.split(), CONFIGS / "cpu-demo.yaml", f"{flag}=2")
    assert code == 1 and out == "" and err == f"error: pdctl {command} {flag}: removed: use {use}\n"
    assert "Traceback" not in err


def test_the_removed_flags_table_names_every_replacement():
    assert api.REMOVED_FLAGS["check"]["--decode-layout"] == "--set decode.kv_layout=HND|NHD"
    assert "--decode-block-size" not in api.REMOVED_FLAGS["bench"]  # a role flag: = --set decode.block_size=N
    assert api.REMOVED_FLAGS["bench"]["--skip-perf"] == "--skip perf"
    assert {"--reference-port", "--eval-concurrency", "--skip-check"} <= set(api.REMOVED_FLAGS["sweep"])
    assert "--engine" in api.REMOVED_FLAGS["render k8s"] and "--reference-port" not in api.REMOVED_FLAGS["plan"]
    api.refuse_renamed(["check", "--set", "x=1", "--", "--decode-tp"])  # after --: arguments, not flags
    api.refuse_renamed([])


@pytest.mark.parametrize("text,skip", [(None, set()), ("", set()), ("check", {"check"}),
                                       ("check,eval", {"check", "eval"}), (" perf , check ", {"perf", "check"})])
def test_skip_takes_a_comma_list_of_phases(text, skip):
    assert api.parse_skip(text) == frozenset(skip)
    assert BenchOptions(skip=skip).skip == frozenset(skip) == BenchOptions(skip=text or ()).skip


def test_skip_refuses_a_phase_it_does_not_know(run_cli, monkeypatch):
    with pytest.raises(pdctl.UserError, match=r"^--skip check,gates: unknown phase 'gates' \(choose from check, "
                                              r"eval, perf\)$"):
        api.parse_skip("check,gates")
    with pytest.raises(ValueError, match="unknown phase 'load'"):
        BenchOptions(skip={"load"})
    monkeypatch.setattr("pdctl.launch.run.up", lambda *a, **k: pytest.fail("started"))
    for command in (("bench", CONFIGS / "cpu-demo.yaml"), ("sweep", CONFIGS / "cpu-demo.yaml", "--matrix",
                                                            CONFIGS / "cpu-matrix.yaml")):
        code, _, err = run_cli(*command, "--skip", "eval,nope")
        assert code == 1 and "error: --skip eval,nope: unknown phase 'nope'" in err and "Traceback" not in err


def test_the_reference_port_is_the_topologys(run_cli):
    import json

    code, out, _ = run_cli("plan", CONFIGS / "cpu-demo.yaml", "-o", "json")
    assert code == 0 and json.loads(out)["topology"]["reference"]["port"] == 8300
    code, out, _ = run_cli("plan", CONFIGS / "cpu-demo.yaml", "--set", "reference.port=8399", "-o", "json")
    assert code == 0 and json.loads(out)["topology"]["reference"]["port"] == 8399
    t = pdctl.load(CONFIGS / "cpu-demo.yaml", {"reference.port": 8399})
    assert pdctl.plan(t, reference_port=t.reference.port).get("reference").ports["http"] == 8399
    code, _, err = run_cli("validate", CONFIGS / "cpu-demo.yaml", "--set", "reference.port=80")
    assert code == 1 and "command line (--set reference.port=80): reference.port" in err


def test_attach_and_down_when_nothing_is_up(tmp_path):
    with pytest.raises(pdctl.UserError, match="nothing is up in"):
        pdctl.attach(state_dir=tmp_path)
    r = pdctl.down(state_dir=tmp_path)
    assert r.nothing == f"no state in {tmp_path}" and r.stopped == []


def test_the_cli_is_the_api_rendered():
    """`pdctl plan --json` and pdctl.plan give the same plan."""
    import json

    out = subprocess.run([sys.executable, "-m", "pdctl", "plan", str(CONFIGS / "cpu-demo.yaml"), "--json",
                          "--state-dir", "/tmp/pdctl-x"], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == pdctl.plan(pdctl.load(CONFIGS / "cpu-demo.yaml"), state_dir="/tmp/pdctl-x").to_dict()


def test_up_interrupted_once_started_stops_what_it_started(monkeypatch, tmp_path):
    """Ctrl-C after run.up returned but before the caller got its handle (the window a foreground `pdctl up` once
    lost its state.json in): the topology is taken down, not left for the parent's death to half-clean."""
    from pdctl.api import deploy
    from pdctl.launch import run as run_mod

    started, downed = object(), []
    monkeypatch.setattr(deploy, "_preflight", lambda p, t: type("B", (), {"restartable": True, "name": "local"})())
    monkeypatch.setattr(run_mod, "up", lambda *a, **kw: started)
    monkeypatch.setattr(run_mod, "down", lambda state, engine, *a: downed.append(state))
    monkeypatch.setattr("pdctl.launch.supervisor.stop", lambda d: None)

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(deploy, "Deployment", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pdctl.up(pdctl.load(CONFIGS / "cpu-demo.yaml"), state_dir=tmp_path)
    assert downed == [started]


def test_bench_breakdown_turns_the_trace_on_and_refuses_what_it_cannot_follow(monkeypatch, tmp_path):
    from pdctl.api import benchmarks as api

    t = pdctl.load(CONFIGS / "cpu-demo.yaml")
    traced = api._traced(t, BenchOptions(breakdown=True))
    assert traced.connector.trace and not t.connector.trace and traced.origin is t.origin
    assert '"trace":true' in " ".join(pdctl.plan(traced).get("decode-0").argv)
    with pytest.raises(pdctl.UserError, match="drop perf from --skip"):
        api._traced(t, BenchOptions(breakdown=True, skip={"perf"}))
    stock = pdctl.load(CONFIGS / "cpu-demo.yaml", {"connector.kind": "nixl"})
    with pytest.raises(pdctl.UserError, match="pdctl's connector; topology 'cpu-demo' uses connector.kind nixl"):
        api._traced(stock, BenchOptions(breakdown=True))
    # Before anything starts: no plan, no process.
    monkeypatch.setattr(api, "_preflight", lambda *a: pytest.fail("pre-flight reached"))
    with pytest.raises(pdctl.UserError, match="connector.kind nixl"):
        api._bench(stock, BenchOptions(breakdown=True), {}, tmp_path, print)


def test_a_running_hybrid_models_window_is_read_from_its_servers_model(tmp_path):
    """`check --state-dir` on a running hybrid topology adds the window's prompts: the window comes from the
    config.json its servers were started with (the topology kept in the state dir has no loader origin)."""
    import json
    from types import SimpleNamespace

    from pdctl.api.gates import _sliding_window

    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 256, "sliding_window": 96,
        "layer_types": ["sliding_attention", "full_attention"] * 2}))
    proxy, spec = SimpleNamespace(model=None), SimpleNamespace(model=str(tmp_path))  # the plan's typed field
    d = SimpleNamespace(topology=SimpleNamespace(origin=None), plan=SimpleNamespace(processes=[proxy, spec]))
    assert _sliding_window(d) == 96
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    assert _sliding_window(d) is None


def test_a_seeded_fleet_check_draws_other_prompts_for_each_pair(monkeypatch):
    """`--seed N` on a fleet: two pairs that share a decode must not get the same prompts (the second pair's would
    be prefix-cache hits at the decode, no KV moved, and the gate would fail on its own prompts)."""
    import pdctl.api as api
    from pdctl.api import gates

    t = pdctl.load(CONFIGS / "cpu-fleet.yaml")
    asked = []

    class Running(api.Deployment):
        def __init__(self):
            pass

        topology, plan, proxy_url, reference_url = t, pdctl.plan(t), "http://127.0.0.1:1", "http://127.0.0.1:2"

    def fleet(p, proxy_url, reference, model, prompts_for, o, progress, key):
        asked.extend(prompts_for(32, 64, k) for k in range(2))  # two pairs with the same block sizes
        return "report"

    monkeypatch.setattr(gates, "_check_fleet", fleet)
    monkeypatch.setattr(gates, "_reported", lambda report, o: report)
    assert pdctl.check(Running(), options=api.CheckOptions(seed=5)) == "report"
    first, second = ([p.ids for p in ps] for ps in asked)
    assert len(first) == len(second) > 10 and not set(map(tuple, first)) & set(map(tuple, second))
    again = []
    monkeypatch.setattr(gates, "_check_fleet", lambda *a: again.append(a[4](32, 64, 0)) or "report")
    pdctl.check(Running(), options=api.CheckOptions(seed=5))
    assert [p.ids for p in again[0]] == first  # still reproducible: the same seed, the same prompts per pair


def test_check_hands_each_kind_of_target_to_its_own_function(monkeypatch):
    from pdctl.api import gates

    called: list = []
    for name in ("check_topology", "check_deployment", "check_urls"):
        monkeypatch.setattr(gates, name, lambda *a, _n=name, **k: called.append(_n) or _n)
    t = pdctl.load(CONFIGS / "cpu-demo.yaml")
    d = object.__new__(gates.Deployment)
    assert pdctl.check(t) == "check_topology"
    assert pdctl.check(d, reference="http://127.0.0.1:1") == "check_deployment"
    assert pdctl.check(proxy="http://127.0.0.1:1", reference="http://127.0.0.1:2") == "check_urls"
    assert called == ["check_topology", "check_deployment", "check_urls"]
    assert all(callable(getattr(pdctl, n)) for n in ("check_topology", "check_deployment", "check_urls"))  # exported
