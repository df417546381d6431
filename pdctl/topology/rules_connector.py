"""Rules of the connector's settings: a KV read timeout that fits in the prefill's KV lease."""

from __future__ import annotations

from pdctl.kv.lease import KV_LEASE_S, READ_TIMEOUT_S, check_settings
from pdctl.topology.problems import Problem
from pdctl.topology.schema import Topology


def _connector_problems(t: Topology) -> list[Problem]:
    c = t.connector
    if c.kind != "pdctl":
        return []
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
                    f"the default {READ_TIMEOUT_S:g} s fits vLLM's default lease ({KV_LEASE_S:g} s)")]
