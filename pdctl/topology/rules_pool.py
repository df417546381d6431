"""Rules within one pool: CPU block sizes, TP against the model's KV heads, devices, the KV buffer device, what
no process can be started with, and the KV cache's capacity (rules_capacity)."""

from __future__ import annotations

from pdctl.topology.facts import ModelInfo, hma_enabled, model_attention
from pdctl.topology.problems import Problem, pool_loc
from pdctl.topology.rules_capacity import _capacity_problems
from pdctl.topology.rules_hybrid import _hybrid_cpu_blocks
from pdctl.topology.schema import CPU_BLOCK_MULTIPLE, FIXED_LAYOUT, KV_LAYOUT_ENV, Pool, Role, Topology

# vllm-gaudi's switches that replace methods of vLLM's NIXL worker (hetero_hpu_nixl_connector.py: registration,
# descriptors, reads, a permute on save; a joint K|V staging region), which pdctl's connector subclasses.
GAUDI_CONNECTOR_PATCHES = ("VLLM_HPU_HETERO_KV_LAYOUT", "VLLM_HPU_NIXL_JOINT_KV")

# Why a platform's cache keeps its own layout (schema.FIXED_LAYOUT).
_FIXED_WHY = {"cpu": "vLLM-CPU's attention backend (CPU_ATTN) packs its cache head-major, and vLLM-CPU refuses to "
                     "start with VLLM_KV_CACHE_LAYOUT=NHD",
              "hpu": "vllm-gaudi keeps each layer's K and V as separate token-major tensors whatever the setting"}


def _pool_problems(t: Topology, role: Role, pool: Pool, info: ModelInfo) -> list[Problem]:
    """Rules that hold within one pool."""
    out: list[Problem] = []
    loc = pool_loc(t, role, pool)
    assert pool.block_size is not None
    if pool.platform == "cpu" and pool.block_size % CPU_BLOCK_MULTIPLE:
        up = -(-pool.block_size // CPU_BLOCK_MULTIPLE) * CPU_BLOCK_MULTIPLE
        if model_attention(t, info) == "hybrid" and hma_enabled(pool):
            sw, full, nixl = _hybrid_cpu_blocks(pool.block_size)
            out.append(Problem((*loc, "block_size"),
                               f"a hybrid model (sliding-window + full attention) with vLLM's hybrid KV cache "
                               f"manager on needs a block size that is a multiple of {CPU_BLOCK_MULTIPLE} on CPU (got "
                               f"{pool.block_size}): vLLM gives the sliding-window layers a block that is a multiple "
                               f"of {CPU_BLOCK_MULTIPLE} ({sw} here; the full-attention layers {full}), and NIXL's "
                               f"block becomes {'their lcm, ' if sw != full else ''}{nixl}, not {pool.block_size}",
                               f"use {up}"))
        else:
            out.append(Problem((*loc, "block_size"),
                               f"the CPU attention backend needs a block size that is a multiple of "
                               f"{CPU_BLOCK_MULTIPLE} (got {pool.block_size})",
                               f"use {up}"))
    if info.kv_heads and info.kv_heads % pool.tp:
        # TP is at most 64: the hint lists the divisors a pool can use (a huge head count stays cheap).
        divisors = [n for n in range(1, min(info.kv_heads, 64) + 1) if info.kv_heads % n == 0]
        out.append(Problem((*loc, "tp"),
                           f"TP {pool.tp} does not divide the model's {info.kv_heads} KV heads",
                           f"use one of {divisors}"))
    if pool.platform == "cpu" and pool.gpu_memory_utilization is not None:
        out.append(Problem((*loc, "gpu_memory_utilization"), "has no meaning on the cpu platform",
                           "set kv_cache_memory (e.g. '256MiB') instead"))
    if pool.devices is not None and len(pool.devices) < pool.count * pool.tp:
        out.append(Problem((*loc, "devices"),
                           f"{pool.count} instance(s) x TP {pool.tp} need {pool.count * pool.tp} devices, "
                           f"{len(pool.devices)} listed", f"list {pool.count * pool.tp} device ids"))
    # Two instances on one CPU core only slow each other down (a warning, with the cross-pool collisions); on an
    # accelerator the second runs out of memory.
    if pool.platform != "cpu" and pool.devices is not None and len(set(pool.devices)) != len(pool.devices):
        out.append(Problem((*loc, "devices"), "lists a device more than once"))
    if pool.platform != "cpu" and pool.devices is None:
        out.append(Problem((*loc, "devices"),
                           f"{pool.platform} instances need explicit device ids, or every instance takes them all",
                           f"add e.g. devices: {list(range(pool.count * pool.tp))}"))
    fixed = FIXED_LAYOUT.get(pool.platform)
    if fixed and pool.kv_layout != fixed:
        out.append(Problem((*loc, "kv_layout"),
                           f"{pool.kv_layout} cannot reach a {pool.platform} server's KV cache, which is {fixed}: "
                           f"{_FIXED_WHY[pool.platform]}", f"leave kv_layout out (or set {fixed})",
                           related=((*loc, "platform"),)))
    for name in GAUDI_CONNECTOR_PATCHES:
        if t.connector.kind == "pdctl" and pool.env.get(name, "").lower() in ("1", "true"):
            out.append(Problem((*loc, "env", name),
                               "patches vLLM's NIXL worker at class level (vllm-gaudi's own mixed-device path), under "
                               "pdctl's connector, which converts on the decode instead: the KV would be converted "
                               "twice", "leave it out with connector.kind: pdctl"))
    if KV_LAYOUT_ENV in pool.env:
        out.append(Problem((*loc, "env", KV_LAYOUT_ENV), "is what pdctl sets from kv_layout on every server",
                           "set kv_layout instead (HND or NHD)", related=((*loc, "kv_layout"),)))
    buf = t.kv_buffer_device(pool)
    if buf not in ("cpu", pool.platform):
        own = pool.kv_buffer_device is not None
        out.append(Problem((*loc, "kv_buffer_device") if own else ("connector", "kv_buffer_device"),
                           f"'{buf}' does not exist on the {role}'s {pool.platform} platform",
                           f"use 'cpu' or '{pool.platform}', or leave it out to use each platform's",
                           related=((*loc, "platform"),)))
    # What no process can be started with (exec refuses a NUL byte; an environment name cannot hold '=').
    for k, v in pool.env.items():
        if not k or "=" in k or "\0" in k or "\0" in v:
            out.append(Problem((*loc, "env", k), f"{k!r}: {v!r} cannot be an environment variable",
                               "a name is non-empty without '=', and neither holds a NUL character"))
    for i, a in enumerate(pool.extra_args):
        if "\0" in a:
            out.append(Problem((*loc, "extra_args", i), f"{a!r} holds a NUL character, which no argument can"))
    if pool.model and "\0" in pool.model:
        out.append(Problem((*loc, "model"), "holds a NUL character, which no path can"))
    return out + _capacity_problems(t, role, pool, info)
