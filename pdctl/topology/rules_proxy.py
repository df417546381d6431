"""Rules of the proxy: what vllm-router cannot do (refused, never silently dropped)."""

from __future__ import annotations

from pdctl.topology.problems import Problem, pool_loc
from pdctl.topology.schema import ROLES, ProxySpec, Topology

# Proxy fields vllm-router has no equivalent for: refused when the topology sets them.
ROUTER_UNSUPPORTED = {
    "exclude_pairs": "it pairs every prefill with every decode",
    "affinity_epsilon": "its cache_aware policy has its own load balance thresholds",
    "affinity_prefix_chars": "its cache_aware policy matches whole prompts in a radix tree",
    "connect_timeout_s": "it has one whole-request timeout (first_byte_timeout_s maps to it)",
    "read_timeout_s": "it has one whole-request timeout (first_byte_timeout_s maps to it)",
}


def _router_problems(t: Topology) -> list[Problem]:
    """What vllm-router cannot do that the topology asks for (refused, never silently dropped)."""
    px = t.proxy
    out: list[Problem] = []
    if px.kind != "vllm-router":
        if px.metrics_port is not None:
            out.append(Problem(("proxy", "metrics_port"), "is for proxy.kind: vllm-router; pdctl's proxy serves "
                               "/metrics on its own port", "remove it"))
        return out
    hint = "remove it, or use proxy.kind: pdctl"
    for name, why in ROUTER_UNSUPPORTED.items():
        if name in px.model_fields_set and getattr(px, name) != ProxySpec.model_fields[name].get_default(
                call_default_factory=True):
            out.append(Problem(("proxy", name), f"vllm-router has no equivalent: {why}", hint))
    if "on_prefill_down" in px.model_fields_set and px.on_prefill_down == "fallback":
        out.append(Problem(("proxy", "on_prefill_down"), "vllm-router has no decode-only fallback: when no "
                           "prefill answers, it answers an error (on_prefill_down: reject)", hint))
    for role in ROLES:
        for g in t.pools(role):
            if g.weight != 1.0:
                out.append(Problem((*pool_loc(t, role, g), "weight"), "vllm-router has no weights per pool: its "
                                   "policies treat every instance alike", hint))
    if t.auth is not None and t.auth.api_key_env:
        out.append(Problem(("auth", "api_key_env"), "vllm-router takes the key it sends to the servers only on "
                           "its command line (--api-key), where pdctl never puts a key, and requires none from "
                           "clients", "use proxy.kind: pdctl with auth"))
    return out
