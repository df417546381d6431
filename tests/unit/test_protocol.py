"""The contracts between pdctl's processes: each writer's format is read back by its one parser."""

import json
import re
from pathlib import Path

import pytest

from pdctl import protocol

ROOT = Path(__file__).resolve().parents[2]


def test_a_trace_line_is_read_back_by_its_parser():
    line = "(EngineCore pid=1) INFO 12-05 [nixl.py:90] " + protocol.trace_line("read_done", "cmpl-pdctl-x-0", 1.5)
    assert protocol.TRACE_LINE.search(line).groups() == ("read_done", "cmpl-pdctl-x-0", "1.500000")


def test_the_received_line_is_read_back_only_for_a_read_that_succeeded():
    args = ("engine-a", "127.0.0.1", 5600, 64, 32, 4, 130, 130, "0.4")
    ok = protocol.RECEIVED_FORMAT % ("received", "req-1", *args)
    assert protocol.RECEIVED_LINE.search(ok).groups() == ("req-1", "127.0.0.1", "5600")
    assert protocol.READ_MS.search("INFO " + ok).groups() == ("req-1", "0.4")
    failed = protocol.RECEIVED_FORMAT % ("FAILED", "req-1", *args)
    assert protocol.RECEIVED_LINE.search(failed) is None and protocol.READ_MS.search(failed) is None
    # a full prefix hit reads nothing: no read time to report
    assert protocol.READ_MS.search(protocol.RECEIVED_FORMAT % ("received", "req-1", *args[:-1], "-")) is None


def test_a_timed_out_and_a_refused_read_are_found_by_their_marks():
    timed_out = protocol.READ_TIMED_OUT_FORMAT % ("req-1", "E", "h", 1, 5.2, 5.0, "recompute")
    refused = protocol.LEASE_REFUSED_FORMAT % ("req-1", "E", "h", 1, 29.0, 30, 5.0, "fail")
    assert protocol.READ_TIMED_OUT_MARK in timed_out and protocol.LEASE_REFUSED_MARK not in timed_out
    assert protocol.LEASE_REFUSED_MARK in refused and protocol.READ_TIMED_OUT_MARK not in refused


def test_the_prefills_request_asks_for_a_remote_decode_and_names_no_remote():
    p = protocol.REMOTE_DECODE_PARAMS
    assert p["do_remote_decode"] is True and p["do_remote_prefill"] is False
    assert all(p[k] is None for k in ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port"))


def test_every_header_is_pdctls_and_distinct():
    headers = [v for k, v in vars(protocol).items() if k.endswith("_HEADER")]
    assert len(headers) == len(set(headers)) == 6 and all(h.startswith("x-pdctl-") for h in headers)


# -- the plan -> connector contract ------------------------------------------------------------------------------


def test_connector_settings_round_trip_and_every_default_stated_once():
    from pdctl.protocol import CONNECTOR_SETTINGS_VERSION, ConnectorSettings
    from pdctl.topology.schema import ConnectorSpec

    s = ConnectorSettings(progress_delay_us=5, staging_blocks=3, kv_read_timeout_s=2, trace=True)
    assert ConnectorSettings.from_dict(s.to_dict()) == s
    assert s.to_dict()["version"] == CONNECTOR_SETTINGS_VERSION
    assert isinstance(ConnectorSettings.from_dict({**s.to_dict(), "kv_read_timeout_s": 3}).kv_read_timeout_s, float)
    spec = ConnectorSpec()  # the topology's defaults are the contract's
    for name in ("progress_thread", "progress_delay_us", "kv_read_timeout_s", "trace"):
        assert getattr(spec, name) == getattr(ConnectorSettings(), name)


@pytest.mark.parametrize("change, key, words", [
    ({"pin_transfer_thread": True}, "pin_transfer_thread", "unknown setting"),
    ({"trace": None}, "trace", "None is not true or false"),
    ({"progress_delay_us": True}, "progress_delay_us", "True is not an integer"),
    ({"staging_blocks": "4"}, "staging_blocks", "'4' is not an integer"),
    ({"version": 0}, "version", "version 0, this connector reads version 2: plan and connector must come"),
])
def test_connector_settings_a_plan_of_another_kind_is_refused_naming_the_key(change, key, words):
    from pdctl.protocol import ConnectorSettings, SettingsError

    with pytest.raises(SettingsError, match=re.escape(words)) as e:
        ConnectorSettings.from_dict({**ConnectorSettings().to_dict(), **change})
    assert e.value.key == key and f"['{key}']" in str(e.value)


def test_connector_settings_missing_keys_are_named():
    from pdctl.protocol import ConnectorSettings, SettingsError

    given = ConnectorSettings().to_dict()
    del given["kv_read_timeout_s"]
    with pytest.raises(SettingsError, match=r"\['kv_read_timeout_s'\]: missing"):
        ConnectorSettings.from_dict(given)
    with pytest.raises(SettingsError, match=r"\['version'\]: the plan was written for .* version None"):
        ConnectorSettings.from_dict({})  # a plan from before the contract had a version
    with pytest.raises(SettingsError, match=r"\]: expected a mapping"):
        ConnectorSettings.from_dict([1])


def test_the_connector_reads_what_the_plan_wrote():
    from types import SimpleNamespace

    from pdctl.connector.common import settings
    from pdctl.plan import build_plan
    from pdctl.protocol import SettingsError
    from pdctl.topology import load_topology

    loaded = load_topology(ROOT / "configs" / "cpu-demo.yaml")
    plan = build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=Path("/s"))
    decode = plan.get("decode-0")
    extra = json.loads(decode.argv[decode.argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]

    def config(x):
        return SimpleNamespace(kv_transfer_config=SimpleNamespace(get_from_extra_config=lambda k, d: x.get(k, d)))

    assert settings(config(extra)).kv_read_timeout_s == loaded.topology.connector.kv_read_timeout_s
    with pytest.raises(SettingsError, match=r"\['pdctl'\]: missing: pdctl's plan writes these settings"):
        settings(config({}))  # the connector started without pdctl's plan


def test_a_server_stopped_for_its_connector_settings_names_the_key_as_its_root_cause():
    from pdctl.launch.logs import root_cause
    from pdctl.protocol import ConnectorSettings, SettingsError

    try:
        ConnectorSettings.from_dict({**ConnectorSettings().to_dict(), "pin_transfer_thread": True})
    except SettingsError as e:
        line = f"(EngineCore_DP0 pid=7) ERROR 12-07 09:00:00 [core.py:1] pdctl.protocol.SettingsError: {e}"
    log = ["INFO loading", "Traceback (most recent call last):", '  File "x.py", line 1', line]
    assert root_cause(log).startswith("pdctl.protocol.SettingsError: pdctl connector: settings "
                                      "kv_connector_extra_config['pdctl']['pin_transfer_thread']: unknown setting")


def test_a_connector_setting_is_a_topology_field_the_plan_copies_or_one_the_plan_decides():
    from pdctl.protocol import ConnectorSettings
    from pdctl.topology.schema import ConnectorSpec

    decided = {"version", "staging_blocks"}  # the contract's own, and per decode from the pairs that reach it
    assert set(ConnectorSettings().to_dict()) - decided <= set(ConnectorSpec.model_fields)
    assert not decided & set(ConnectorSpec.model_fields)
