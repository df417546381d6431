"""Every bad topology and bad override yields exit 1, a clear message naming file:line (or the flag), no traceback."""

import re
from pathlib import Path

import pytest

from tests.conftest import CONFIGS

BAD = sorted((Path(__file__).parents[1] / "bad").glob("*.yaml"))


def _expectations(path: Path) -> tuple[list[str], list[str]]:
    text = path.read_text()
    return re.findall(r"^# expect: (.+)$", text, re.M), re.findall(r"^# where: (.+)$", text, re.M)


def test_corpus_is_large_enough():
    assert len(BAD) >= 30


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_topology(run_cli, path):
    expects, wheres = _expectations(path)
    assert expects, f"{path.name} states no expectation"
    code, out, err = run_cli("validate", path)
    assert code == 1, (out, err)
    assert "Traceback" not in err + out
    for e in expects:
        assert e in err, f"{e!r} not in:\n{err}"
    for w in wheres:
        assert f"{path}{w}" in err, f"{path}{w!r} not in:\n{err}"


OVERRIDES = [
    (["--set", "decode.block_size=48"],
     ["command line (--set decode.block_size=48): decode.block_size", "multiple of 32"]),
    (["--set", "prefill.tp=abc"], ["command line (--set prefill.tp=abc): prefill.tp", "valid integer"]),
    (["--set", "decode.kv_layout=XYZ"], ["command line (--set decode.kv_layout=XYZ): decode.kv_layout"]),
    (["--set", "prefill.count=0"], ["command line (--set prefill.count=0)", "greater than or equal to 1"]),
    (["--set", "decode.count=2", "--set", "decode.devices=[1]"], ["need 2 devices, 1 listed"]),
    (["--set", "nonsense"], ["expected dotted.path=value"]),
    (["--set", "prefill.nope=1"], ["command line (--set prefill.nope=1): prefill.nope: unknown key 'nope'"]),
    (["--set", "prefill.block_size.x=1"], ["'block_size' is not a section"]),
    (["--set", "prefill.block_size=96"],
     ["decode.block_size: prefill block 96 and decode block 64 have no integer ratio",
      "[the other value came from the command line: --set prefill.block_size=96]"]),
    (["--set", "connector.kind=nixl", "--set", "prefill.block_size=128"],
     ["stock NixlConnector needs the decode block to be a multiple", "use connector.kind: pdctl"]),
    (["--set", "prefill.tp=2", "--set", "prefill.devices=[0,1]"],
     ["prefill TP 2 > decode TP 1 is only supported with equal block sizes", "command line (--set prefill.tp=2)"]),
    (["--set", "proxy.port=8200", "--set", "decode.http_port=8200"],
     ["port 8200 of the proxy is also used by decode[0]"]),
]


@pytest.mark.parametrize("args,expects", OVERRIDES, ids=[" ".join(a) for a, _ in OVERRIDES])
def test_bad_override(run_cli, args, expects):
    code, out, err = run_cli("validate", CONFIGS / "cpu-demo.yaml", *args)
    assert code == 1, (out, err)
    assert "Traceback" not in err
    for e in expects:
        assert e in err, f"{e!r} not in:\n{err}"


FLEET_OVERRIDES = [
    (["--set", "decode.block_size=128"], ["--set decode.block_size=128", "the topology has 2 decode pools (d64, d32)",
                                      "--set decode.d64.block_size=..."]),
    (["--set", "decode.d99.block_size=64"], ["--set decode.d99.block_size=64", "pools (d64, d32)"]),
    (["--set", "decode.d64.block_size=96"],
     ["command line (--set decode.d64.block_size=96): decode.0.block_size: prefill pool p128 -> decode pool d64",
      "no integer ratio"]),
]


@pytest.mark.parametrize("args,expects", FLEET_OVERRIDES, ids=[" ".join(a) for a, _ in FLEET_OVERRIDES])
def test_bad_fleet_override(run_cli, args, expects):
    code, out, err = run_cli("validate", CONFIGS / "cpu-fleet.yaml", *args)
    assert code == 1, (out, err)
    assert "Traceback" not in err
    for e in expects:
        assert e in err, f"{e!r} not in:\n{err}"


def test_fleet_override_by_pool_name(run_cli):
    code, out, err = run_cli("validate", CONFIGS / "cpu-fleet.yaml", "--set", "decode.d64.block_size=128")
    assert code == 0, err
    assert "d64 (1x cpu block 128" in out


def test_missing_file(run_cli, tmp_path):
    code, _, err = run_cli("validate", tmp_path / "nope.yaml")
    assert code == 1 and "cannot read the topology" in err and "Traceback" not in err


def test_valid_override_is_accepted(run_cli):
    code, out, _ = run_cli("validate", CONFIGS / "cpu-demo.yaml", "--set", "prefill.block_size=128",
                           "--set", "decode.block_size=32")
    assert code == 0
    assert "block 128" in out and "block 32" in out


def test_validate_json_lists_problems(run_cli):
    import json

    code, out, _ = run_cli("validate", CONFIGS / "cpu-demo.yaml", "--set", "decode.block_size=48", "--json")
    assert code == 1
    doc = json.loads(out)
    assert doc["ok"] is False
    assert {p["path"] for p in doc["problems"]} == {"decode.block_size"}


def test_prefill_and_decode_on_one_cpu_core_is_a_plain_shared_core_warning(run_cli):
    # A deployment's servers share one scheduler autogroup, which cured the shared-core first-read stall
    # (docs/notes/ucx-transports.md): a prefill and a decode on one core get the same warning as two prefills.
    code, out, err = run_cli("validate", CONFIGS / "cpu-fleet.yaml", "--set", "decode.d64.devices=[0]")
    assert code == 0, err
    lines = err.splitlines()
    cross = lines.index(next(x for x in lines if "decode pool d64[0] is also used by prefill pool p32[0]" in x))
    same = lines.index(next(x for x in lines if "prefill pool p128[0] is also used by prefill pool p32[0]" in x))
    assert lines[cross + 1] == lines[same + 1]
    assert "slow each other down" in lines[cross + 1] and "first KV read" not in err


def test_one_cpu_pool_may_bind_its_instances_to_one_core_with_a_warning(run_cli):
    # Two prefills on core 0 and two decodes on core 1 keep every pair's roles on different cores (the fault
    # drills' layout); an accelerator listed twice stays an error (corpus case 31).
    code, out, err = run_cli("validate", CONFIGS / "cpu-demo.yaml", "--set", "prefill.count=2", "--set",
                             "decode.count=2", "--set", "prefill.devices=[0,0]", "--set", "decode.devices=[1,1]")
    assert code == 0, err
    assert "cpu device 0 of prefill[1] is also used by prefill[0]" in err
    assert "cpu device 1 of decode[1] is also used by decode[0]" in err
    assert "first KV read" not in err


@pytest.mark.parametrize("dotted", ["connector.worker_spin_s", "connector.read_wait_s", "reference.calm_queues",
                                    "proxy.early_decode", "proxy.first_token"])
def test_a_removed_key_is_refused_saying_what_to_do_instead(run_cli, dotted, tmp_path):
    from pdctl.topology.problems import REMOVED_KEYS

    section, key = dotted.split(".")
    value = {"calm_queues": "true", "early_decode": "true", "first_token": "auto"}.get(key, "0.01")
    code, out, err = run_cli("validate", CONFIGS / "cpu-demo.yaml", "--set", f"{dotted}={value}")
    assert code == 1 and f"{dotted}: '{key}' was removed" in err and "Traceback" not in err, err
    assert " ".join(REMOVED_KEYS[dotted].split())[:40] in " ".join(err.split())
    # in a file too, naming its line
    text = (CONFIGS / "cpu-demo.yaml").read_text().replace(f"{section}:\n", f"{section}:\n  {key}: {value}\n", 1)
    if f"{section}:" not in text:
        text += f"{section}:\n  {key}: {value}\n"
    (tmp_path / "t.yaml").write_text(text.replace("../.pdctl", str(CONFIGS.parent / ".pdctl")))
    code, _, err = run_cli("validate", tmp_path / "t.yaml")
    assert code == 1 and f"'{key}' was removed" in err and f"{tmp_path / 't.yaml'}:" in err, err


def test_an_unknown_key_is_still_unknown(run_cli):
    code, _, err = run_cli("validate", CONFIGS / "cpu-demo.yaml", "--set", "connector.read_wait=0")
    assert code == 1 and "unknown key 'read_wait'" in err and "was removed" not in err
