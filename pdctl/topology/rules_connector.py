"""Rules of the connector's settings: a KV read timeout that fits in the prefill's KV lease; pdctl settings in
connector.extra_config that pdctl's connector reads (pdctl.protocol.ConnectorSettings)."""

from __future__ import annotations

from pdctl.kv.lease import KV_LEASE_S, check_settings
from pdctl.protocol import CONNECTOR_SETTINGS_KEY, ConnectorSettings, SettingsError
from pdctl.topology.problems import Problem
from pdctl.topology.schema import Topology


def _connector_problems(t: Topology) -> list[Problem]:
    c = t.connector
    if c.kind != "pdctl":
        return []
    settings = _settings_problems(c.extra_config.get(CONNECTOR_SETTINGS_KEY))
    if settings:
        return settings
    lease = c.extra_config.get("kv_lease_duration", KV_LEASE_S)
    try:
        lease = float(lease)
    except (TypeError, ValueError):
        return [Problem(("connector", "extra_config", "kv_lease_duration"), f"'{lease}' is not a number of seconds",
                        f"vLLM's default is {KV_LEASE_S:g}")]
    why = check_settings(lease, c.kv_read_timeout_s)
    if why is None:
        return []
    return [Problem(("connector", "kv_read_timeout_s"), why,
                    f"the default {ConnectorSettings.kv_read_timeout_s:g} s fits vLLM's default lease "
                    f"({KV_LEASE_S:g} s)")]


def _settings_problems(given) -> list[Problem]:
    """connector.extra_config.pdctl overrides pdctl's connector settings one by one: each must be one it reads."""
    if given is None:
        return []
    where = ("connector", "extra_config", CONNECTOR_SETTINGS_KEY)
    try:
        ConnectorSettings.from_dict({**ConnectorSettings().to_dict(), **given} if isinstance(given, dict) else given)
    except SettingsError as e:
        path = (*where, e.key) if e.key else where
        return [Problem(path, e.reason, "the topology's connector fields set these (pdctl validate --help); "
                        f"pdctl's connector reads {', '.join(ConnectorSettings().to_dict())}")]
    return []
