"""The role flags (--prefill-block-size, --decode-block-size, --prefill-tp, --decode-tp) on every command that takes
a topology: each is exactly its --set (the same plan, golden), a fleet's pools are set together or the flag is
refused naming them, and a flag given with a --set of the same field is refused naming both."""

import json
import os
import sys
from pathlib import Path

import pytest

from pdctl import api
from pdctl.topology import ROLE_FLAGS
from tests.conftest import CONFIGS, REPO, SHARED

GOLDEN = Path(__file__).parents[1] / "golden"
DEMO = CONFIGS / "cpu-demo.yaml"
FLAGS = ["--prefill-block-size", "128", "--decode-block-size", "32"]
SETS = ["--set", "prefill.block_size=128", "--set", "decode.block_size=32"]
STATE = Path("/tmp/pdctl-golden")


class Captured(Exception):
    """What the command handed to the API, raised by a stand-in for the API function that would start servers."""

    def __init__(self, topology):
        self.topology = topology


def _capture(*_args, **_kwargs):
    target = _args[0] if _args else _kwargs.get("target")
    raise Captured(target)


def _plan_json(t) -> dict:
    text = api.plan(t, state_dir=STATE).to_json()
    return json.loads(text.replace(sys.executable, "$PYTHON").replace(str(REPO), "$REPO"))


def _golden(got: dict, name: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(json.dumps(got, indent=2) + "\n")
    assert got == json.loads(path.read_text()), f"plan changed; rerun with UPDATE_GOLDEN=1 if intended ({path})"


# The commands that bring a topology up, with the API function that would start its servers and the arguments
# that get each command as far as that call. The gates load the topology as a gate runs it (gated).
BRINGS_UP = {
    "up": ("up", [], "cpu-demo.p128-d32.plan.json"),
    "check": ("check", [], "cpu-demo.p128-d32.gated.plan.json"),
    "eval": ("evaluate", [], "cpu-demo.p128-d32.gated.plan.json"),
    "bench": ("bench", ["--data-dir", str(SHARED / "data" / "gsm8k")], "cpu-demo.p128-d32.gated.plan.json"),
}


def _brought_up(run_cli, monkeypatch, command: str, overrides: list[str]):
    fn, extra, _ = BRINGS_UP[command]
    monkeypatch.setattr(api, fn, _capture)
    with pytest.raises(Captured) as got:
        run_cli(command, DEMO, *extra, *overrides)
    return got.value.topology


@pytest.mark.parametrize("command", sorted(BRINGS_UP))
def test_a_command_that_brings_up_gets_the_same_plan_from_the_flags_as_from_set(run_cli, monkeypatch, command):
    by_flag = _plan_json(_brought_up(run_cli, monkeypatch, command, FLAGS))
    assert by_flag == _plan_json(_brought_up(run_cli, monkeypatch, command, SETS))
    _golden(by_flag, BRINGS_UP[command][2])
    blocks = {p["role"]: p["argv"][p["argv"].index("--block-size") + 1] for p in by_flag["processes"]
              if "--block-size" in p["argv"]}
    assert blocks["prefill"] == "128" and blocks["decode"] == "32", blocks


def test_plan_gets_the_same_plan_from_the_flags_as_from_set(run_cli):
    outs = []
    for overrides in (FLAGS, SETS):
        code, out, err = run_cli("plan", DEMO, "--json", "--state-dir", STATE, *overrides)
        assert code == 0, err
        outs.append(json.loads(out.replace(sys.executable, "$PYTHON").replace(str(REPO), "$REPO")))
    assert outs[0] == outs[1]
    _golden(outs[0], "cpu-demo.p128-d32.plan.json")


def test_validate_and_render_k8s_say_the_same_for_the_flags_as_for_set(run_cli, tmp_path):
    said = [run_cli("validate", DEMO, "--json", *o) for o in (FLAGS, SETS)]
    assert said[0] == said[1] and said[0][0] == 0
    assert json.loads(said[0][1])["summary"].startswith("cpu-demo: prefill 1x cpu block 128")
    for name, overrides in (("flag", FLAGS), ("set", SETS)):
        code, _, err = run_cli("render", "k8s", DEMO, "-o", tmp_path / name, *overrides)
        assert code == 0, err
    files = sorted(p.name for p in (tmp_path / "flag").iterdir())
    assert files and files == sorted(p.name for p in (tmp_path / "set").iterdir())
    assert all((tmp_path / "flag" / f).read_bytes() == (tmp_path / "set" / f).read_bytes() for f in files)


def test_sweep_puts_the_flags_under_every_case(run_cli, monkeypatch, tmp_path):
    """--decode-tp under configs/cpu-matrix.yaml's cases, none of which sets decode.tp."""
    from pdctl.api import benchmarks

    seen = []

    def bench_case(t, *args, **kwargs):
        seen.append(t)
        raise Captured(t)

    monkeypatch.setattr(benchmarks, "_bench", bench_case)
    devices = ["--set", "decode.devices=[0,1]"]
    for overrides in (["--decode-tp", "2"], ["--set", "decode.tp=2"]):
        with pytest.raises(Captured):
            run_cli("sweep", DEMO, "--matrix", CONFIGS / "cpu-matrix.yaml", "--skip", "eval",
                    "--results", tmp_path / overrides[0], *devices, *overrides)
    assert [(t.decode[0].tp, t.prefill[0].block_size, t.decode[0].block_size) for t in seen] == [(2, 32, 32)] * 2
    assert _plan_json(seen[0]) == _plan_json(seen[1])


def test_sweep_refuses_a_flag_a_case_also_sets_before_any_case_runs(run_cli, tmp_path):
    code, out, err = run_cli("sweep", DEMO, "--matrix", CONFIGS / "cpu-matrix.yaml", "--decode-block-size", "64",
                             "--results", tmp_path / "r")
    assert code == 1 and "Traceback" not in err
    assert "case 'homog-32-32'" in err and "--decode-block-size 64" in err and "decode.block_size=32" in err, err
    assert not (tmp_path / "r").exists()


# A valid value for each flag on configs/qwen3-0.6b-cuda-d64.yaml (CUDA 16 -> 64), and what else it needs.
EACH = {"--prefill-block-size": ("32", []), "--decode-block-size": ("128", []), "--decode-tp": ("2", []),
        "--prefill-tp": ("2", ["--set", "decode.tp=2", "--set", "prefill.devices=[0,3]"])}


@pytest.mark.parametrize("flag", sorted(ROLE_FLAGS))
def test_each_role_flag_is_its_set(run_cli, flag):
    role, field = ROLE_FLAGS[flag]
    config = CONFIGS / "qwen3-0.6b-cuda-d64.yaml"
    value, extra = EACH[flag]
    outs = [run_cli("plan", config, "--json", "--state-dir", STATE, *extra, *o)
            for o in ([flag, value], ["--set", f"{role}.{field}={value}"])]
    assert outs[0][0] == 0, outs[0][2]
    assert outs[0][1] == outs[1][1]
    assert [pool[field] for pool in json.loads(outs[0][1])["topology"][role]] == [int(value)]


def test_negative_control_a_flag_wired_to_the_wrong_role_is_caught(run_cli, monkeypatch):
    """The equality above can fail: --decode-block-size pointed at the prefill gives another plan than its --set."""
    monkeypatch.setitem(ROLE_FLAGS, "--decode-block-size", ("prefill", "block_size"))
    outs = [run_cli("plan", DEMO, "--json", "--state-dir", STATE, *o)
            for o in (["--decode-block-size", "64"], ["--set", "decode.block_size=64"])]
    assert outs[0][0] == outs[1][0] == 0
    assert json.loads(outs[0][1]) != json.loads(outs[1][1])


@pytest.mark.parametrize("command", ["validate", "plan", "up", "check", "eval", "bench", "sweep"])
def test_a_flag_and_a_set_of_the_same_field_are_refused_naming_both(run_cli, command):
    extra = ["--matrix", CONFIGS / "cpu-matrix.yaml"] if command == "sweep" else []
    code, out, err = run_cli(command, DEMO, *extra, "--decode-block-size", "64", "--set", "decode.block_size=64")
    assert code == 1 and out == "" and "Traceback" not in err
    assert "--decode-block-size 64 and --set decode.block_size=64" in err and "both set it" in err, err


def test_a_flag_beside_a_set_of_another_field_is_not_a_conflict(run_cli):
    code, out, err = run_cli("validate", DEMO, "--json", "--decode-block-size", "64", "--set", "prefill.block_size=64")
    assert code == 0, err
    assert "prefill 1x cpu block 64" in json.loads(out)["summary"]


def _decode_pools(path: Path) -> dict:
    import yaml

    return {p["name"]: p.get("block_size") for p in yaml.safe_load(path.read_text())["decode"]}


def test_a_fleet_whose_pools_differ_refuses_the_flag_naming_its_pools(run_cli):
    pools = _decode_pools(CONFIGS / "cpu-fleet.yaml")
    assert len(set(pools.values())) > 1
    code, out, err = run_cli("validate", CONFIGS / "cpu-fleet.yaml", "--decode-block-size", "64")
    assert code == 1 and "Traceback" not in err
    assert f"the topology's {len(pools)} decode pools differ in block_size" in err, err
    assert all(f"{name}: {block}" in err for name, block in pools.items()), err
    assert "--set decode." in err  # the fix: one pool by name


def test_a_fleet_whose_pools_agree_has_every_pool_set_by_the_flag(run_cli, tmp_path):
    import yaml

    data = yaml.safe_load((CONFIGS / "cpu-fleet.yaml").read_text())
    for pool in data["decode"]:
        pool["block_size"] = 32
    data["model"]["path"] = str((CONFIGS / data["model"]["path"]).resolve())
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(data, sort_keys=False))
    code, out, err = run_cli("plan", fleet, "--json", "--state-dir", STATE, "--decode-block-size", "64")
    assert code == 0, err
    decoded = json.loads(out)["topology"]["decode"]
    assert len(decoded) >= 2 and {p["block_size"] for p in decoded} == {64}
    # a pool's own --set beside the flag that sets every pool: two words for one field
    name = decoded[0]["name"]
    code, _, err = run_cli("validate", fleet, "--decode-block-size", "64", "--set", f"decode.{name}.block_size=128")
    assert code == 1 and f"--decode-block-size 64 and --set decode.{name}.block_size=128" in err, err


def test_a_flag_without_a_topology_to_bring_up_is_refused(run_cli):
    code, out, err = run_cli("check", "--proxy", "http://127.0.0.1:9", "--reference", "http://127.0.0.1:9",
                             "--decode-block-size", "64")
    assert code == 1 and err.startswith("error: --decode-block-size 64: changes a TOPOLOGY to bring up"), err


def test_a_problem_the_flag_causes_names_the_flag(run_cli):
    code, out, err = run_cli("validate", DEMO, "--decode-block-size", "48")
    assert code == 1 and "command line (--decode-block-size 48)" in err and "Traceback" not in err, err
