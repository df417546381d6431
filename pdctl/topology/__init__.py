"""The topology: pydantic models of the YAML, and every compatibility rule checked before anything starts.

Pure apart from `load_topology` / `read_model_info`, which read the YAML and the model's config.json.
Errors are collected (never raised one at a time) and each names file:line, the field and how to fix it.

One module per concern; this package hands their names on:
  schema.py      the pydantic models of the YAML (model, pools per role, proxy, connector, engine, auth, ...)
  problems.py    Problem, Source, TopologyError; where a problem is; pydantic's errors as problems
  facts.py       the model's facts from its config.json, its path, its attention; a pool's hybrid KV cache manager
  describe.py    a topology in one line
  rules_*.py     the compatibility rules by subject (hybrid, pairs, pool, capacity, engine, proxy, exposure,
                 collisions), run in order by rules.py
  overrides.py   command-line changes (--set, the role flags, --monitoring), the removed flags' replacements
  load.py        the YAML read, overridden, validated and checked
"""

import warnings

from pdctl.topology.describe import attention_summary, summary
from pdctl.topology.facts import (
    HMA_OFF_FLAG,
    HMA_ON_FLAG,
    KNOWN_MODEL_KV_HEADS,
    ModelInfo,
    hma_enabled,
    is_local_path,
    model_attention,
    read_model_info,
    resolve_path,
    resolved_model,
)
from pdctl.topology.load import Loaded, load_topology, validate_data
from pdctl.topology.overrides import (
    MONITORING_ON,
    REMOVED_OVERRIDE_FLAGS,
    ROLE_FLAGS,
    Override,
    OverrideConflict,
    apply_overrides,
)
from pdctl.topology.problems import Loc, Problem, Source, TopologyError, pool_field, pool_loc, user_loc
from pdctl.topology.rules import compatibility_problems
from pdctl.topology.rules_capacity import kv_bytes_per_token
from pdctl.topology.rules_exposure import is_loopback
from pdctl.topology.rules_hybrid import _hybrid_cpu_blocks as _hybrid_cpu_blocks  # for the unit tests
from pdctl.topology.rules_proxy import ROUTER_UNSUPPORTED
from pdctl.topology.schema import (
    CPU_BLOCK_MULTIPLE,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_POOL,
    MAX_POOLS,
    POOL_NAME_PATTERN,
    RAY_PLACEMENT,
    ROLE_PORTS,
    ROLES,
    ROUTER_POLICY,
    SLURM_PLACEMENT,
    AuthSpec,
    BufferDevice,
    ByteSize,
    ConnectorSpec,
    EngineKind,
    EngineSpec,
    KvLayout,
    ModelSpec,
    MonitoringSpec,
    Placement,
    Platform,
    Policy,
    Pool,
    Pools,
    Port,
    ProxyKind,
    ProxySettings,
    ProxySpec,
    ReferenceSpec,
    Role,
    SupervisionSpec,
    Topology,
    instance_name,
    parse_bytes,
)

__all__ = [
    "attention_summary", "summary", "HMA_OFF_FLAG", "HMA_ON_FLAG", "KNOWN_MODEL_KV_HEADS", "ModelInfo",
    "hma_enabled", "is_local_path", "model_attention", "read_model_info", "resolve_path", "resolved_model",
    "Loaded", "load_topology", "validate_data", "MONITORING_ON", "REMOVED_OVERRIDE_FLAGS", "ROLE_FLAGS", "Override",
    "OverrideConflict", "apply_overrides", "Loc", "Problem", "Source", "TopologyError", "pool_field", "pool_loc",
    "user_loc",
    "compatibility_problems", "kv_bytes_per_token", "is_loopback", "ROUTER_UNSUPPORTED",
    "CPU_BLOCK_MULTIPLE", "DEFAULT_BLOCK_SIZE", "DEFAULT_POOL", "MAX_POOLS", "POOL_NAME_PATTERN", "RAY_PLACEMENT",
    "ROLE_PORTS", "ROLES", "ROUTER_POLICY", "SLURM_PLACEMENT", "AuthSpec", "BufferDevice", "ByteSize",
    "ConnectorSpec", "EngineKind", "EngineSpec", "KvLayout", "ModelSpec", "MonitoringSpec", "Placement",
    "Platform", "Policy", "Pool", "Pools", "Port", "ProxyKind", "ProxySettings", "ProxySpec", "ReferenceSpec",
    "Role", "SupervisionSpec", "Topology", "instance_name", "parse_bytes",
]


def __getattr__(name: str):
    if name == "InstanceGroup":  # renamed; removed in 0.3
        warnings.warn("pdctl.topology.InstanceGroup is renamed to pdctl.topology.Pool", DeprecationWarning,
                      stacklevel=2)
        return Pool
    raise AttributeError(f"module 'pdctl.topology' has no attribute {name!r}")
