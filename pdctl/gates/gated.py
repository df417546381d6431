"""The settings a gated phase runs with: a request whose KV did not travel must fail, never pass as P/D.

`proxy.on_prefill_down: fallback` lets the proxy send a request to a decode alone when no prefill answers with
usable KV, and `connector.kv_load_failure_policy: recompute` lets a decode compute a prompt whose KV read failed:
both answer correctly, so parity and accuracy would count them as P/D. `pdctl check`, `eval` and `bench` bring
topologies up with `reject` and `fail` instead, unless the command line sets those fields itself.
"""

from __future__ import annotations

from pdctl.topology import Override, Topology

GATE_SETTINGS: tuple[tuple[tuple[str, str], str], ...] = (
    (("proxy", "on_prefill_down"), "reject"),
    (("connector", "kv_load_failure_policy"), "fail"),
)
GATE_FLAG = "gate"


def _user_value(overrides: list[Override], path: tuple[str, str]) -> Override | None:
    """The last override that sets `path`: the field itself, or its whole section as a mapping holding it."""
    found = None
    for o in overrides:
        if tuple(o.path) == path or (tuple(o.path) == path[:1] and isinstance(o.value, dict) and path[1] in o.value):
            found = o
    return found


def gated(overrides: list[Override]) -> tuple[list[Override], list[str], list[str]]:
    """(the overrides with the gate's settings appended, the settings applied, the user's that were kept).

    A setting the user gave on the command line wins (a deliberate experiment); the gate says so.
    """
    out = list(overrides)
    applied, kept = [], []
    for path, value in GATE_SETTINGS:
        name = ".".join(path)
        user = _user_value(out, path)
        if user is None:
            out.append(Override(path, value, GATE_FLAG))
            applied.append(f"{name}={value}")
        else:
            given = user.value if tuple(user.path) == path else user.value[path[1]]
            if given != value:
                kept.append(f"{name}={given} ({user.flag})")
            else:
                applied.append(f"{name}={value}")
    return out, applied, kept


def gated_lines(applied: list[str], kept: list[str]) -> tuple[str | None, str | None]:
    """(the note that says what the gate runs with, the warning for what the user kept)."""
    note = (f"gated: {', '.join(applied)} (a request without transferred KV fails instead of passing as P/D)"
            if applied else None)
    warning = (f"warning: {', '.join(kept)} set on the command line: a request served without transferred KV "
               "may count as P/D" if kept else None)
    return note, warning


def running_warning(topology: Topology) -> str | None:
    """What a running system's plan says that a gate cannot change: fallback or recompute let a request be
    answered without its KV travelling (the transfer proof and the proxy's fallback counter still fail on it)."""
    on_down = topology.proxy.on_prefill_down
    policy = topology.connector.kv_load_failure_policy
    loose = [f"proxy.on_prefill_down={on_down}"] if on_down != "reject" else []
    loose += [f"connector.kv_load_failure_policy={policy}"] if policy != "fail" else []
    if not loose:
        return None
    return (f"warning: the running system has {', '.join(loose)}, which a gate cannot change: a request may be "
            "answered without its KV travelling (bring it up with --set proxy.on_prefill_down=reject --set "
            "connector.kv_load_failure_policy=fail, or let the gate bring the topology up)")
