"""`pdctl check`, `eval` and `bench` before anything starts: where GSM8K comes from (a clear error when nowhere),
which gate a model gets, and the settings the gated phases run with. Nothing is brought up: the launch functions
are replaced by ones that fail the test, and the only network is loopback."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdctl import cli, render
from pdctl.gates import gsm8k
from pdctl.gates.gated import gated, gated_lines, running_warning
from pdctl.topology import Override, load_topology
from tests.conftest import CONFIGS, SHARED

GSM8K = SHARED / "data" / "gsm8k"
ROW = json.dumps({"question": "2 + 2?", "answer": "2 + 2 = 4\n#### 4"})


LAUNCHED = 99


class Launched(SystemExit):
    """Raised by the stand-ins for bring-up: reaching them means the command got past its pre-start checks
    (an exit, so the command ends there with code 99 and its output is captured)."""

    def __init__(self, *_):
        super().__init__(LAUNCHED)


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No GSM8K anywhere: no GSM8K_DIR, empty HF caches, and a hub that does not answer (the probe replaced)."""
    monkeypatch.delenv("GSM8K_DIR", raising=False)
    for var in ("HF_DATASETS_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    probes = []
    monkeypatch.setattr(gsm8k, "hub_reachable", lambda: probes.append(1) or False)
    return probes


@pytest.fixture
def no_launch(monkeypatch):
    """Every way to start something fails the test with Launched (and records what it was asked)."""
    seen: dict = {}

    def plan(t, state_dir=None, reference_port=None, **_):
        seen.update(topology=t, reference_port=reference_port)
        raise Launched

    def up(*a, **kw):
        raise Launched

    for where in ("pdctl.api", "pdctl.api.deploy", "pdctl.api.gates", "pdctl.api.benchmarks"):  # each holds the name
        monkeypatch.setattr(f"{where}.plan", plan)
    monkeypatch.setattr("pdctl.launch.run.up", up)
    monkeypatch.setattr("pdctl.gates.accuracy.run_lm_eval", up)
    return seen


def _invoke(*args):
    """typer's CliRunner; a UserError comes back as the result's exception (main() would print it, exit 1)."""
    return CliRunner().invoke(cli.app, [str(a) for a in args])


# ------------------------------------------------------------------------------------------------------------
# GSM8K availability, before anything starts


@pytest.mark.parametrize("command", ["eval", "bench"])
def test_no_gsm8k_anywhere_is_one_clear_error_before_anything_starts(command, offline, no_launch, run_cli):
    code, _, err = run_cli(command, CONFIGS / "cpu-demo.yaml")
    assert code == 1 and no_launch == {} and offline == [1]
    assert "error: GSM8K is not available, so nothing was started: no --data-dir, GSM8K_DIR is not set" in err
    assert "the dataset hub did not answer within 3 s" in err
    assert "--data-dir DIR (or GSM8K_DIR=DIR) where DIR holds train.jsonl and test.jsonl" in err
    assert "Traceback" not in err


def test_no_gsm8k_with_cli_runner(offline, no_launch):
    r = _invoke("eval", "--proxy", "http://127.0.0.1:9", "--model", "tiny", "--reference", "http://127.0.0.1:9")
    assert isinstance(r.exception, cli.UserError) and no_launch == {}
    assert str(r.exception).startswith("GSM8K is not available, so nothing was started")


def test_bench_without_the_accuracy_gate_needs_no_gsm8k(offline, no_launch, run_cli):
    code, _, _ = run_cli("bench", CONFIGS / "cpu-demo.yaml", "--skip", "eval")
    assert code == LAUNCHED and no_launch["reference_port"] == 8300 and offline == []  # no probe


def test_a_data_dir_that_does_not_exist(offline, no_launch, run_cli, tmp_path):
    code, _, err = run_cli("eval", CONFIGS / "cpu-demo.yaml", "--data-dir", tmp_path / "nope")
    assert code == 1 and no_launch == {}
    assert f"error: --data-dir {tmp_path / 'nope'}: no such directory; point pdctl at local files" in err


def test_a_data_dir_without_test_jsonl_names_the_file(offline, no_launch, run_cli, tmp_path):
    (tmp_path / "train.jsonl").write_text(ROW + "\n")
    code, _, err = run_cli("bench", CONFIGS / "cpu-demo.yaml", "--data-dir", tmp_path)
    assert code == 1 and no_launch == {}
    assert f"error: {tmp_path / 'test.jsonl'}: no such file (a GSM8K directory holds train.jsonl and test.jsonl)" in err


@pytest.mark.parametrize("bad,message", [
    ('{"question": "q", "answer": "a"\n', "not JSON (Expecting ',' delimiter, column"),
    ('["q", "a"]\n', "a GSM8K row is an object with string 'question' and 'answer'"),
    ('{"question": "q"}\n', "a GSM8K row is an object with string 'question' and 'answer'"),
])
def test_malformed_jsonl_names_the_file_and_line(offline, no_launch, run_cli, tmp_path, bad, message):
    (tmp_path / "train.jsonl").write_text(ROW + "\n")
    (tmp_path / "test.jsonl").write_text(ROW + "\n\n" + bad)
    code, _, err = run_cli("eval", CONFIGS / "cpu-demo.yaml", "--data-dir", tmp_path)
    assert code == 1 and no_launch == {}
    assert f"error: {tmp_path / 'test.jsonl'}:3: {message}" in err


def test_gsm8k_dir_from_the_environment_is_checked_too(offline, monkeypatch, tmp_path):
    monkeypatch.setenv("GSM8K_DIR", str(tmp_path))
    with pytest.raises(gsm8k.DataError, match=r"test.jsonl: no such file .* \(from GSM8K_DIR=.*\)$"):
        gsm8k.data_source(None)
    monkeypatch.setenv("GSM8K_DIR", str(tmp_path / "nope"))
    with pytest.raises(gsm8k.DataError, match=r"^GSM8K_DIR=.*nope: no such directory"):
        gsm8k.data_source(None)
    monkeypatch.setenv("GSM8K_DIR", str(GSM8K))
    src = gsm8k.data_source(None)
    assert (src.kind, src.data_dir, src.env) == ("dir", GSM8K, {})
    assert src.detail == f"{GSM8K} (1319 test rows, 7473 train rows)"


def test_a_good_data_dir_gets_past_the_checks(offline, no_launch, run_cli):
    code, _, err = run_cli("eval", CONFIGS / "cpu-demo.yaml", "--data-dir", GSM8K)
    assert code == LAUNCHED and no_launch["reference_port"] == 8300, err  # tiny's relative gate: a reference
    assert f"GSM8K: {GSM8K} (1319 test rows" in err and offline == []


def test_a_cached_copy_is_read_offline(offline, tmp_path):
    found = tmp_path / "hf" / "datasets" / "openai___gsm8k" / "main" / "0.0.0" / "abc" / "dataset_info.json"
    found.parent.mkdir(parents=True)
    found.write_text("{}")
    src = gsm8k.data_source(None)
    assert src.kind == "cache" and src.env == {"HF_DATASETS_OFFLINE": "1"} and str(found) in src.detail
    assert offline == []  # no hub probe needed


def test_the_hubs_files_count_as_a_cached_copy(offline, tmp_path):
    found = tmp_path / "hf" / "hub" / "datasets--openai--gsm8k" / "snapshots" / "f00" / "main" / "test-0.parquet"
    found.parent.mkdir(parents=True)
    found.write_bytes(b"")
    assert gsm8k.data_source(None).kind == "cache"


def test_a_reachable_hub_is_used(offline):
    assert gsm8k.data_source(None, probe=lambda: True).kind == "hub"


class _Hub:
    """A loopback stand-in for the hub: answers HEAD after `delay` seconds."""

    def __init__(self, delay: float = 0.0, status: int = 200):
        gate = threading.Event()

        class H(BaseHTTPRequestHandler):
            def do_HEAD(self):  # noqa: N802 (http.server's name)
                gate.wait(delay)
                self.send_response(status)
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.release = gate
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.release.set()
        self.server.shutdown()


def test_hub_probe_is_bounded_and_reads_the_answer(monkeypatch):
    import time

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    ok, stalled, missing = _Hub(), _Hub(delay=30), _Hub(status=404)
    try:
        monkeypatch.setenv("HF_ENDPOINT", ok.url)
        assert gsm8k.hub_reachable(timeout_s=2)
        monkeypatch.setenv("HF_ENDPOINT", missing.url)
        assert not gsm8k.hub_reachable(timeout_s=2)
        monkeypatch.setenv("HF_ENDPOINT", stalled.url)
        t0 = time.monotonic()
        assert not gsm8k.hub_reachable(timeout_s=0.5)
        assert time.monotonic() - t0 < 1.5
        monkeypatch.setenv("HF_ENDPOINT", ok.url)
        monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
        assert not gsm8k.hub_reachable(timeout_s=2)  # offline is honoured without asking
    finally:
        for hub in (ok, stalled, missing):
            hub.close()


# ------------------------------------------------------------------------------------------------------------
# Which gate a model gets


def test_eval_on_a_running_system_refuses_a_relative_gate_without_a_reference(offline, no_launch, run_cli):
    code, _, err = run_cli("eval", "--proxy", "http://127.0.0.1:9", "--model", "tiny", "--data-dir", GSM8K)
    assert code == 1 and no_launch == {}
    assert ("error: model 'tiny' has a relative gsm8k gate in pdctl's expected-accuracy table (per-sample "
            "agreement and accuracy delta against an aggregated reference): give --reference URL") in err


def test_eval_on_a_topology_starts_the_reference_a_relative_gate_needs(offline, no_launch, run_cli):
    code, _, err = run_cli("eval", CONFIGS / "cpu-demo.yaml", "--data-dir", GSM8K)
    assert no_launch["reference_port"] == 8300
    assert ("model 'tiny' has a relative gsm8k gate in pdctl's expected-accuracy table: starting an aggregated "
            "reference beside the topology to compare with (as --reference auto)") in err


def test_eval_of_a_model_with_an_absolute_gate_starts_no_reference(offline, no_launch, run_cli, tmp_path):
    table = tmp_path / "expected.yaml"
    table.write_text("tiny:\n  gsm8k:\n    absolute:\n      exact_match,strict-match: {expected: 0.0, rtol: 0.05}\n")
    run_cli("eval", CONFIGS / "cpu-demo.yaml", "--data-dir", GSM8K, "--expected", table)
    assert no_launch["reference_port"] is None


def test_a_malformed_expected_table_is_refused_before_anything_starts(offline, no_launch, run_cli, tmp_path):
    table = tmp_path / "expected.yaml"
    table.write_text("tiny:\n  gsm8k:\n    relative: {min_agreement: 2}\n")
    code, _, err = run_cli("bench", CONFIGS / "cpu-demo.yaml", "--data-dir", GSM8K, "--expected", table)
    assert code == 1 and no_launch == {}
    assert f"error: {table}: tiny.gsm8k.relative.min_agreement: a number from 0 to 1, got 2" in err


def test_the_accuracy_summary_names_the_gate(capsys):
    summary = {"model": "tiny", "task": "gsm8k_local", "num_fewshot": 5, "limit": 20, "status": "FAIL",
               "gate": "relative",
               "gates": ["relative gate: agreement 19/20 with the aggregated reference (min 100%), delta "
                         "exact_match,strict-match +0.0000 (max ± 0.0) -> FAIL: agreement 19/20 below 100%"],
               "verdicts": [{"metric": "exact_match,strict-match", "measured": 0.0, "stderr": 0.0, "expected": 0.0,
                             "rtol": 0.0, "status": "PASS", "message": "", "gate": "relative"}],
               "reference": {"diverged": [{"doc_id": 7, "first_diff_char": 3, "length": 40}]}}
    render.accuracy(cli.out, cli.err, summary, "configs/expected.yaml")
    out = capsys.readouterr().out
    assert "relative gate: agreement 19/20 with the aggregated reference" in out
    assert "doc 7: texts differ from character 3 of 40" in out  # (the table's cells wrap at 80 columns)


# ------------------------------------------------------------------------------------------------------------
# The gated phases never count a fallback as P/D


def test_gated_settings_are_applied_unless_the_user_set_them():
    out, applied, kept = gated([])
    assert applied == ["proxy.on_prefill_down=reject", "connector.kv_load_failure_policy=fail"] and kept == []
    loaded = load_topology(CONFIGS / "cpu-demo.yaml", out)
    assert loaded.topology.proxy.on_prefill_down == "reject"
    assert loaded.topology.connector.kv_load_failure_policy == "fail"
    note, warning = gated_lines(applied, kept)
    assert note == ("gated: proxy.on_prefill_down=reject, connector.kv_load_failure_policy=fail (a request without "
                    "transferred KV fails instead of passing as P/D)") and warning is None

    user = [Override.parse_set("proxy.on_prefill_down=fallback")]
    out, applied, kept = gated(user)
    assert applied == ["connector.kv_load_failure_policy=fail"]
    assert kept == ["proxy.on_prefill_down=fallback (--set proxy.on_prefill_down=fallback)"]
    assert load_topology(CONFIGS / "cpu-demo.yaml", out).topology.proxy.on_prefill_down == "fallback"
    assert gated_lines(applied, kept)[1].startswith("warning: proxy.on_prefill_down=fallback (--set ")

    section = [Override.parse_set('connector={"kind": "pdctl", "kv_load_failure_policy": "recompute"}')]
    assert gated(section)[2][0].startswith("connector.kv_load_failure_policy=recompute (--set connector=")


@pytest.mark.parametrize("command", ["check", "eval", "bench"])
def test_gate_commands_bring_topologies_up_gated_and_say_so(command, offline, no_launch, run_cli):
    args = ["--data-dir", GSM8K] if command != "check" else []
    code, _, err = run_cli(command, CONFIGS / "cpu-demo.yaml", *args)
    t = no_launch["topology"]
    assert t.proxy.on_prefill_down == "reject" and t.connector.kv_load_failure_policy == "fail"
    assert "gated: proxy.on_prefill_down=reject, connector.kv_load_failure_policy=fail" in err


def test_a_users_own_setting_wins_with_a_warning(offline, no_launch, run_cli):
    code, _, err = run_cli("check", CONFIGS / "cpu-demo.yaml", "--set", "connector.kv_load_failure_policy=recompute")
    t = no_launch["topology"]
    assert t.proxy.on_prefill_down == "reject" and t.connector.kv_load_failure_policy == "recompute"
    assert "gated: proxy.on_prefill_down=reject (" in err
    assert ("warning: connector.kv_load_failure_policy=recompute (--set connector.kv_load_failure_policy=recompute) "
            "set on the command line: a request served without transferred KV may count as P/D") in err


def test_running_systems_are_warned_about_what_a_gate_cannot_change():
    from pdctl.topology import Topology

    def plan_topology(**parts):  # as a plan's JSON reads back
        return Topology.model_validate({"name": "t", "model": {"path": "m"}, "prefill": {}, "decode": {}, **parts})

    assert running_warning(plan_topology(proxy={"on_prefill_down": "reject"},
                                         connector={"kv_load_failure_policy": "fail"})) is None
    w = running_warning(plan_topology(proxy={"on_prefill_down": "fallback"},
                                      connector={"kv_load_failure_policy": "fail"}))
    assert w.startswith("warning: the running system has proxy.on_prefill_down=fallback, which a gate cannot change")
    both = running_warning(plan_topology())
    assert both.startswith("warning: the running system has proxy.on_prefill_down=fallback, "
                           "connector.kv_load_failure_policy=recompute, which")


def test_check_on_a_running_topology_warns_from_its_plan(monkeypatch, run_cli, tmp_path):
    from pdctl.launch import state as state_mod
    from pdctl.plan import Plan, ProcessSpec
    from pdctl.topology import Topology

    topo = Topology.model_validate({"name": "t", "model": {"path": "m", "served_name": "tiny"}, "prefill": {},
                                    "decode": {}, "proxy": {"on_prefill_down": "fallback"},
                                    "connector": {"kv_load_failure_policy": "recompute"}})
    proxy = ProcessSpec("proxy", "proxy", 0, ["true"], {}, "127.0.0.1", {"http": 9}, str(tmp_path / "proxy.log"),
                        "http://127.0.0.1:9/health")
    state_mod.save(state_mod.LaunchState(Plan("t", str(tmp_path), [proxy], topo)))  # a plan that is "up"

    def check_fleet(*a, **kw):
        raise Launched

    monkeypatch.setattr("pdctl.gates.fleet.check_fleet", check_fleet)
    r = _invoke("check", "--state-dir", tmp_path, "--reference", "http://127.0.0.1:9")
    assert r.exit_code == LAUNCHED  # the gate ran after the warning
    assert ("warning: the running system has proxy.on_prefill_down=fallback, "
            "connector.kv_load_failure_policy=recompute, which a gate cannot change") in r.output


@pytest.mark.parametrize("mode,code", [("transfer", 0), ("local", 1)])
def test_check_on_running_servers_says_why_the_kv_proof_failed(run_cli, mode, code):
    """`pdctl check --proxy --reference --decode` against loopback stand-ins: the KV travelled (exit 0), or the
    decode computed every prompt itself (exit 1, and the reason)."""
    from tests.unit.gates.test_parity import FakePD

    fake = FakePD(mode)
    try:
        got, out, err = run_cli("check", "--proxy", fake.url + "/proxy", "--reference", fake.url + "/ref",
                                "--decode", fake.url + "/decode", "--model", "tiny", "--lengths", "33,65")
    finally:
        fake.server.shutdown()
    assert got == code, out + err
    assert "note: a running system's proxy.on_prefill_down and connector.kv_load_failure_policy are its own" in err
    flat = " ".join(out.split())
    if code:
        assert ("FAIL KV did not travel: 0 prompt tokens arrived by transfer, at least 96 required: all but the last "
                "token of 2 prompts (98 - 2); 98 computed locally") in flat
    else:
        assert "KV travelled" in flat and "FAIL" not in flat


# ------------------------------------------------------------------------------------------------------------
# The default table, and a gate that judged nothing


def test_the_default_table_is_in_the_package_and_found_from_any_directory(monkeypatch, tmp_path):
    from pdctl import api
    from pdctl.gates import accuracy

    monkeypatch.chdir(tmp_path)  # not the repository: configs/ is not there (nor in a wheel)
    assert accuracy.DEFAULT_TABLE.parent == Path(accuracy.__file__).parent
    table = api.expected_table(None)
    assert "tiny" in table and "Qwen/Qwen3-0.6B" in table


def test_an_expected_table_that_is_not_there_is_refused_before_anything_starts(offline, no_launch, run_cli, tmp_path):
    code, _, err = run_cli("eval", CONFIGS / "cpu-demo.yaml", "--data-dir", GSM8K, "--expected", tmp_path / "no.yaml")
    assert code == 1 and no_launch == {}
    assert f"error: --expected: {tmp_path / 'no.yaml'} is not a file" in err  # never "nothing is gated", exit 0


@pytest.mark.parametrize("command", ["eval", "bench"])
@pytest.mark.parametrize("allow", [False, True])
def test_an_ungated_model_fails_eval_and_bench_unless_allowed(monkeypatch, run_cli, command, allow):
    """The CLI's exit follows the result's `passed`, which counts UNGATED only when --allow-ungated was given."""
    from pdctl import api
    from pdctl.bench.run import overall_status

    seen = {}

    def fake_eval(target, *, options, **kw):
        seen["allow"] = options.allow_ungated
        return api.EvalResult("UNGATED", "tiny", {"status": "UNGATED", "gates": [], "verdicts": []}, Path("r"),
                              options.allow_ungated)

    def fake_bench(t, options, **kw):
        seen["allow"] = options.allow_ungated
        summary = {"accuracy": {"status": "UNGATED"}, "parity": {"status": "PASS"}}
        status = overall_status(summary, options.allow_ungated)
        return api.BenchResult(status, {**summary, "status": status}, Path("r"))

    monkeypatch.setattr(api, "evaluate", fake_eval)
    monkeypatch.setattr(api, "bench", fake_bench)
    args = [command, "--proxy", "http://127.0.0.1:9", "--reference", "http://127.0.0.1:9"] if command == "eval" else \
        [command, CONFIGS / "cpu-demo.yaml"]
    code, _, _ = run_cli(*args, "--json", *(["--allow-ungated"] if allow else []))
    assert seen["allow"] is allow and code == (0 if allow else 1)


def test_a_bench_fails_on_any_failed_gate_and_on_an_ungated_accuracy_gate_unless_allowed():
    from pdctl.bench.run import overall_status

    ok = {"parity": {"status": "PASS"}, "accuracy": {"status": "PASS"}, "perf": {"status": "PASS"}}
    assert overall_status(ok) == "PASS"
    assert overall_status({**ok, "perf": {"status": "FAIL"}}, allow_ungated=True) == "FAIL"
    ungated = {**ok, "accuracy": {"status": "UNGATED"}}
    assert overall_status(ungated) == "FAIL" and overall_status(ungated, allow_ungated=True) == "PASS"
    assert overall_status({"parity": {"status": "PASS"}}) == "PASS"  # --skip eval: no accuracy gate ran


@pytest.mark.unit_time_limit(30, reason="builds pdctl's wheel")
def test_the_wheel_carries_the_default_table(tmp_path):
    import subprocess
    import sys
    import zipfile

    from tests.conftest import REPO

    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = tmp_path.glob("pdctl-*.whl")
    assert "pdctl/gates/expected.yaml" in zipfile.ZipFile(wheel).namelist()
