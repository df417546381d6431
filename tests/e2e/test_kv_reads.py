"""Under kv_load_failure_policy: fail, a KV read held past connector.kv_read_timeout_s ends its request with an
error at once, not a stall until a client timeout (cpu-demo P32 -> D64, its own bring-up, make test-all). The
same drill under the default policy (recompute) runs on test_launch.py's bring-up."""

from __future__ import annotations

import random

import pytest

from pdctl import protocol
from tests.e2e.conftest import Up
from tests.e2e.faults import fresh_prompt
from tests.e2e.kv_reads import KV_READS, ask, log

pytestmark = pytest.mark.full  # two more servers; the recompute drill in make test shares test_launch's

PORTS = ["--set", "proxy.port=8075", "--set", "prefill.http_port=8175", "--set", "decode.http_port=8275",
         "--set", "prefill.side_channel_port=5675", "--set", "decode.side_channel_port=5775"]


def test_under_policy_fail_a_timed_out_read_is_an_error_not_a_stall(tmp_path, reference):
    with Up("cpu-demo.yaml", tmp_path, *PORTS, *KV_READS, "--set", "connector.kv_load_failure_policy=fail",
            timeout=500) as up:
        a = ask(up, "stall-read-2", fresh_prompt(random.Random(14), 150))
        assert not a.ok and a.ended - a.started < 30  # an error within the timeout's reach, not a 30 s stall
        assert protocol.READ_TIMED_OUT_MARK in log(up, "decode-0")
        control = ask(up, "plain-read-2", fresh_prompt(random.Random(15), 150))
        assert control.ok, control.error
