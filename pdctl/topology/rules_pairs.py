"""Rules between the two roles' pools: the set of pools (names, proxy.exclude_pairs, a partner for each), and
every rule between one prefill pool and one decode pool (block sizes and connector, vLLM's hybrid KV cache manager,
TP, KV cache dtype, model, KV buffers)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pdctl.topology.facts import HMA_OFF_FLAG, _hma_flag, hma_enabled
from pdctl.topology.problems import Loc, Problem, pool_field, pool_loc
from pdctl.topology.rules_hybrid import _unsafe_stock_hybrid
from pdctl.topology.schema import ROLES, VLLM_CACHE_LAYOUT, Pool, Topology


def _pair_label(t: Topology, p: Pool, d: Pool) -> str:
    """'prefill pool p128 -> decode pool d32: ' in a fleet; nothing when each role is one pool."""
    if len(t.prefill) == 1 and len(t.decode) == 1:
        return ""
    return f"prefill pool {p.name} -> decode pool {d.name}: "


def _pair_problems(t: Topology, p: Pool, d: Pool, attention: str | None = None) -> list[Problem]:
    """Every rule that holds between one prefill pool and one decode pool (`attention`: model_attention)."""
    out: list[Problem] = []
    pl, dl = pool_loc(t, "prefill", p), pool_loc(t, "decode", d)
    label = _pair_label(t, p, d)
    pb, db = p.block_size, d.block_size
    assert pb is not None and db is not None  # filled by the pool's validator
    fleet_hint = (f"; or exclude the pair: proxy.exclude_pairs: [[{p.name}, {d.name}]]" if label else "")

    def add(path: Loc, message: str, hint: str | None = None, related: tuple[Loc, ...] = (),
            severity: Literal["error", "warning"] = "error") -> None:
        if hint and severity == "error":
            hint += fleet_hint
        out.append(Problem(path, label + message, hint, related, severity))

    # Block sizes.
    if t.connector.kind == "pdctl":
        if max(pb, db) % min(pb, db):
            add((*dl, "block_size"), f"prefill block {pb} and decode block {db} have no integer ratio",
                "pick block sizes where one divides the other (e.g. 32 -> 64, or 128 -> 32)",
                related=((*pl, "block_size"),))
        elif pb > db and p.tp != d.tp:
            add((*dl, "tp"),
                f"prefill block {pb} > decode block {db} needs the same TP on both sides (got TP {p.tp} -> {d.tp})",
                "use equal TP, or a decode block >= the prefill block",
                related=((*pl, "block_size"), (*dl, "block_size")))
    else:
        if db % pb:
            where = "smaller than" if db < pb else "not a multiple of"
            add((*dl, "block_size"),
                f"vLLM's stock NixlConnector needs the decode block to be a multiple of the prefill "
                f"block; decode {db} is {where} prefill {pb}",
                "use connector.kind: pdctl (pdctl's connector also supports prefill block > "
                "decode block), or make the decode block a multiple of the prefill block",
                related=((*pl, "block_size"),))
        elif pb != db and "cpu" in (p.platform, d.platform):
            add(("connector", "kind"),
                f"vLLM's stock NixlConnector corrupts KV silently on CPU when block sizes differ "
                f"({pb} -> {db}): CPU_ATTN stores K transposed per block and the stock merge "
                f"assumes token rows",
                "use connector.kind: pdctl, or equal block sizes",
                related=((*pl, "block_size"), (*dl, "block_size")), severity="warning")
        if _unsafe_stock_hybrid(t, p, d, attention):
            allowed = t.connector.allow_unsafe_hybrid
            add(("connector", "kind"),
                "the model is hybrid (sliding-window + full attention) and vLLM's hybrid KV cache manager is on: "
                "vLLM's NixlConnector keeps the sliding-window blocks of the token after the prompt, one key short "
                "of what the decode reads for the prompt's last token (at any block sizes; measured: greedy "
                "mismatches at 32 -> 32)"
                + (f", and pairs them start-aligned across block sizes ({pb} -> {db})" if pb != db else "")
                + ": silent KV corruption"
                + ("; allowed by connector.allow_unsafe_hybrid (negative controls only)" if allowed else ""),
                None if allowed else f"use kind: pdctl, or {HMA_OFF_FLAG} on every pool (extra_args)",
                related=((*pl, "block_size"), (*dl, "block_size")), severity="warning" if allowed else "error")

    # vLLM hashes whether HMA is on into NIXL's compatibility hash: a handshake between pools that differ fails.
    if hma_enabled(p) != hma_enabled(d):
        off, off_role, on, on_role = (p, "prefill", d, "decode") if hma_enabled(d) else (d, "decode", p, "prefill")
        flag = _hma_flag(off)
        assert flag is not None
        on_flag = _hma_flag(on)
        add((*pool_loc(t, off_role, off), "extra_args", flag[0]),
            f"{pool_field(t, off_role, off, 'extra_args')} turns vLLM's hybrid KV cache manager off "
            f"({HMA_OFF_FLAG}) and {pool_field(t, on_role, on, 'extra_args')} "
            + ("turns it on" if on_flag else "leaves it on")
            + ": vLLM puts the setting in NIXL's compatibility hash, so every handshake between them fails",
            f"pass {HMA_OFF_FLAG} in both pools' extra_args, or in neither",
            related=((*pool_loc(t, on_role, on), "extra_args") + ((on_flag[0],) if on_flag else ()),))

    # KV layouts. vLLM's NIXL handshake refuses pools whose kv_cache_layout differs; a pair with a Gaudi pool is
    # pdctl's connector's alone (it converts every form from and to Gaudi's K and V tensors, in whole pages).
    gaudi = "hpu" in (p.platform, d.platform)
    if not gaudi and p.kv_layout != d.kv_layout:
        add((*dl, "kv_layout"),
            f"prefill {VLLM_CACHE_LAYOUT[p.kv_layout]} and decode {VLLM_CACHE_LAYOUT[d.kv_layout]} KV cache layouts "
            "differ: vLLM's NIXL handshake needs the same layout on both sides",
            "set the same kv_layout on both pools (HND is every platform's default but Gaudi's)",
            related=((*pl, "kv_layout"),))
    if gaudi and t.connector.kind == "pdctl" and p.tp != d.tp:
        add((*dl, "tp"),
            f"prefill TP {p.tp} and decode TP {d.tp} differ: pdctl reads a Gaudi pool's separate K and V caches in "
            "whole pages, not head slices",
            "use the same tp on both pools", related=((*pl, "tp"),))

    if gaudi and t.connector.kind == "pdctl":
        for where, message, hint in _gaudi_pair_problems(t, p, d, attention):
            add((*(dl if where == "decode" else pl), "platform"), message, hint,
                related=((*(pl if where == "decode" else dl), "platform"),))

    # TP between the roles.
    if p.tp != d.tp:
        if max(p.tp, d.tp) % min(p.tp, d.tp):
            add((*dl, "tp"), f"prefill TP {p.tp} and decode TP {d.tp} have no integer ratio",
                "make one TP a multiple of the other", related=((*pl, "tp"),))
        if p.tp > d.tp and pb != db:
            add((*pl, "tp"),
                f"prefill TP {p.tp} > decode TP {d.tp} is only supported with equal block sizes "
                f"(got {pb} -> {db})",
                "use decode TP >= prefill TP, or equal block sizes", related=((*dl, "tp"),))
        if p.kv_layout != "HND":
            add((*pl, "kv_layout"),
                f"different TP on prefill ({p.tp}) and decode ({d.tp}) needs the prefill's KV in "
                f"HND layout (heads outermost, so a head slice is contiguous); got {p.kv_layout}",
                "set prefill.kv_layout: HND")

    # Same model, same cache dtype, buffers NIXL can move between.
    if t.kv_cache_dtype(p) != t.kv_cache_dtype(d):
        add((*dl, "kv_cache_dtype"),
            f"prefill KV cache dtype '{t.kv_cache_dtype(p)}' and decode "
            f"'{t.kv_cache_dtype(d)}' differ; NIXL copies bytes, it does not convert dtypes",
            "use the same kv_cache_dtype on both roles")
    if p.model and d.model and Path(p.model).name != Path(d.model).name:
        add((*dl, "model"), f"prefill serves '{p.model}' and decode '{d.model}'",
            "prefill and decode must serve the same model")
    pbuf, dbuf = t.kv_buffer_device(p), t.kv_buffer_device(d)
    if "cpu" not in (pbuf, dbuf) and pbuf != dbuf:
        add((*dl, "kv_buffer_device"),
            f"NIXL would move KV from a {pbuf} buffer into a {dbuf} buffer: no backend reads one accelerator "
            "vendor's memory into another's",
            "stage one side in host memory: kv_buffer_device: cpu on one of the two pools",
            related=((*pl, "kv_buffer_device"),))
    return out


def _gaudi_pair_problems(t: Topology, p: Pool, d: Pool, attention: str | None) -> list[tuple[str, str, str]]:
    """What pdctl's connector does not serve yet between a Gaudi pool and another (pdctl.connector.kv_pairs): it
    refuses these at the handshake. (where, message, hint)."""
    pb, db = p.block_size, d.block_size
    assert pb is not None and db is not None
    if d.platform != "hpu":  # a joined decode reads a Gaudi prefill's K and V into its pages' halves, then splits
        if pb <= db:
            return [("prefill", f"a {d.platform} decode reads a Gaudi prefill's separate K and V caches only with a "
                     f"smaller block (pdctl's connector regroups them in the split after receive); got {pb} -> {db}",
                     f"use a decode block that divides {pb} and is smaller (e.g. 16 or 32)")]
        if attention in ("hybrid", "sliding"):
            return [("prefill", f"a {d.platform} decode reading a Gaudi prefill's sliding-window groups (a "
                     f"{attention} model) is not served yet by pdctl's connector", "pair Gaudi prefills with Gaudi "
                     "decodes for this model")]
        return []
    if pb > db:
        return [("decode", f"a Gaudi decode reading a prefill with a bigger block ({pb} -> {db}) is not served yet "
                 "by pdctl's connector", "use a prefill block that divides the decode's")]
    # Equal blocks: the pages are repacked only in a host buffer (vLLM post-processes a device cache only across
    # block sizes); a Gaudi buffer on the device is hpu, in host memory hpu_host.
    host = t.kv_buffer_device(d) == "cpu"
    same = p.platform == "hpu" and (t.kv_buffer_device(p) == "cpu") == host
    if pb == db and not same and not host:
        return [("decode", f"prefill and decode pages differ at equal block sizes ({pb}): pdctl's connector repacks "
                 "them on a Gaudi decode only in its host buffer", "set kv_buffer_device: cpu on the decode pool")]
    return []


def _pool_set_problems(t: Topology) -> list[Problem]:
    """Pool names unique per role, excluded pairs that exist, and every pool with a partner."""
    out: list[Problem] = []
    for role in ROLES:
        seen: dict[str, int] = {}
        for i, g in enumerate(t.pools(role)):
            key = g.name.lower()  # names become lower-case Kubernetes names too
            if key in seen:
                out.append(Problem((role, i, "name"), f"two {role} pools are named '{g.name}'",
                                   "give every pool of a role its own name", related=((role, seen[key], "name"),)))
            seen.setdefault(key, i)
    names = {role: [g.name for g in t.pools(role)] for role in ROLES}
    for k, pair in enumerate(t.proxy.exclude_pairs):
        for role, pool in zip(ROLES, pair, strict=True):
            if pool not in names[role]:
                out.append(Problem(("proxy", "exclude_pairs", k),
                                   f"[{pair[0]}, {pair[1]}] names no {role} pool '{pool}'",
                                   f"{role} pools: {', '.join(names[role])}"))
    allowed = t.pairs()
    for role in ROLES:
        for g in t.pools(role):
            if not any((p if role == "prefill" else d) is g for p, d in allowed):
                out.append(Problem((*pool_loc(t, role, g), "name"),
                                   f"{role} pool '{g.name}' has no partner: proxy.exclude_pairs excludes every "
                                   f"pair it is in", "remove one of its pairs from proxy.exclude_pairs",
                                   related=(("proxy", "exclude_pairs"),)))
    return out
