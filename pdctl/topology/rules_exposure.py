"""Who can reach the servers and the proxy: a warning for each one other machines can reach while no API key is
required (auth.api_key_env)."""

from __future__ import annotations

import ipaddress

from pdctl.topology.problems import Problem, pool_loc
from pdctl.topology.schema import ROLES, Topology


def is_loopback(host: str) -> bool:
    """Whether a listen address is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it resolves to whatever the network says
        return False


def _exposure_problems(t: Topology) -> list[Problem]:
    """A warning for every server or proxy that other machines can reach while no API key is required."""
    if t.auth is not None and t.auth.api_key_env:
        return []
    hint = ("set auth.api_key_env: NAME (an environment variable holding the key) so every server and the proxy "
            "require it, or listen on 127.0.0.1")
    what = "and no API key is required (auth.api_key_env): anyone who reaches it can use the model"
    out: list[Problem] = []
    if t.engine.kind != "local":
        out.append(Problem(("engine", "kind"), f"on the {t.engine.kind} engine every instance listens on its "
                           f"node's address, {what}", hint, severity="warning"))
    else:
        for role in ROLES:
            for g in t.pools(role):
                if not is_loopback(g.host):
                    out.append(Problem((*pool_loc(t, role, g), "host"), f"{g.host} is reachable from other "
                                       f"machines, {what}", hint, severity="warning"))
    if not is_loopback(t.proxy.host):
        out.append(Problem(("proxy", "host"), f"{t.proxy.host} is reachable from other machines, {what}", hint,
                           severity="warning"))
    return out
