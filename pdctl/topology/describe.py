"""A topology in one line: what runs where (`pdctl validate`, `pdctl bench`)."""

from __future__ import annotations

from pdctl.topology.facts import ModelInfo, hma_enabled, model_attention
from pdctl.topology.schema import ROLES, Pool, Topology


def summary(t: Topology, info: ModelInfo | None = None) -> str:
    """One line: what runs where, for `pdctl validate` (`info`: the model's facts, by default those the topology
    was loaded with); a model with sliding-window layers says so, with its window and whether HMA is on."""
    def one(pool: Pool) -> str:
        nice = f" nice {pool.nice:+d}" if pool.nice else ""
        return f"{pool.count}x {pool.platform} block {pool.block_size} TP {pool.tp} {pool.kv_layout}{nice}"

    if info is None:
        info = t.origin.model_info if t.origin is not None else ModelInfo()
    proxy = "" if t.proxy.kind == "pdctl" else f", proxy {t.proxy.kind}"
    attention = attention_summary(t, info)
    attention = f"; {attention}" if attention else ""
    if len(t.prefill) == 1 and len(t.decode) == 1:
        return (f"{t.name}: prefill {one(t.prefill[0])} -> decode {one(t.decode[0])}, connector "
                f"{t.connector.kind}{proxy}{attention}")
    sides = [f"{role} pools " + ", ".join(f"{pool.name} ({one(pool)})" for pool in t.pools(role)) for role in ROLES]
    pairs = ", ".join(f"{p.name}->{d.name}" for p, d in t.pairs())
    return f"{t.name}: {sides[0]} -> {sides[1]}; pairs {pairs}; connector {t.connector.kind}{proxy}{attention}"


def attention_summary(t: Topology, info: ModelInfo) -> str | None:
    """'model hybrid (sliding-window + full attention), sliding window 96, HMA on' for a model with sliding-window
    layers; None for the others."""
    attention = model_attention(t, info)
    if attention not in ("hybrid", "sliding"):
        return None
    window = (f"sliding window {info.sliding_window}" if info.sliding_window else
              "sliding window unknown: no local config.json")
    hma = {hma_enabled(g) for role in ROLES for g in t.pools(role)}
    on = ("HMA on" if hma == {True} else "HMA off" if hma == {False} else
          "HMA on in " + ", ".join(f"{role} pool {g.name}" for role in ROLES for g in t.pools(role) if hma_enabled(g))
          + ", off in the others")
    what = "hybrid (sliding-window + full attention)" if attention == "hybrid" else "sliding-window attention"
    return f"model {what}, {window}, {on}"
