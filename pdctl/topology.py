"""The topology: pydantic models of the YAML, and every compatibility rule checked before anything starts.

Pure apart from `load_topology` / `read_model_info`, which read the YAML and the model's config.json.
Errors are collected (never raised one at a time) and each names file:line, the field and how to fix it.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from pdctl import yamlsrc

Platform = Literal["cuda", "cpu", "xpu", "hpu"]
Role = Literal["prefill", "decode"]
ROLES: tuple[Role, Role] = ("prefill", "decode")

# vLLM names the per-layer cache layout by its dimension order; HND/NHD are the short forms used by the
# NIXL connector (kv_cache_layout), LBHNC/LBNHC the long ones.
_LAYOUT_ALIASES = {"HND": "HND", "NHD": "NHD", "LBHNC": "HND", "LBNHC": "NHD"}

# Platform defaults when a role leaves block_size out (the attention backends' usual kernel block).
DEFAULT_BLOCK_SIZE: dict[str, int] = {"cuda": 16, "cpu": 32, "xpu": 64, "hpu": 128}
CPU_BLOCK_MULTIPLE = 32  # CPU_ATTN kernel: "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"

# KV heads of hub models that example topologies use, so TP rules work without downloading config.json.
KNOWN_MODEL_KV_HEADS: dict[str, int] = {"Qwen/Qwen3-0.6B": 8, "Qwen/Qwen3-8B": 8, "meta-llama/Llama-3.1-8B-Instruct": 8}


def _layout(v: Any) -> Any:
    if isinstance(v, str) and v.upper() in _LAYOUT_ALIASES:
        return _LAYOUT_ALIASES[v.upper()]
    return v


_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(v: Any) -> Any:
    """'256MiB' -> 268435456; ints pass through; anything else is left for pydantic to reject."""
    if isinstance(v, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", v)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
        raise ValueError(f"{v!r} is not a size; write e.g. 268435456, '256MiB' or '1GiB'")
    return v


KvLayout = Annotated[Literal["HND", "NHD"], BeforeValidator(_layout)]
ByteSize = Annotated[int, BeforeValidator(parse_bytes), Field(gt=0)]
Port = Annotated[int, Field(ge=1024, le=65535)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class ModelSpec(_Strict):
    path: str = Field(min_length=1, description="local directory or hub id")
    served_name: str | None = None
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    max_model_len: int | None = Field(None, ge=16)
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    kv_heads: int | None = Field(None, ge=1, description="KV heads, when config.json is not local")
    seed: int = 0

    @property
    def name(self) -> str:
        return self.served_name or self.path


class InstanceGroup(_Strict):
    """All instances of one role. Instance i gets http_port+i, side_channel_port+i, devices[i*tp:(i+1)*tp]."""

    platform: Platform = "cpu"
    count: int = Field(1, ge=1, le=64)
    block_size: int | None = Field(None, ge=1, le=2048)
    tp: int = Field(1, ge=1, le=64)
    devices: list[Annotated[int, Field(ge=0)]] | None = None
    kv_layout: KvLayout = "HND"
    host: str = "127.0.0.1"
    http_port: Port
    side_channel_port: Port
    kv_cache_memory: ByteSize | None = None
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    enforce_eager: bool | None = None
    model: str | None = Field(None, description="model path on this role's hosts, if it differs")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] | None = None
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _platform_defaults(self) -> InstanceGroup:
        if self.block_size is None:
            self.block_size = DEFAULT_BLOCK_SIZE[self.platform]
        if self.enforce_eager is None:
            # Compiled and eager numerics differ on CPU; exact-match gates need every server in one mode.
            self.enforce_eager = self.platform == "cpu"
        if self.platform == "cpu" and self.kv_cache_memory is None and self.gpu_memory_utilization is None:
            self.kv_cache_memory = 256 * 2**20
        return self

    def http_port_of(self, index: int) -> int:
        return self.http_port + index

    def side_channel_port_of(self, index: int) -> int:
        # vLLM's NIXL side channel is one listener per engine (base + DP index), whatever the TP.
        return self.side_channel_port + index

    def devices_of(self, index: int) -> list[int] | None:
        if self.devices is None:
            return None
        return self.devices[index * self.tp : (index + 1) * self.tp]


class PrefillGroup(InstanceGroup):
    http_port: Port = 8100
    side_channel_port: Port = 5600


class DecodeGroup(InstanceGroup):
    http_port: Port = 8200
    side_channel_port: Port = 5700


class ProxySpec(_Strict):
    host: str = "127.0.0.1"
    port: Port = 8000
    policy: Literal["least_outstanding", "round_robin"] = "least_outstanding"
    strict: bool = Field(False, description="fail a request whose prefill returned no usable kv_transfer_params")
    connect_timeout_s: float = Field(10.0, gt=0)
    read_timeout_s: float = Field(600.0, gt=0)


class ConnectorSpec(_Strict):
    kind: Literal["pdctl", "nixl"] = Field(
        "pdctl", description="pdctl = pdctl's heterogeneous connector; nixl = vLLM's stock NixlConnector"
    )
    kv_buffer_device: Literal["cpu", "cuda", "xpu", "hpu"] | None = None
    backends: list[str] = Field(default_factory=lambda: ["UCX"], min_length=1)
    progress_thread: bool = True
    progress_delay_us: int = Field(1000, ge=0, description="sleep between NIXL progress passes (pdctl only)")
    worker_spin_s: float | None = Field(
        None, ge=0, description="how long vLLM's executor queues spin after a message (pdctl only; "
        "default 0 on CPU, where the spin starves compute and NIXL, vLLM's 1 s elsewhere)")
    extra_config: dict[str, Any] = Field(default_factory=dict)


class Placement(_Strict):
    """Where one role's instances run on a cluster engine. Ray: resources/labels/node; Slurm: the rest."""

    resources: dict[str, float] = Field(default_factory=dict, description="Ray custom resources a node must have")
    labels: dict[str, str] = Field(default_factory=dict, description="Ray node labels a node must carry")
    node: str | None = Field(None, description="Ray: node IP; for the proxy also 'local' (where pdctl runs)")
    partition: str | None = Field(None, description="Slurm partition")
    nodelist: list[str] | None = Field(None, min_length=1, description="Slurm node names")
    gres: str | None = Field(None, description="Slurm generic resources per instance, e.g. gpu:1")


RAY_PLACEMENT = ("resources", "labels", "node")
SLURM_PLACEMENT = ("partition", "nodelist", "gres")
EngineKind = Literal["local", "ray", "slurm"]


class EngineSpec(_Strict):
    """What runs the plan: this host's process groups, a Ray cluster, or a Slurm cluster."""

    kind: EngineKind = "local"
    address: str | None = Field(None, description="Ray: the cluster's GCS address host:port")
    namespace: str | None = Field(None, description="Ray namespace (default: the topology's name)")
    placement: dict[Literal["prefill", "decode", "proxy"], Placement] = Field(default_factory=dict)
    placement_timeout_s: float = Field(120.0, gt=0, description="how long an instance may wait for a node")
    time_limit: str = Field("UNLIMITED", description="Slurm job time limit")


class Topology(_Strict):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")
    model: ModelSpec
    prefill: PrefillGroup
    decode: DecodeGroup
    proxy: ProxySpec = Field(default_factory=ProxySpec)
    connector: ConnectorSpec = Field(default_factory=ConnectorSpec)
    engine: EngineSpec = Field(default_factory=EngineSpec)

    def group(self, role: Role) -> InstanceGroup:
        return self.prefill if role == "prefill" else self.decode

    def model_path(self, role: Role) -> str:
        return self.group(role).model or self.model.path

    def kv_cache_dtype(self, role: Role) -> str:
        return self.group(role).kv_cache_dtype or self.model.kv_cache_dtype


# --------------------------------------------------------------------------------------------------------------
# Problems


Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class Problem:
    path: Loc
    message: str
    hint: str | None = None
    related: tuple[Loc, ...] = ()
    severity: Literal["error", "warning"] = "error"


@dataclass
class Source:
    """Where the topology came from: the file, its key lines, and which paths the command line overrode."""

    filename: str
    located: yamlsrc.Located | None = None
    overridden: dict[Loc, str] = field(default_factory=dict)

    def describe(self, problem: Problem) -> str:
        dotted = ".".join(str(p) for p in problem.path) or "(top level)"

        def flag_for(path: Loc) -> str | None:
            return next((f for loc, f in self.overridden.items() if path[: len(loc)] == loc), None)

        direct = flag_for(problem.path)
        if direct:
            where = f"command line ({direct})"
        else:
            line = self.located.line_of(problem.path) if self.located else None
            where = f"{self.filename}:{line}" if line else self.filename
        label = "warning: " if problem.severity == "warning" else ""
        text = f"{where}: {label}{dotted}: {problem.message}"
        if direct:
            text += " [this value came from the command line]"
        else:
            other = next((f for r in problem.related if (f := flag_for(r))), None)
            if other:
                text += f" [the other value came from the command line: {other}]"
        if problem.hint:
            text += f"\n    fix: {problem.hint}"
        return text


class TopologyError(Exception):
    def __init__(self, source: Source, problems: list[Problem]):
        self.source = source
        line = source.located.line_of if source.located else (lambda _: None)
        self.problems = sorted(problems, key=lambda p: (line(p.path) or 10**9))
        super().__init__(self.render())

    def render(self) -> str:
        n = len(self.problems)
        head = f"{self.source.filename}: {n} problem{'s' if n != 1 else ''}"
        return "\n".join([head, *("  " + self.source.describe(p) for p in self.problems)])


# --------------------------------------------------------------------------------------------------------------
# Pydantic errors -> problems


def _submodel(cls: type[BaseModel], loc: Loc) -> type[BaseModel] | None:
    for part in loc:
        if not isinstance(part, str) or part not in cls.model_fields:
            return None
        ann = cls.model_fields[part].annotation
        nxt = next((a for a in (ann, *typing.get_args(ann)) if isinstance(a, type) and issubclass(a, BaseModel)),
                   None)
        if nxt is None:
            return None
        cls = nxt
    return cls


def _from_validation_error(err: ValidationError) -> list[Problem]:
    problems = []
    for e in err.errors(include_url=False):
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith(("function-", "literal["))))
        kind = e["type"]
        if kind == "extra_forbidden":
            key = str(loc[-1])
            model = _submodel(Topology, loc[:-1])
            known = sorted(model.model_fields) if model else []
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else (f"known keys: {', '.join(known)}" if known else None)
            problems.append(Problem(loc, f"unknown key '{key}'", hint))
        elif kind == "missing":
            problems.append(Problem(loc, "required field is missing", f"add '{loc[-1]}:' here"))
        else:
            msg = e["msg"].removeprefix("Value error, ")
            got = e.get("input")
            if kind not in ("value_error",) and not isinstance(got, (dict, list)):
                msg += f" (got {got!r})"
            problems.append(Problem(loc, msg))
    return problems


# --------------------------------------------------------------------------------------------------------------
# Compatibility rules


@dataclass(frozen=True)
class ModelInfo:
    kv_heads: int | None = None
    attention_heads: int | None = None
    max_position: int | None = None
    vocab_size: int | None = None


def read_model_info(topo_model: ModelSpec, base_dir: Path) -> ModelInfo:
    """What the rules need from the model: its config.json when local, else the topology's or a known value."""
    path = resolve_path(topo_model.path, base_dir)
    cfg_file = path / "config.json"
    if cfg_file.is_file():
        try:
            cfg = json.loads(cfg_file.read_text())
        except (OSError, ValueError):
            cfg = {}
        heads = cfg.get("num_attention_heads")
        return ModelInfo(
            kv_heads=topo_model.kv_heads or cfg.get("num_key_value_heads") or heads,
            attention_heads=heads,
            max_position=cfg.get("max_position_embeddings"),
            vocab_size=cfg.get("vocab_size"),
        )
    return ModelInfo(kv_heads=topo_model.kv_heads or KNOWN_MODEL_KV_HEADS.get(topo_model.path))


def resolve_path(value: str, base_dir: Path) -> Path:
    """Relative model paths are relative to the topology file, like docker-compose's."""
    p = Path(value).expanduser()
    return p if p.is_absolute() else Path(os.path.normpath(base_dir / p))


def is_local_path(value: str) -> bool:
    return value.startswith((".", "/", "~")) or not re.fullmatch(r"[\w.-]+/[\w.-]+", value)


def resolved_model(t: Topology, role: Role, base_dir: Path) -> str:
    """The role's model as its servers get it: a local path made absolute, a hub id as it is."""
    raw = t.model_path(role)
    return str(resolve_path(raw, base_dir)) if is_local_path(raw) else raw


def compatibility_problems(t: Topology, info: ModelInfo = ModelInfo()) -> list[Problem]:
    out: list[Problem] = []
    p, d = t.prefill, t.decode
    pb, db = p.block_size, d.block_size
    assert pb is not None and db is not None  # filled by the group's validator

    # Block sizes.
    if t.connector.kind == "pdctl":
        if max(pb, db) % min(pb, db):
            out.append(Problem(("decode", "block_size"),
                               f"prefill block {pb} and decode block {db} have no integer ratio",
                               "pick block sizes where one divides the other (e.g. 32 -> 64, or 128 -> 32)",
                               related=(("prefill", "block_size"),)))
        elif pb > db and (p.tp != d.tp or p.kv_layout != d.kv_layout):
            out.append(Problem(("decode", "tp") if p.tp != d.tp else ("decode", "kv_layout"),
                               f"prefill block {pb} > decode block {db} needs the same TP and KV layout on both "
                               f"sides (got TP {p.tp} -> {d.tp}, {p.kv_layout} -> {d.kv_layout})",
                               "use equal TP and layouts, or a decode block >= the prefill block",
                               related=(("prefill", "block_size"), ("decode", "block_size"))))
    else:
        if db % pb:
            where = "smaller than" if db < pb else "not a multiple of"
            out.append(Problem(("decode", "block_size"),
                               f"vLLM's stock NixlConnector needs the decode block to be a multiple of the prefill "
                               f"block; decode {db} is {where} prefill {pb}",
                               "use connector.kind: pdctl (pdctl's connector also supports prefill block > "
                               "decode block), or make the decode block a multiple of the prefill block",
                               related=(("prefill", "block_size"),)))
        elif pb != db and "cpu" in (p.platform, d.platform):
            out.append(Problem(("connector", "kind"),
                               f"vLLM's stock NixlConnector corrupts KV silently on CPU when block sizes differ "
                               f"({pb} -> {db}): CPU_ATTN stores K transposed per block and the stock merge "
                               f"assumes token rows",
                               "use connector.kind: pdctl, or equal block sizes",
                               related=(("prefill", "block_size"), ("decode", "block_size")), severity="warning"))
    for role in ROLES:
        g = t.group(role)
        assert g.block_size is not None
        if g.platform == "cpu" and g.block_size % CPU_BLOCK_MULTIPLE:
            up = -(-g.block_size // CPU_BLOCK_MULTIPLE) * CPU_BLOCK_MULTIPLE
            out.append(Problem((role, "block_size"),
                               f"the CPU attention backend needs a block size that is a multiple of "
                               f"{CPU_BLOCK_MULTIPLE} (got {g.block_size})",
                               f"use {up}"))
        if info.kv_heads and info.kv_heads % g.tp:
            divisors = [n for n in range(1, info.kv_heads + 1) if info.kv_heads % n == 0]
            out.append(Problem((role, "tp"),
                               f"TP {g.tp} does not divide the model's {info.kv_heads} KV heads",
                               f"use one of {divisors}"))
        if g.platform == "cpu" and g.gpu_memory_utilization is not None:
            out.append(Problem((role, "gpu_memory_utilization"), "has no meaning on the cpu platform",
                               "set kv_cache_memory (e.g. '256MiB') instead"))
        if g.devices is not None and len(g.devices) < g.count * g.tp:
            out.append(Problem((role, "devices"),
                               f"{g.count} instance(s) x TP {g.tp} need {g.count * g.tp} devices, "
                               f"{len(g.devices)} listed", f"list {g.count * g.tp} device ids"))
        if g.devices is not None and len(set(g.devices)) != len(g.devices):
            out.append(Problem((role, "devices"), "lists a device more than once"))
        if g.platform != "cpu" and g.devices is None:
            out.append(Problem((role, "devices"),
                               f"{g.platform} instances need explicit device ids, or every instance takes them all",
                               f"add e.g. devices: {list(range(g.count * g.tp))}"))
        if t.connector.kv_buffer_device and t.connector.kv_buffer_device not in ("cpu", g.platform):
            out.append(Problem(("connector", "kv_buffer_device"),
                               f"'{t.connector.kv_buffer_device}' does not exist on the {role}'s {g.platform} "
                               "platform", f"use 'cpu' or '{g.platform}', or leave it out to use each platform's",
                               related=((role, "platform"),)))

    # TP between the roles.
    if p.tp != d.tp:
        if max(p.tp, d.tp) % min(p.tp, d.tp):
            out.append(Problem(("decode", "tp"), f"prefill TP {p.tp} and decode TP {d.tp} have no integer ratio",
                               "make one TP a multiple of the other", related=(("prefill", "tp"),)))
        if p.tp > d.tp and pb != db:
            out.append(Problem(("prefill", "tp"),
                               f"prefill TP {p.tp} > decode TP {d.tp} is only supported with equal block sizes "
                               f"(got {pb} -> {db})",
                               "use decode TP >= prefill TP, or equal block sizes", related=(("decode", "tp"),)))
        if p.kv_layout != "HND":
            out.append(Problem(("prefill", "kv_layout"),
                               f"different TP on prefill ({p.tp}) and decode ({d.tp}) needs the prefill's KV in "
                               f"HND layout (heads outermost, so a head slice is contiguous); got {p.kv_layout}",
                               "set prefill.kv_layout: HND"))

    # Same model, same cache dtype.
    if t.kv_cache_dtype("prefill") != t.kv_cache_dtype("decode"):
        out.append(Problem(("decode", "kv_cache_dtype"),
                           f"prefill KV cache dtype '{t.kv_cache_dtype('prefill')}' and decode "
                           f"'{t.kv_cache_dtype('decode')}' differ; NIXL copies bytes, it does not convert dtypes",
                           "use the same kv_cache_dtype on both roles"))
    if p.model and d.model and Path(p.model).name != Path(d.model).name:
        out.append(Problem(("decode", "model"), f"prefill serves '{p.model}' and decode '{d.model}'",
                           "prefill and decode must serve the same model"))
    if t.model.max_model_len and info.max_position and t.model.max_model_len > info.max_position:
        out.append(Problem(("model", "max_model_len"),
                           f"{t.model.max_model_len} exceeds the model's max_position_embeddings "
                           f"{info.max_position}", f"use at most {info.max_position}"))

    out += _engine_problems(t)
    out += _collisions(t)
    return out


def _engine_problems(t: Topology) -> list[Problem]:
    e = t.engine
    out: list[Problem] = []
    if e.kind == "ray" and not e.address and not os.environ.get("RAY_ADDRESS"):
        out.append(Problem(("engine", "address"), "the ray engine needs the cluster's address",
                           "set engine.address: HOST:PORT (the head's GCS port), pass --address, or export "
                           "RAY_ADDRESS"))
    if e.kind != "ray" and e.address:
        out.append(Problem(("engine", "address"), f"has no meaning for the {e.kind} engine",
                           "remove it, or use engine.kind: ray", severity="warning"))
    own = {"ray": RAY_PLACEMENT, "slurm": SLURM_PLACEMENT, "local": ()}[e.kind]
    for role, pl in e.placement.items():
        for key in RAY_PLACEMENT + SLURM_PLACEMENT:
            if getattr(pl, key) and key not in own:
                out.append(Problem(("engine", "placement", role, key),
                                   f"'{key}' is no placement of the {e.kind} engine",
                                   f"{e.kind} placement keys: {', '.join(own)}" if own else
                                   "the local engine runs everything on this host; use engine.kind: ray or slurm"))
    parts = {r: e.placement[r].partition for r in ROLES if r in e.placement and e.placement[r].partition}
    if len(set(parts.values())) > 1:
        out.append(Problem(("engine", "placement", "decode", "partition"),
                           f"prefill and decode name different partitions ({parts['prefill']}, {parts['decode']}); "
                           "the slurm engine runs the topology as one job, in one partition",
                           "name one partition (nodelist picks the nodes within it)"))
    if e.kind == "slurm" and e.placement.get("proxy"):
        out.append(Problem(("engine", "placement", "proxy"),
                           "the slurm engine runs the proxy where `pdctl up` runs",
                           "remove engine.placement.proxy"))
    if e.kind != "local":
        for role in ROLES:
            if t.group(role).host not in ("127.0.0.1", "0.0.0.0"):
                out.append(Problem((role, "host"),
                                   f"on the {e.kind} engine an instance listens on its node's address; "
                                   f"host {t.group(role).host} is ignored", "remove it", severity="warning"))
    return out


def _collisions(t: Topology) -> list[Problem]:
    """Every (host, port) and (host, platform, device) is claimed by one process at most."""
    ports: dict[tuple[str, int], str] = {}
    devices: dict[tuple[str, str, int], str] = {}
    out: list[Problem] = []

    def claim(table: dict, key: tuple, owner: str, path: Loc, what: str, severity: str = "error") -> None:
        if key in table and table[key] != owner:
            out.append(Problem(path, f"{what} {key[-1]} of {owner} is also used by {table[key]}",
                               "give each role its own range (instance i uses base + i)", severity=severity))
        table.setdefault(key, owner)

    for role in ROLES:
        g = t.group(role)
        for i in range(g.count):
            owner = f"{role}[{i}]"
            claim(ports, (g.host, g.http_port_of(i)), owner, (role, "http_port"), "HTTP port")
            claim(ports, (g.host, g.side_channel_port_of(i)), owner, (role, "side_channel_port"),
                  "NIXL side-channel port")
            for dev in g.devices_of(i) or []:
                # Shared CPU cores only slow instances down; a shared accelerator runs out of memory.
                claim(devices, (g.host, g.platform, dev), owner, (role, "devices"), f"{g.platform} device",
                      "warning" if g.platform == "cpu" else "error")
    claim(ports, (t.proxy.host, t.proxy.port), "the proxy", ("proxy", "port"), "port")
    # One report per colliding field is enough.
    seen: set[Loc] = set()
    return [p for p in out if not (p.path in seen or seen.add(p.path))]


# --------------------------------------------------------------------------------------------------------------
# Loading, with overrides


@dataclass(frozen=True)
class Override:
    """One command-line change: `flag` is how the user wrote it, for error messages."""

    path: Loc
    value: Any
    flag: str

    @classmethod
    def parse_set(cls, text: str) -> Override:
        key, sep, raw = text.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {text!r}: expected dotted.path=value, e.g. --set decode.block_size=64")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        path = tuple(int(k) if k.isdigit() else k for k in key.strip().split("."))
        return cls(path, value, f"--set {text}")


def apply_overrides(data: dict, overrides: list[Override]) -> dict:
    data = json.loads(json.dumps(data))  # deep copy of plain YAML data
    for o in overrides:
        node: Any = data
        for k in o.path[:-1]:
            if isinstance(node, list) and isinstance(k, int) and k < len(node):
                node = node[k]
            elif isinstance(node, dict):
                node = node.setdefault(k, {})
                if not isinstance(node, (dict, list)):
                    raise TopologyError(Source(o.flag), [Problem(o.path, f"'{k}' is not a section")])
            else:
                raise TopologyError(Source(o.flag), [Problem(o.path, "no such place in the topology")])
        if isinstance(node, list):
            if not (isinstance(o.path[-1], int) and o.path[-1] < len(node)):
                raise TopologyError(Source(o.flag), [Problem(o.path, "list index out of range")])
        node[o.path[-1]] = o.value
    return data


@dataclass
class Loaded:
    topology: Topology
    source: Source
    base_dir: Path
    model_info: ModelInfo
    warnings: list[Problem] = field(default_factory=list)


def validate_data(data: Any, source: Source, base_dir: Path) -> Loaded:
    if not isinstance(data, dict):
        raise TopologyError(source, [Problem((), "a topology is a mapping with name, model, prefill, decode")])
    try:
        topo = Topology.model_validate(data)
    except ValidationError as e:
        raise TopologyError(source, _from_validation_error(e)) from None
    info = read_model_info(topo.model, base_dir)
    problems = compatibility_problems(topo, info)
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        raise TopologyError(source, errors)
    return Loaded(topo, source, base_dir, info, [p for p in problems if p.severity == "warning"])


def load_topology(path: str | Path, overrides: list[Override] = ()) -> Loaded:
    path = Path(path)
    source = Source(str(path))
    try:
        text = path.read_text()
    except OSError as e:
        raise TopologyError(source, [Problem((), f"cannot read the topology: {e.strerror or e}")]) from None
    try:
        source.located = yamlsrc.load(text)
    except yamlsrc.YamlSourceError as e:
        source.filename = f"{path}:{e.line}" if e.line else str(path)
        raise TopologyError(source, [Problem((), e.message)]) from None
    data = source.located.data
    if overrides:
        if not isinstance(data, dict):
            data = {}
        data = apply_overrides(data, list(overrides))
        source.overridden = {o.path: o.flag for o in overrides}
    return validate_data(data, source, path.resolve().parent)


# The typed override flags every topology-taking command accepts: option name -> (flag, path).
OVERRIDE_FLAGS: dict[str, tuple[str, Loc]] = {
    "prefill_block_size": ("--prefill-block-size", ("prefill", "block_size")),
    "decode_block_size": ("--decode-block-size", ("decode", "block_size")),
    "prefill_tp": ("--prefill-tp", ("prefill", "tp")),
    "decode_tp": ("--decode-tp", ("decode", "tp")),
    "decode_layout": ("--decode-layout", ("decode", "kv_layout")),
    "prefill_count": ("--prefill-count", ("prefill", "count")),
    "decode_count": ("--decode-count", ("decode", "count")),
    "engine": ("--engine", ("engine", "kind")),
    "address": ("--address", ("engine", "address")),
}


def overrides_from_flags(flags: dict[str, str | None], sets: list[str] = ()) -> list[Override]:
    """Typed flags arrive as text so a bad value is a topology error (exit 1), not a usage error."""
    out = []
    for key, raw in flags.items():
        if raw is None:
            continue
        flag, path = OVERRIDE_FLAGS[key]
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        out.append(Override(path, value, f"{flag} {raw}"))
    return out + [Override.parse_set(s) for s in sets]
