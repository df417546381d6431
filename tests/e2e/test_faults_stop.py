"""Fault drills that need a topology of their own (cpu-homog, P32 -> D32): (d) a prefill killed between its
answer and the decode's read with `kv_load_failure_policy: fail` (a clear error, no hang), then `pdctl down` on
the same foreground `pdctl up` (nothing left behind); (e) Ctrl-C on a foreground `pdctl up` and `pdctl down` on a
`pdctl up -d`, both while the servers are still starting, and Ctrl-C on a foreground `pdctl up` once it is ready."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import threading
import time

import pytest

from tests.conftest import CONFIGS, REPO, processes_with_arg
from tests.e2e.conftest import PDCTL, cli, hooks_env, live, pdctl, state_pgids, wait_for
from tests.e2e.faults import complete, fresh_prompt, kill_server

# `make test-all` only (README, "Tests"): four foreground bring-ups of their own (eight server starts).
pytestmark = pytest.mark.full

DELAY_S = 8


def _ports(base: int) -> list[str]:
    return ["--set", f"proxy.port={8000 + base}", "--set", f"prefill.http_port={8100 + base}", "--set",
            f"decode.http_port={8200 + base}", "--set", f"prefill.side_channel_port={5600 + base}",
            "--set", f"decode.side_channel_port={5700 + base}"]


def test_fail_policy_ends_the_request_with_an_error_then_ctrl_c_leaves_nothing(tmp_path):
    args = [*_ports(70), "--set", "connector.kv_load_failure_policy=fail", "--set", "prefill.restart=never",
            *hooks_env("decode", READ_DELAY_S=DELAY_S, READ_DELAY_MATCH="delay-read")]
    proc = subprocess.Popen(cli(["up", CONFIGS / "cpu-homog.yaml", "--state-dir", tmp_path, *args]), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: (tmp_path / "state.json").exists(), 60)

        def ready():
            r = pdctl("status", "--state-dir", tmp_path, "--json")
            return r.returncode == 0 and json.loads(r.stdout)["ready"]

        assert wait_for(ready, 400, 2), proc.stderr.read() if proc.poll() is not None else "not ready"
        assert json.loads(pdctl("status", "--state-dir", tmp_path, "--json").stdout)["supervisor"]["mode"] == \
            "foreground"
        body = {"model": "tiny", "prompt": fresh_prompt(random.Random(5), 150), "max_tokens": 16, "temperature": 0}
        out: list = []
        t = threading.Thread(target=lambda: out.append(complete("http://127.0.0.1:8070", body,
                                                                {"X-Request-Id": "pdctl-delay-read-fail"})))
        t.start()
        decode_log = tmp_path / "logs" / "decode-0.log"
        assert wait_for(lambda: "holding the read of request" in decode_log.read_text(errors="replace"), 60)
        killed = kill_server(tmp_path, "prefill-0")
        t.join(300)
        (a,) = out
        print(f"\ndrill (d, fail): answer {a.status} {a.ended - killed:.1f} s after the kill: {a.text[:300]}")
        assert not a.ok and a.ended - killed < 60  # an error, never a hang
        err = json.loads(a.text)["error"]
        # The decode failed the load of KV it was handed parameters for: the proxy names the request and the pair
        # (one pair: nothing to retry on) and passes on the decode's own error.
        assert a.status == 500 and err["type"] == "kv_load_failed" and "kv_load_failure_policy" in err["message"]
        assert "request pdctl-delay-read-fail" in err["message"] and "decode-0" in err["message"]
        assert "due to KV load failure" in decode_log.read_text(errors="replace")
        # The foreground up is the supervisor: prefill restart: never leaves it down, the decode still serves.
        assert wait_for(lambda: json.loads((tmp_path / "state.json").read_text())["processes"]["prefill-0"]
                        ["phase"] == "failed", 30)
        pgids = state_pgids(tmp_path)
        # `pdctl down` from another shell stops the foreground up (its supervisor), which stops everything.
        r = pdctl("down", "--state-dir", tmp_path, check=True, timeout=120)
        assert "stopped the foreground supervisor" in r.stdout, r.stdout
        code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, proc.stderr.read()
    assert wait_for(lambda: not live(pgids), 10), live(pgids)
    assert not (tmp_path / "state.json").exists() and not (tmp_path / "supervisor.json").exists()
    assert not processes_with_arg(str(tmp_path))


@pytest.mark.parametrize("how", ["ctrl-c on up", "down on up -d"])
def test_stopped_while_starting_leaves_nothing(tmp_path, how):
    detach = how == "down on up -d"
    proc = subprocess.Popen([*PDCTL, "up", *(["-d"] if detach else []), CONFIGS / "cpu-homog.yaml", "--state-dir",
                             tmp_path, *_ports(80 if detach else 75)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: (tmp_path / "state.json").exists(), 60)
        time.sleep(4)  # the servers are loading
        pgids = state_pgids(tmp_path)
        if detach:
            assert "is down" in pdctl("down", "--state-dir", tmp_path, check=True).stdout
        else:
            proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    # up -d saw its instances stopped and failed the launch; a foreground up says it was interrupted.
    assert code == (1 if detach else 130), proc.stderr.read()
    assert wait_for(lambda: not live(pgids), 10), live(pgids)
    assert wait_for(lambda: not processes_with_arg(str(tmp_path)), 10), processes_with_arg(str(tmp_path))


def test_sigint_on_a_ready_foreground_up_leaves_nothing(tmp_path):
    proc = subprocess.Popen([*PDCTL, "up", CONFIGS / "cpu-homog.yaml", "--state-dir", tmp_path, *_ports(50)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: (tmp_path / "state.json").exists(), 30)
        pgids = state_pgids(tmp_path)

        def ready():
            r = pdctl("status", "--state-dir", tmp_path, "--json")
            return r.returncode == 0 and json.loads(r.stdout)["ready"]

        assert wait_for(ready, 300, 2), proc.stderr.read() if proc.poll() is not None else "not ready"
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 130
    assert wait_for(lambda: not live(pgids), 5), live(pgids)
    assert not (tmp_path / "state.json").exists()
