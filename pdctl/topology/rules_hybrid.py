"""Rules for hybrid models (sliding-window + full attention): the blocks vLLM gives a CPU pool, vLLM's stock
connector with its hybrid KV cache manager on, and model.attention against the local config.json."""

from __future__ import annotations

import math

from pdctl.topology.facts import ModelInfo, hma_enabled, model_attention
from pdctl.topology.problems import Problem
from pdctl.topology.schema import CPU_BLOCK_MULTIPLE, Pool, Topology


def _hybrid_cpu_blocks(block: int) -> tuple[int, int, int]:
    """What vLLM makes of a CPU pool's --block-size for a hybrid model with HMA on: the sliding-window group's
    block, the full-attention group's, and the lcm NIXL advertises. The sliding-window layers pick the largest
    kernel block within it (CPU_ATTN: multiples of 32, at least 32; attention.py); when one group's page divides
    the other's, the smaller group is raised to the larger block, else pages are padded
    (kv_cache_utils.unify_kv_cache_spec_page_size); NIXL's block is the lcm of the groups' (nixl base_worker)."""
    sw = max(CPU_BLOCK_MULTIPLE, block // CPU_BLOCK_MULTIPLE * CPU_BLOCK_MULTIPLE)
    big, small = max(sw, block), min(sw, block)
    if big % small == 0:
        return big, big, big
    return sw, block, math.lcm(sw, block)


def _unsafe_stock_hybrid(t: Topology, p: Pool, d: Pool, attention: str | None) -> bool:
    """vLLM's NixlConnector, a hybrid model with HMA on both sides: each side keeps the tail of its sliding-window
    block list, cut for the window of the token after the prompt, while the decode recomputes the prompt's last
    token, whose window starts one key earlier (a null block for some prompt lengths, at any block sizes:
    docs/notes/hybrid-pairing.md); across block sizes vLLM also pairs the two tails from their starts
    (docs/notes/hybrid-attention-research.md, Q3)."""
    return t.connector.kind == "nixl" and attention == "hybrid" and hma_enabled(p) and hma_enabled(d)


def _attention_problems(t: Topology, info: ModelInfo) -> list[Problem]:
    """model.attention against the local config.json, and connector.allow_unsafe_hybrid where it does nothing."""
    out: list[Problem] = []
    said = t.model.attention
    if said and info.attention and said != info.attention:
        out.append(Problem(("model", "attention"), f"says {said}, but {info.config} says {info.attention} "
                           f"({info.attention_why})",
                           "remove model.attention (a local config.json decides), or point model.path at the model "
                           "you mean"))
    attention = model_attention(t, info)
    if t.connector.allow_unsafe_hybrid and not any(_unsafe_stock_hybrid(t, p, d, attention) for p, d in t.pairs()):
        out.append(Problem(("connector", "allow_unsafe_hybrid"),
                           "has no effect here: it only lets vLLM's stock connector (kind: nixl) pair a hybrid "
                           "model's KV across different block sizes with the hybrid KV cache manager on",
                           "remove it", severity="warning"))
    return out
