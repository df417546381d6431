"""Every (host, port) and (host, platform, device) is claimed by one process at most: the instances, the proxy,
vllm-router's /metrics and Prometheus."""

from __future__ import annotations

from pdctl.topology.problems import Loc, Problem, pool_loc
from pdctl.topology.schema import DEFAULT_POOL, ROLES, Topology


def _collisions(t: Topology) -> list[Problem]:
    """Every (host, port) and (host, platform, device) is claimed by one process at most."""
    ports: dict[tuple[str, int], str] = {}
    devices: dict[tuple[str, str, int], str] = {}
    out: list[Problem] = []

    def claim(table: dict, key: tuple, owner: str, path: Loc, what: str, severity: str = "error",
              hint: str | None = None) -> None:
        if key in table and table[key] != owner:
            hint = hint or ("give each pool its own range (instance i uses base + i), or leave the ports out"
                            if table is ports else "instances sharing a device slow each other down or run out of "
                            "memory; give each its own devices where the host has them")
            out.append(Problem(path, f"{what} {key[-1]} of {owner} is also used by {table[key]}", hint,
                               severity=severity))
        table.setdefault(key, owner)

    for role in ROLES:
        for g in t.pools(role):
            loc = pool_loc(t, role, g)
            for i in range(g.count):
                owner = f"{role}[{i}]" if g.name == DEFAULT_POOL else f"{role} pool {g.name}[{i}]"
                claim(ports, (g.host, g.http_port_of(i)), owner, (*loc, "http_port"), "HTTP port")
                claim(ports, (g.host, g.side_channel_port_of(i)), owner, (*loc, "side_channel_port"),
                      "NIXL side-channel port")
                for dev in g.devices_of(i) or []:
                    # Shared CPU cores only slow instances down; a shared accelerator runs out of memory.
                    claim(devices, (g.host, g.platform, dev), owner, (*loc, "devices"), f"{g.platform} device",
                          "warning" if g.platform == "cpu" else "error")
    claim(ports, (t.proxy.host, t.proxy.port), "the proxy", ("proxy", "port"), "port")
    if t.monitoring.enabled:
        claim(ports, (t.monitoring.host, t.monitoring.port), "Prometheus (monitoring)", ("monitoring", "port"),
              "port", hint="give monitoring.port a port no instance and not the proxy uses")
    if t.proxy.router_metrics_port is not None:
        claim(ports, (t.proxy.host, t.proxy.router_metrics_port), "vllm-router's /metrics",
              ("proxy", "metrics_port"), "port")
    # One report per colliding field is enough.
    seen: set[Loc] = set()
    return [p for p in out if not (p.path in seen or seen.add(p.path))]
