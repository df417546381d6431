"""The topology: pydantic models of the YAML, and every compatibility rule checked before anything starts.

Pure apart from `load_topology` / `read_model_info`, which read the YAML and the model's config.json.
Errors are collected (never raised one at a time) and each names file:line, the field and how to fix it.
"""

from __future__ import annotations

import copy
import difflib
import ipaddress
import json
import math
import os
import re
import typing
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from pdctl import yamlsrc
from pdctl.auth import ENV_NAME_PATTERN

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
KNOWN_MODEL_KV_HEADS: dict[str, int] = {"Qwen/Qwen3-0.6B": 8, "Qwen/Qwen3-8B": 8, "meta-llama/Llama-3.1-8B-Instruct": 8,
                                        "openai/gpt-oss-20b": 8}

# vLLM's switch for its hybrid KV cache manager (HMA), a BooleanOptionalAction: the last of the two forms wins.
HMA_OFF_FLAG = "--disable-hybrid-kv-cache-manager"
HMA_ON_FLAG = "--no-disable-hybrid-kv-cache-manager"


def _layout(v: Any) -> Any:
    if isinstance(v, str) and v.upper() in _LAYOUT_ALIASES:
        return _LAYOUT_ALIASES[v.upper()]
    return v


def _on_off(v: Any) -> Any:
    """YAML 1.1 reads a bare off / on as a boolean: take it as the word it was."""
    return {False: "off", True: "on"}.get(v, v) if isinstance(v, bool) else v


_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(v: Any) -> Any:
    """'256MiB' -> 268435456; ints pass through; anything else is left for pydantic to reject."""
    if isinstance(v, str):
        m = re.fullmatch(r"\s*([0-9]{1,30}(?:\.[0-9]{1,30})?)\s*([a-zA-Z]*)\s*", v)
        if m and m.group(2).lower() in _UNITS:
            # Exact arithmetic: float() of a long digit string is inf, and int(inf) an OverflowError.
            return int(Fraction(m.group(1)) * _UNITS[m.group(2).lower()])
        raise ValueError(f"{v!r} is not a size; write e.g. 268435456, '256MiB' or '1GiB'")
    return v


KvLayout = Annotated[Literal["HND", "NHD"], BeforeValidator(_layout)]
ByteSize = Annotated[int, BeforeValidator(parse_bytes), Field(gt=0)]
Port = Annotated[int, Field(ge=1024, le=65535)]
BufferDevice = Literal["cpu", "cuda", "xpu", "hpu"]

DEFAULT_POOL = "default"  # a role written as one mapping is one pool of this name; its instances: prefill-0, ...
POOL_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,31}$"
# Where each role's automatic ports start (http, NIXL side channel).
ROLE_PORTS: dict[str, tuple[int, int]] = {"prefill": (8100, 5600), "decode": (8200, 5700)}


def instance_name(role: str, pool: str, index: int) -> str:
    """prefill-0 in a single-pool role (today's names), prefill-p32-0 in a named pool."""
    return f"{role}-{index}" if pool == DEFAULT_POOL else f"{role}-{pool}-{index}"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class ModelSpec(_Strict):
    path: str = Field(min_length=1, description="local directory or hub id")
    served_name: str | None = None
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    max_model_len: int | None = Field(None, ge=16)
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    kv_heads: int | None = Field(None, ge=1, le=2**16, description="KV heads, when config.json is not local")
    attention: Literal["full", "hybrid"] | None = Field(
        None, description="the model's attention, when config.json is not local: full, or hybrid (sliding-window "
        "and full-attention layers, e.g. gpt-oss, Gemma 2/3), which vLLM's hybrid KV cache manager keeps in one KV "
        "cache group per kind and the connector rules treat apart. A local config.json decides; this field must "
        "then agree with it")
    seed: int = 0

    @property
    def name(self) -> str:
        return self.served_name or self.path


class Placement(_Strict):
    """Where one role's instances run on a cluster engine. Ray: resources/labels/node; Slurm: the rest."""

    resources: dict[str, float] = Field(default_factory=dict, description="Ray custom resources a node must have")
    labels: dict[str, str] = Field(default_factory=dict, description="Ray node labels a node must carry")
    node: str | None = Field(None, description="Ray: node IP; for the proxy also 'local' (where pdctl runs)")
    partition: str | None = Field(None, description="Slurm partition")
    nodelist: list[str] | None = Field(None, min_length=1, description="Slurm node names")
    gres: str | None = Field(None, description="Slurm generic resources per instance, e.g. gpu:1")


class InstanceGroup(_Strict):
    """One pool: instances of one role that share hardware and settings. Instance i gets http_port+i,
    side_channel_port+i, devices[i*tp:(i+1)*tp]. Ports left out are assigned after every explicit one
    (Topology._assign_ports), so pools never collide."""

    name: str = Field(pattern=POOL_NAME_PATTERN,
                      description="pool name (an identifier): in instance names, logs, metrics and reports")
    platform: Platform = "cpu"
    count: int = Field(1, ge=1, le=64)
    block_size: int | None = Field(None, ge=1, le=2048)
    tp: int = Field(1, ge=1, le=64)
    devices: list[Annotated[int, Field(ge=0)]] | None = None
    kv_layout: KvLayout = "HND"
    host: str = "127.0.0.1"
    http_port: Port | None = None
    side_channel_port: Port | None = None
    kv_cache_memory: ByteSize | None = None
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    enforce_eager: bool | None = None
    model: str | None = Field(None, description="model path on this pool's hosts, if it differs")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] | None = None
    kv_buffer_device: BufferDevice | None = Field(
        None, description="where this pool's KV is registered for NIXL (default: connector.kv_buffer_device, "
        "else the platform's own memory)")
    weight: float = Field(1.0, gt=0, description="share of traffic relative to other pools (unequal hardware)")
    placement: Placement | None = Field(None, description="cluster placement of this pool (default: the "
                                        "role's engine.placement)")
    restart: Literal["on-failure", "always", "never"] = Field(
        "on-failure", description="what the supervisor does when an instance exits or fails its health checks "
        "persistently: on-failure (not after a clean exit 0), always, never")
    nice: int = Field(
        0, ge=-20, le=19, strict=True, description="added to the niceness of every process of each instance (API "
        "server, engine core, workers), like `nice -n`: 10 on a decode pool that shares a host's cores with prefill "
        "pools lets the prefill's work go first (lower TTFT under load); below 0 needs CAP_SYS_NICE (or RLIMIT_NICE)")
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
        assert self.http_port is not None  # assigned by the topology
        return self.http_port + index

    def side_channel_port_of(self, index: int) -> int:
        # vLLM's NIXL side channel is one listener per engine (base + DP index), whatever the TP.
        assert self.side_channel_port is not None
        return self.side_channel_port + index

    def devices_of(self, index: int) -> list[int] | None:
        if self.devices is None:
            return None
        return self.devices[index * self.tp : (index + 1) * self.tp]


Policy = Literal["least_outstanding", "round_robin", "prefix_affinity"]


ProxyKind = Literal["pdctl", "vllm-router"]
# pdctl's policies as vllm-router's (docs/operations.md, "vllm-router"): least_outstanding has no exact peer;
# power_of_two (the less loaded of two random instances) is the closest.
ROUTER_POLICY = {"round_robin": "round_robin", "prefix_affinity": "cache_aware", "least_outstanding": "power_of_two"}
# Proxy fields vllm-router has no equivalent for: refused when the topology sets them.
ROUTER_UNSUPPORTED = {
    "first_token": "it streams the decode's answer as it is",
    "exclude_pairs": "it pairs every prefill with every decode",
    "affinity_epsilon": "its cache_aware policy has its own load balance thresholds",
    "affinity_prefix_chars": "its cache_aware policy matches whole prompts in a radix tree",
    "connect_timeout_s": "it has one whole-request timeout (first_byte_timeout_s maps to it)",
    "read_timeout_s": "it has one whole-request timeout (first_byte_timeout_s maps to it)",
}


class ProxySpec(_Strict):
    kind: ProxyKind = Field("pdctl", description="pdctl (pdctl's own proxy) or vllm-router (the vLLM project's "
                            "Rust router, extra `router`): same endpoint, pdctl starts and supervises either")
    host: str = "127.0.0.1"
    port: Port = 8000
    metrics_port: Port | None = Field(None, description="vllm-router only: its Prometheus /metrics port "
                                      "(default port + 1); pdctl's proxy serves /metrics on its own port")
    policy: Policy = Field("least_outstanding", description="least_outstanding (weighted, across pools), "
                           "round_robin, or prefix_affinity (same prompt head -> same prefill and decode)")
    exclude_pairs: list[tuple[str, str]] = Field(
        default_factory=list, description="[prefill pool, decode pool] pairs the proxy never routes")
    affinity_epsilon: float = Field(0.25, ge=0, description="prefix_affinity's load bound: an instance is "
                                    "skipped above (1 + epsilon) x the mean outstanding + 1")
    affinity_prefix_chars: int = Field(256, ge=1, description="prefix_affinity hashes this many prompt chars")
    on_prefill_down: Literal["fallback", "reject"] = Field(
        "fallback", description="when no prefill can answer with usable KV (none healthy, every try failed, or "
        "an answer without kv_transfer_params): 'fallback' sends the request to a decode as a plain request "
        "(the decode computes the prompt; counted in pdctl_decode_only_fallback_total), 'reject' answers an "
        "error at once. The gates run with 'reject'")
    connect_timeout_s: float = Field(10.0, gt=0, description="upstream TCP connect")
    first_byte_timeout_s: float = Field(600.0, gt=0, description="request sent -> first byte of the answer "
                                        "(a prefill computing a long prompt, a decode waiting for its KV)")
    read_timeout_s: float = Field(600.0, gt=0, description="between two bytes of an answer once it started")
    breaker_failures: int = Field(3, ge=1, description="consecutive failures that take an instance out of "
                                  "routing (circuit breaker)")
    breaker_open_s: float = Field(10.0, gt=0, description="how long a tripped instance stays out before one "
                                  "trial request (half-open)")
    early_decode: bool = Field(
        False, description="pdctl's proxy and connector, local engine: send each P/D request to its decode at the "
        "same time as to its prefill; the decode's own request path (API server, scheduler, blocks: ~8 ms of TTFT "
        "on a CPU host) then runs while the prefill computes, and the prefill's KV parameters are handed to the "
        "waiting decode over a host-local socket. A request whose prefill fails is served the ordinary way")
    first_token: Annotated[Literal["off", "on", "auto"], BeforeValidator(_on_off)] = Field(
        "off", description="pdctl's proxy: stream the prefill's token to the client as soon as the prefill "
        "answers, and the decode's stream after it without its first token (the same token: only for greedy "
        "streaming requests of one choice, without logprobs, echo, stop strings or tools; any other request is "
        "served as it is). The decode's path (request, KV read, one step) leaves the time to first token and "
        "shows between tokens 1 and 2 instead. 'auto': only while the pair's decode has other requests in "
        "flight (under load, where the decode's first token waits longest). Per request, the header "
        "x-pdctl-first-token: on|off overrides it")

    @property
    def router_metrics_port(self) -> int | None:
        """Where vllm-router serves /metrics (None for pdctl's proxy, which serves it on its own port)."""
        return (self.metrics_port or self.port + 1) if self.kind == "vllm-router" else None


class ConnectorSpec(_Strict):
    kind: Literal["pdctl", "nixl"] = Field(
        "pdctl", description="pdctl = pdctl's heterogeneous connector; nixl = vLLM's stock NixlConnector"
    )
    kv_buffer_device: BufferDevice | None = Field(None, description="every pool's default")
    backends: list[str] = Field(default_factory=lambda: ["UCX"], min_length=1)
    progress_thread: bool = True
    progress_delay_us: int = Field(1000, ge=0, description="sleep between NIXL progress passes (pdctl only)")
    worker_spin_s: float | None = Field(
        None, ge=0, description="how long vLLM's executor-queue readers spin after a message, on every server "
        "pdctl starts, whatever the connector kind (pdctl's vLLM plugin, through PDCTL_QUEUE_SPIN_S); default 0 "
        "on CPU, where the spin starves compute and NIXL, vLLM's own 1 s elsewhere (plugin off). On a CPU host with "
        "cores to spare, 0.01 buys plain vLLM's time per output token at low load (measured on 2 cores: TPOT "
        "1.4x -> 1.04x plain vLLM's at one request at a time, but TTFT 1.3x -> 1.5x, and 1.9x under load)")
    kv_load_failure_policy: Literal["recompute", "fail"] = Field(
        "recompute", description="a decode whose KV does not arrive (read failed, prefill gone, no staging "
        "room): 'recompute' computes the prompt locally (correct, slower, counted), 'fail' ends the request "
        "with an error. vLLM's own default is 'fail'; the gates run with 'fail'")
    read_wait_s: float = Field(
        0.002, ge=0, le=1, description="pdctl's connector: how long a decode waits, in the step that issued a KV "
        "read, for it to finish before answering the step (0: not at all, vLLM's behaviour). vLLM notices a "
        "finished read only at the next step's poll and schedules the first token a step later; a read of a few "
        "hundred KiB takes ~0.1-0.3 ms, so a short bounded wait saves a whole step of TTFT (it delays that step's "
        "other tokens by at most this much)")
    trace: bool = Field(
        False, description="per-request timing lines in each decode's log (pdctl's connector): when its "
        "scheduler saw a remote-KV request and gave it blocks, when the worker issued the read, saw it done and "
        "converted it, when the scheduler learnt the KV had arrived and scheduled the first token; joined with "
        "the proxy's own timestamps by `pdctl bench --breakdown` and scripts/bench_pd_latency.py")
    extra_config: dict[str, Any] = Field(default_factory=dict)
    allow_unsafe_hybrid: bool = Field(
        False, description="negative controls only: let vLLM's stock connector (kind: nixl) pair a hybrid "
        "(sliding-window + full attention) model's KV with the hybrid KV cache manager on, which pdctl otherwise "
        "refuses (a warning instead). It exists to prove the "
        "gates catch the stock connector's silent KV corruption there; never for serving")

    @model_validator(mode="after")
    def _trace_needs_pdctl(self) -> ConnectorSpec:
        if self.trace and self.kind != "pdctl":
            raise ValueError("trace: the timing lines come from pdctl's connector; set kind: pdctl")
        return self


class ReferenceSpec(_Strict):
    """The aggregated server the gates compare P/D against (`pdctl check`, `pdctl bench`): the first decode
    pool's hardware and settings, no connector."""

    calm_queues: bool = Field(
        True, description="run the reference with vLLM's executor queues calmed like every P/D server pdctl "
        "starts (pdctl's vLLM plugin, connector.worker_spin_s; on CPU by default): a fair comparison. false "
        "runs it as plain vLLM, whose queue readers spin 1 s after every message (how vLLM runs unmanaged)")


class SupervisionSpec(_Strict):
    """How `pdctl up` keeps instances running (each pool's `restart` says whether it may)."""

    health_failures: int = Field(3, ge=1, description="consecutive failed /health probes before a restart ...")
    health_window_s: float = Field(30.0, ge=0, description="... and at least this long since the first of them "
                                   "(a /health stalled behind a busy engine on a small host is not a crash)")
    health_interval_s: float = Field(5.0, gt=0, description="seconds between health probes of one instance")
    backoff_s: float = Field(2.0, gt=0, description="wait before the first restart; doubles per restart in the window")
    backoff_max_s: float = Field(60.0, gt=0)
    max_restarts: int = Field(5, ge=0, description="restarts of one instance allowed per window; then it stays down")
    window_s: float = Field(600.0, gt=0)


class MonitoringSpec(_Strict):
    """Prometheus beside the topology (`pdctl up --monitoring`): one more supervised process on this host, its
    config, rules and data in the state dir, scraping every instance and the proxy."""

    enabled: bool = False
    host: str = "127.0.0.1"
    port: Port = 9090
    scrape_interval_s: float = Field(
        2.0, ge=0.5, le=60, description="scrape and rule evaluation interval; the recording rules' rate windows are "
        "15 of these (30 s at 2 s), so rate() has data within seconds of the first requests")
    retention: str = Field("1d", pattern=r"^[1-9][0-9]{0,5}(ms|s|m|h|d|w|y)$",
                           description="how long Prometheus keeps samples (--storage.tsdb.retention.time)")


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
    time_limit: str = Field("UNLIMITED", min_length=1, description="Slurm job time limit")


class AuthSpec(_Strict):
    """API keys. The key itself is never in the topology, the plan, the state dir or a log: only the name of the
    environment variable pdctl reads it from when it starts the servers and when it calls them."""

    api_key_env: str | None = Field(
        None, pattern=ENV_NAME_PATTERN, description="name of the environment variable that holds the API key: "
        "every vLLM server and the proxy then require `Authorization: Bearer <key>` on /v1/* (401 otherwise), "
        "and pdctl sends it on each of its own calls. `pdctl up` refuses to start when it is unset or empty")


def _as_pools(v: Any) -> Any:
    """A role written as one mapping is one pool named 'default' (today's form); a list is several pools."""
    if isinstance(v, dict):
        pool: dict[Any, Any] = {"name": DEFAULT_POOL}
        pool.update(v)  # not {**v}: a non-string key (1: x) is pydantic's to reject, not a TypeError here
        return [pool]
    return v


MAX_POOLS = 64  # per role; the rules look at every prefill x decode pair
Pools = Annotated[list[InstanceGroup], BeforeValidator(_as_pools), Field(min_length=1, max_length=MAX_POOLS)]


class Topology(_Strict):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")
    model: ModelSpec
    prefill: Pools
    decode: Pools
    proxy: ProxySpec = Field(default_factory=ProxySpec)
    connector: ConnectorSpec = Field(default_factory=ConnectorSpec)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    supervision: SupervisionSpec = Field(default_factory=SupervisionSpec)
    reference: ReferenceSpec = Field(default_factory=ReferenceSpec)
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec)
    # None (not an empty AuthSpec) when the YAML has no auth: a plan's JSON then stays as it was (Plan.to_dict).
    auth: AuthSpec | None = Field(None, description="API keys (auth.api_key_env)")
    # Where it was loaded from (file, base dir, model facts, warnings): set by validate_data, never serialized.
    _origin: Any = PrivateAttr(default=None)

    @property
    def origin(self) -> Loaded | None:
        """How this topology was loaded (None for one built in code or read back from a plan)."""
        return self._origin

    @model_validator(mode="after")
    def _assign_ports(self) -> Topology:
        """Ports a pool leaves out follow the role's base (8100/5600 prefill, 8200/5700 decode), skipping every
        port another pool claims explicitly or was given before: pools never collide unless told to."""
        taken = {self.proxy.port, self.proxy.router_metrics_port} | (
            {self.monitoring.port} if self.monitoring.enabled else set())
        for role in ROLES:
            for g in self.pools(role):
                for attr in ("http_port", "side_channel_port"):
                    if getattr(g, attr) is not None:
                        taken.update(getattr(g, attr) + i for i in range(g.count))
        for role in ROLES:
            cursor = dict(zip(("http_port", "side_channel_port"), ROLE_PORTS[role], strict=True))
            for g in self.pools(role):
                for attr in ("http_port", "side_channel_port"):
                    if getattr(g, attr) is not None:
                        continue
                    base = cursor[attr]
                    while any(base + i in taken for i in range(g.count)):
                        base += 1
                    setattr(g, attr, base)
                    taken.update(base + i for i in range(g.count))
                    cursor[attr] = base + g.count
        return self

    def pools(self, role: Role) -> list[InstanceGroup]:
        return self.prefill if role == "prefill" else self.decode

    def pool(self, role: Role, name: str) -> InstanceGroup:
        return next(g for g in self.pools(role) if g.name == name)

    def pairs(self) -> list[tuple[InstanceGroup, InstanceGroup]]:
        """Every prefill pool x decode pool pair the proxy may route (exclude_pairs left out)."""
        excluded = {tuple(x) for x in self.proxy.exclude_pairs}
        return [(p, d) for p in self.prefill for d in self.decode if (p.name, d.name) not in excluded]

    def model_path(self, pool: InstanceGroup) -> str:
        return pool.model or self.model.path

    def kv_cache_dtype(self, pool: InstanceGroup) -> str:
        return pool.kv_cache_dtype or self.model.kv_cache_dtype

    def kv_buffer_device(self, pool: InstanceGroup) -> str:
        return pool.kv_buffer_device or self.connector.kv_buffer_device or (
            "cpu" if pool.platform == "cpu" else pool.platform)

    def staging_blocks(self, decode: InstanceGroup) -> int:
        """Decode blocks a decode pool withholds for prefill block > decode block: whole prefill blocks are
        read, and chunks past a request's own decode blocks land here (2*(ratio-1) per request at most, room
        for 16 at once), sized for the largest ratio among the prefill pools that reach it."""
        assert decode.block_size is not None
        ratio = max(((p.block_size or 0) // decode.block_size for p, d in self.pairs() if d is decode), default=0)
        return 32 * (ratio - 1) if ratio > 1 else 0


def summary(t: Topology, info: ModelInfo | None = None) -> str:
    """One line: what runs where, for `pdctl validate` (`info`: the model's facts, by default those the topology
    was loaded with); a model with sliding-window layers says so, with its window and whether HMA is on."""
    def pool(g: InstanceGroup) -> str:
        return f"{g.count}x {g.platform} block {g.block_size} TP {g.tp} {g.kv_layout}" + (f" nice {g.nice:+d}"
                                                                                           if g.nice else "")

    if info is None:
        info = t.origin.model_info if t.origin is not None else ModelInfo()
    proxy = "" if t.proxy.kind == "pdctl" else f", proxy {t.proxy.kind}"
    attention = attention_summary(t, info)
    attention = f"; {attention}" if attention else ""
    if len(t.prefill) == 1 and len(t.decode) == 1:
        return (f"{t.name}: prefill {pool(t.prefill[0])} -> decode {pool(t.decode[0])}, connector "
                f"{t.connector.kind}{proxy}{attention}")
    sides = [f"{role} pools " + ", ".join(f"{g.name} ({pool(g)})" for g in t.pools(role)) for role in ROLES]
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
        if isinstance(part, int):  # an item of a list of models (pools)
            continue
        if part not in cls.model_fields:
            return None
        ann = cls.model_fields[part].annotation
        nxt = next((a for a in (ann, *typing.get_args(ann)) if isinstance(a, type) and issubclass(a, BaseModel)),
                   None)
        if nxt is None:
            return None
        cls = nxt
    return cls


def _clean_loc(raw: tuple, data: Any) -> Loc:
    """Pydantic's error location as the user's keys: its names for validators and literals
    ('function-before[...]', "literal['HND','NHD']") dropped, a user's key that merely looks like one kept."""
    out: list[str | int] = []
    node = data
    for part in raw:
        if isinstance(node, dict) and part in node:
            out.append(part)
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            out.append(part)
            node = node[part]
        elif isinstance(node, dict) and isinstance(part, int):
            out.append(part)  # a role written as one mapping is pool 0 (_as_pools); the mapping is that pool
        elif isinstance(part, str) and part.startswith(("function-", "literal[")):
            continue
        else:
            out.append(part)
            node = None
    return tuple(out)


def _from_validation_error(err: ValidationError, data: Any = None) -> list[Problem]:
    problems = []
    for e in err.errors(include_url=False):
        loc = _clean_loc(tuple(e["loc"]), data)
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
                msg += f" (got {yamlsrc.short(got)})"
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
    # For the KV cache capacity rule (all None unless a local config.json gave them):
    layers: int | None = None  # num_hidden_layers
    head_dim: int | None = None  # head_dim, else hidden_size / num_attention_heads
    max_len: int | None = None  # what vLLM serves without --max-model-len: the smallest of its length keys
    config: str | None = None  # the config.json these came from
    capacity_unknown: str | None = None  # why the config's attention is not plain (sliding window, MLA, ...)
    # What config.json says of the attention (None without a local config.json, or when its layer kinds are
    # others, e.g. Mamba or linear attention): full; hybrid, sliding-window and full-attention layers (vLLM's
    # hybrid KV cache manager keeps a KV cache group per kind); sliding, every layer windowed. The topology's
    # model.attention stands in when this is None (model_attention).
    attention: Literal["full", "hybrid", "sliding"] | None = None
    attention_why: str | None = None  # what in config.json says so, for messages
    sliding_window: int | None = None  # the window, in tokens


_MAX_CONFIG_BYTES = 4 * 2**20  # a config.json is a few KiB
# vLLM's own max-length keys (model_arch_config_convertor): it serves the smallest one present.
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                 "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")


def _count(v: Any) -> int | None:
    """A positive int from config.json, else None (a string, a float, a bool, 0 or an absurd value)."""
    return v if type(v) is int and 0 < v <= 2**40 else None


def _read_config(cfg_file: Path) -> dict[str, Any] | None:
    """config.json as a mapping; None when it is not a readable, small JSON object."""
    try:
        if not cfg_file.is_file():
            return None
        cfg = json.loads(yamlsrc.read_file(cfg_file, max_bytes=_MAX_CONFIG_BYTES))
    except (OSError, ValueError, RecursionError, yamlsrc.YamlSourceError):
        return None
    if not isinstance(cfg, dict):
        return None
    # Multimodal checkpoints keep the language model's numbers in text_config.
    text = cfg.get("text_config")
    if "num_hidden_layers" not in cfg and isinstance(text, dict):
        cfg = {**cfg, **text}
    return cfg


_SLIDING, _FULL = "sliding_attention", "full_attention"
# Model types whose config classes alternate sliding and full layers when config.json has no layer_types.
_ALTERNATING = {"gemma2": "Gemma 2", "gpt_oss": "gpt-oss"}


def _attention_kind(cfg: dict[str, Any]) -> tuple[Literal["full", "hybrid", "sliding"] | None, str]:
    """What config.json says of the attention, and what in it says so. vLLM windows a layer when layer_types
    names it sliding_attention (Llama, Gemma 2/3, gpt-oss: the model's sliding_window), else every layer when
    the config has a sliding_window and no layer_types (engine/arg_utils.py); older Gemma/Cohere configs give a
    pattern instead of layer_types, and Qwen2's max_window_layers splits the layers."""
    window = _count(cfg.get("sliding_window"))
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        if not all(isinstance(x, str) for x in layer_types):
            return None, "layer_types holds something other than names"
        kinds = set(layer_types)
        if kinds == {_FULL}:
            return "full", "layer_types: every layer full_attention"
        if not kinds <= {_SLIDING, _FULL}:
            return None, f"layer_types names {', '.join(sorted(kinds - {_SLIDING, _FULL}))[:200]}"
        if not window:
            return None, "layer_types names sliding_attention layers but sliding_window is no window"
        if kinds == {_SLIDING}:
            return "sliding", f"layer_types: every layer sliding_attention (window {window})"
        n = layer_types.count(_SLIDING)
        return "hybrid", (f"layer_types: {n} sliding_attention (window {window}) and {len(layer_types) - n} "
                          "full_attention layers")
    if not window or cfg.get("use_sliding_window", True) is False:
        return "full", "no sliding_window and no sliding_attention layers"
    pattern, layers, split = (_count(cfg.get(k)) for k in ("sliding_window_pattern", "num_hidden_layers",
                                                             "max_window_layers"))
    if pattern and pattern > 1:
        return "hybrid", f"sliding_window_pattern {pattern}: one layer in {pattern} is full attention"
    if cfg.get("model_type") in _ALTERNATING:
        return "hybrid", f"{_ALTERNATING[cfg['model_type']]} alternates sliding-window and full-attention layers"
    if split and layers and split < layers:
        return "hybrid", f"max_window_layers {split} of {layers} layers"
    return "sliding", f"sliding_window {window} for every layer (no layer_types)"


def _irregular_attention(cfg: dict[str, Any]) -> str | None:
    """Why layers x 2 x KV heads x head_dim does not describe this model's KV cache, if it does not."""
    if cfg.get("kv_lora_rank") is not None:
        return "the model uses MLA (compressed KV)"
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and any(x != "full_attention" for x in layer_types):
        if _attention_kind(cfg)[0] == "hybrid":
            return ("the model mixes sliding-window and full attention (layer_types): vLLM keeps one KV cache "
                    "group per kind")
        return "the model mixes attention kinds (layer_types)"
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True) is not False:
        return "the model uses sliding-window attention"
    quant = cfg.get("quantization_config")
    if isinstance(quant, dict):
        inner = quant.get("quantization")
        if any("kv_cache" in str(k) for k in [*quant, *(inner if isinstance(inner, dict) else ())]):
            return "the checkpoint's quantization_config chooses the KV cache dtype"
    return None


def read_model_info(topo_model: ModelSpec, base_dir: Path) -> ModelInfo:
    """What the rules need from the model: its config.json when local, else the topology's or a known value."""
    cfg_file = resolve_path(topo_model.path, base_dir) / "config.json"
    cfg = _read_config(cfg_file)
    if cfg is not None:
        heads = _count(cfg.get("num_attention_heads"))
        hidden = _count(cfg.get("hidden_size"))
        return ModelInfo(
            kv_heads=topo_model.kv_heads or _count(cfg.get("num_key_value_heads")) or heads,
            attention_heads=heads,
            max_position=_count(cfg.get("max_position_embeddings")),
            vocab_size=_count(cfg.get("vocab_size")),
            max_len=min((n for k in _MAX_LEN_KEYS if (n := _count(cfg.get(k)))), default=None),
            layers=_count(cfg.get("num_hidden_layers")),
            head_dim=_count(cfg.get("head_dim")) or (hidden // heads if hidden and heads and hidden % heads == 0
                                                     else None),
            config=str(cfg_file),
            capacity_unknown=_irregular_attention(cfg),
            attention=(kind := _attention_kind(cfg))[0],
            attention_why=kind[1],
            sliding_window=_count(cfg.get("sliding_window")) if kind[0] in ("hybrid", "sliding") else None,
        )
    return ModelInfo(kv_heads=topo_model.kv_heads or KNOWN_MODEL_KV_HEADS.get(topo_model.path))


def resolve_path(value: str, base_dir: Path) -> Path:
    """Relative model paths are relative to the topology file, like docker-compose's."""
    p = Path(value)
    try:
        p = p.expanduser()
    except RuntimeError:  # ~nosuchuser: vLLM would not find it either; left as written
        pass
    return p if p.is_absolute() else Path(os.path.normpath(base_dir / p))


def is_local_path(value: str) -> bool:
    return value.startswith((".", "/", "~")) or not re.fullmatch(r"[\w.-]+/[\w.-]+", value)


def resolved_model(t: Topology, pool: InstanceGroup, base_dir: Path) -> str:
    """A pool's model as its servers get it: a local path made absolute, a hub id as it is."""
    raw = t.model_path(pool)
    return str(resolve_path(raw, base_dir)) if is_local_path(raw) else raw


def pool_loc(t: Topology, role: Role, pool: InstanceGroup) -> Loc:
    """Where a pool's fields live: (role, index). A role written as one mapping is rewritten to (role,) when the
    problems are located (user_loc)."""
    return (role, next(i for i, g in enumerate(t.pools(role)) if g is pool))


def model_attention(t: Topology, info: ModelInfo) -> str | None:
    """full, hybrid or sliding: what the local config.json says, else the topology's model.attention; None when
    neither says (a hub id without model.attention)."""
    return info.attention or t.model.attention


def _hma_flag(g: InstanceGroup) -> tuple[int, bool] | None:
    """The last of vLLM's HMA switches in a pool's extra_args (vLLM also reads --x_y as --x-y): its index, and
    whether it leaves HMA on."""
    found = None
    for i, a in enumerate(g.extra_args):
        name = a.split("=", 1)[0]
        name = "--" + name[2:].replace("_", "-") if name.startswith("--") else name
        if name in (HMA_OFF_FLAG, HMA_ON_FLAG):
            found = (i, name == HMA_ON_FLAG)
    return found


def hma_enabled(g: InstanceGroup) -> bool:
    """Whether a pool's servers run vLLM's hybrid KV cache manager (HMA): on unless its extra_args pass
    --disable-hybrid-kv-cache-manager. (vLLM would also turn it off for a connector without HMA support; vLLM's
    NixlConnector and pdctl's both have it.)"""
    flag = _hma_flag(g)
    return flag is None or flag[1]


def pool_field(t: Topology, role: Role, g: InstanceGroup, name: str) -> str:
    """A pool's field as the user reads it: decode.extra_args, or decode pool d64's extra_args in a fleet."""
    single = len(t.pools(role)) == 1 and g.name == DEFAULT_POOL
    return f"{role}.{name}" if single else f"{role} pool {g.name}'s {name}"


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


def _unsafe_stock_hybrid(t: Topology, p: InstanceGroup, d: InstanceGroup, attention: str | None) -> bool:
    """vLLM's NixlConnector, a hybrid model with HMA on both sides: each side keeps the tail of its sliding-window
    block list, cut for the window of the token after the prompt, while the decode recomputes the prompt's last
    token, whose window starts one key earlier (a null block for some prompt lengths, at any block sizes:
    docs/notes/19-hma-pairing.md); across block sizes vLLM also pairs the two tails from their starts
    (docs/notes/19-hybrid-attention-research.md, Q3)."""
    return t.connector.kind == "nixl" and attention == "hybrid" and hma_enabled(p) and hma_enabled(d)


def _pair_label(t: Topology, p: InstanceGroup, d: InstanceGroup) -> str:
    """'prefill pool p128 -> decode pool d32: ' in a fleet; nothing when each role is one pool (today's text)."""
    if len(t.prefill) == 1 and len(t.decode) == 1:
        return ""
    return f"prefill pool {p.name} -> decode pool {d.name}: "


def _pair_problems(t: Topology, p: InstanceGroup, d: InstanceGroup, attention: str | None = None) -> list[Problem]:
    """Every rule that holds between one prefill pool and one decode pool (`attention`: model_attention)."""
    out: list[Problem] = []
    pl, dl = pool_loc(t, "prefill", p), pool_loc(t, "decode", d)
    label = _pair_label(t, p, d)
    pb, db = p.block_size, d.block_size
    assert pb is not None and db is not None  # filled by the group's validator
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
        elif pb > db and (p.tp != d.tp or p.kv_layout != d.kv_layout):
            add((*dl, "tp") if p.tp != d.tp else (*dl, "kv_layout"),
                f"prefill block {pb} > decode block {db} needs the same TP and KV layout on both "
                f"sides (got TP {p.tp} -> {d.tp}, {p.kv_layout} -> {d.kv_layout})",
                "use equal TP and layouts, or a decode block >= the prefill block",
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


def _pool_problems(t: Topology, role: Role, g: InstanceGroup, info: ModelInfo) -> list[Problem]:
    """Rules that hold within one pool."""
    out: list[Problem] = []
    loc = pool_loc(t, role, g)
    assert g.block_size is not None
    if g.platform == "cpu" and g.block_size % CPU_BLOCK_MULTIPLE:
        up = -(-g.block_size // CPU_BLOCK_MULTIPLE) * CPU_BLOCK_MULTIPLE
        if model_attention(t, info) == "hybrid" and hma_enabled(g):
            sw, full, nixl = _hybrid_cpu_blocks(g.block_size)
            out.append(Problem((*loc, "block_size"),
                               f"a hybrid model (sliding-window + full attention) with vLLM's hybrid KV cache "
                               f"manager on needs a block size that is a multiple of {CPU_BLOCK_MULTIPLE} on CPU (got "
                               f"{g.block_size}): vLLM gives the sliding-window layers a block that is a multiple of "
                               f"{CPU_BLOCK_MULTIPLE} ({sw} here; the full-attention layers {full}), and NIXL's "
                               f"block becomes {'their lcm, ' if sw != full else ''}{nixl}, not {g.block_size}",
                               f"use {up}"))
        else:
            out.append(Problem((*loc, "block_size"),
                               f"the CPU attention backend needs a block size that is a multiple of "
                               f"{CPU_BLOCK_MULTIPLE} (got {g.block_size})",
                               f"use {up}"))
    if info.kv_heads and info.kv_heads % g.tp:
        # TP is at most 64: the hint lists the divisors a pool can use (a huge head count stays cheap).
        divisors = [n for n in range(1, min(info.kv_heads, 64) + 1) if info.kv_heads % n == 0]
        out.append(Problem((*loc, "tp"),
                           f"TP {g.tp} does not divide the model's {info.kv_heads} KV heads",
                           f"use one of {divisors}"))
    if g.platform == "cpu" and g.gpu_memory_utilization is not None:
        out.append(Problem((*loc, "gpu_memory_utilization"), "has no meaning on the cpu platform",
                           "set kv_cache_memory (e.g. '256MiB') instead"))
    if g.devices is not None and len(g.devices) < g.count * g.tp:
        out.append(Problem((*loc, "devices"),
                           f"{g.count} instance(s) x TP {g.tp} need {g.count * g.tp} devices, "
                           f"{len(g.devices)} listed", f"list {g.count * g.tp} device ids"))
    # Two instances on one CPU core only slow each other down (a warning, with the cross-pool collisions); on an
    # accelerator the second runs out of memory.
    if g.platform != "cpu" and g.devices is not None and len(set(g.devices)) != len(g.devices):
        out.append(Problem((*loc, "devices"), "lists a device more than once"))
    if g.platform != "cpu" and g.devices is None:
        out.append(Problem((*loc, "devices"),
                           f"{g.platform} instances need explicit device ids, or every instance takes them all",
                           f"add e.g. devices: {list(range(g.count * g.tp))}"))
    buf = t.kv_buffer_device(g)
    if buf not in ("cpu", g.platform):
        own = g.kv_buffer_device is not None
        out.append(Problem((*loc, "kv_buffer_device") if own else ("connector", "kv_buffer_device"),
                           f"'{buf}' does not exist on the {role}'s {g.platform} platform",
                           f"use 'cpu' or '{g.platform}', or leave it out to use each platform's",
                           related=((*loc, "platform"),)))
    # What no process can be started with (exec refuses a NUL byte; an environment name cannot hold '=').
    for k, v in g.env.items():
        if not k or "=" in k or "\0" in k or "\0" in v:
            out.append(Problem((*loc, "env", k), f"{k!r}: {v!r} cannot be an environment variable",
                               "a name is non-empty without '=', and neither holds a NUL character"))
    for i, a in enumerate(g.extra_args):
        if "\0" in a:
            out.append(Problem((*loc, "extra_args", i), f"{a!r} holds a NUL character, which no argument can"))
    if g.model and "\0" in g.model:
        out.append(Problem((*loc, "model"), "holds a NUL character, which no path can"))
    return out + _capacity_problems(t, role, g, info)


# Flags in a pool's extra_args that change what its KV cache holds: the capacity rule does not guess.
_CAPACITY_FLAGS = ("--kv-cache-memory-bytes", "--kv-cache-memory", "--gpu-memory-utilization",
                   "--num-gpu-blocks-override", "--max-model-len", "--kv-cache-dtype", "--dtype", "--block-size",
                   "--hf-overrides")


def _human(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{n} bytes"


def kv_bytes_per_token(t: Topology, g: InstanceGroup, info: ModelInfo) -> int | None:
    """KV cache bytes one token takes on one TP rank of a pool, as vLLM sizes it (FullAttentionSpec: K and V of
    every layer, the rank's share of the KV heads, the cache dtype); None when the model's config.json is not
    local or its attention is not that plain."""
    if not (info.layers and info.kv_heads and info.head_dim) or info.capacity_unknown:
        return None
    dtype_bytes = 1 if t.kv_cache_dtype(g).startswith("fp8") else 4 if t.model.dtype == "float32" else 2
    # vLLM's 'auto' dtype is 16-bit even for a float32 checkpoint (downcast); each rank holds kv_heads / TP
    # heads, at least one (ModelConfig.get_num_kv_heads).
    return info.layers * 2 * max(1, info.kv_heads // g.tp) * info.head_dim * dtype_bytes


def _capacity_problems(t: Topology, role: Role, g: InstanceGroup, info: ModelInfo) -> list[Problem]:
    """Whether a pool's KV cache holds what vLLM (and pdctl's connector) need to start, where it can be known.

    vLLM gives each worker (each TP rank) --kv-cache-memory-bytes and makes memory // (block_size x bytes per
    token) blocks of it (kv_cache_utils.get_kv_cache_config_from_groups); one is its null block, and it refuses
    to start when the rest cannot hold one max_model_len sequence (check_enough_kv_cache_memory). A decode pool
    with a staging area (prefill block > decode block) then gives up `staging` blocks, which pdctl's connector
    refuses unless there are more than 4 x staging."""
    loc = pool_loc(t, role, g)
    assert g.block_size is not None
    memory, mem_loc = g.kv_cache_memory, (*loc, "kv_cache_memory")

    def unchecked(reason: str, where: Loc | None = None) -> list[Problem]:
        return [Problem(where or mem_loc, f"KV cache capacity not checked: {reason}",
                        "kv_cache_memory and a local config.json let validation check that one max_model_len "
                        "sequence (and any staging area) fits", severity="warning")]

    space = g.env.get("VLLM_CPU_KVCACHE_SPACE", "") if g.platform == "cpu" else ""
    if space.strip():  # vLLM's legacy CPU setting overrides --kv-cache-memory-bytes (whole GiB)
        if not re.fullmatch(r"\s*[0-9]{1,6}\s*", space):
            return unchecked(f"env VLLM_CPU_KVCACHE_SPACE={space!r} is not a number of GiB")
        memory, mem_loc = int(space) * 2**30, (*loc, "env", "VLLM_CPU_KVCACHE_SPACE")
    flag = next((a.split("=", 1)[0] for a in g.extra_args if a.split("=", 1)[0] in _CAPACITY_FLAGS), None)
    if flag:
        return unchecked(f"extra_args sets {flag}")
    if memory is None:
        if g.gpu_memory_utilization is None:
            return unchecked("vLLM sizes the cache at start (gpu_memory_utilization 0.9 by default)")
        return unchecked(f"vLLM sizes the cache at start (gpu_memory_utilization {g.gpu_memory_utilization})",
                         (*loc, "gpu_memory_utilization"))
    if info.config is None:
        return unchecked(f"the model '{t.model.path}' has no local config.json (layers, KV heads, head_dim)")
    if info.capacity_unknown:
        return unchecked(f"{info.capacity_unknown} ({info.config})")
    per_token = kv_bytes_per_token(t, g, info)
    max_len = t.model.max_model_len or info.max_len
    if per_token is None or not max_len:
        return unchecked(f"{info.config} lacks num_hidden_layers, num_key_value_heads, head_dim or a max length")
    block_bytes = g.block_size * per_token
    blocks = memory // block_bytes
    seq = -(-max_len // g.block_size)  # blocks one max_model_len sequence takes
    staging = t.staging_blocks(g) if role == "decode" and t.connector.kind == "pdctl" else 0
    rank = " per TP rank" if g.tp > 1 else ""
    what = "kv_cache_memory" if mem_loc[-1] == "kv_cache_memory" else "VLLM_CPU_KVCACHE_SPACE"
    head = (f"{what} {_human(memory)}{rank} holds {blocks} blocks of {g.block_size} tokens "
            f"({_human(per_token)} per token{rank})")
    length = (f"one sequence of max_model_len {max_len}" if t.model.max_model_len else
              f"one sequence of the model's length {max_len} (no model.max_model_len)")
    need_blocks = max(seq + 1, 4 * staging + 1, staging + seq + 1) if staging else seq + 1
    need = need_blocks * block_bytes
    fix = f"kv_cache_memory: '{-(-need // 2**20)}MiB' or more ({need_blocks} blocks)"
    related: tuple[Loc, ...] = (("model", "max_model_len"),)
    # The longest max_model_len that would fit, when a shorter one is a fix at all.
    shorter = (blocks - 1 - staging) * g.block_size if blocks > 4 * staging else 0
    or_shorter = f", or model.max_model_len: {shorter} or less" if shorter >= 16 else ""
    if blocks - 1 < seq:
        return [Problem(mem_loc, f"{head}; {length} needs {seq} blocks besides vLLM's null block, so vLLM "
                        "refuses to start", fix + or_shorter, related)]
    if not staging:
        return []
    prefill = max((p for p, d in t.pairs() if d is g), key=lambda p: p.block_size or 0)
    pair = f"prefill block {prefill.block_size} -> decode block {g.block_size}"
    related += ((*pool_loc(t, "prefill", prefill), "block_size"), (*loc, "block_size"))
    if blocks <= 4 * staging:
        return [Problem(mem_loc, f"{head}; the staging area for {pair} needs more than 4 x {staging} = "
                        f"{4 * staging} blocks (pdctl's connector refuses to start with fewer)", fix, related)]
    if blocks - staging - 1 < seq:
        return [Problem(mem_loc, f"{head}; after the {staging} staging blocks for {pair} and vLLM's null block, "
                        f"{blocks - staging - 1} are left and {length} needs {seq}", fix + or_shorter, related)]
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


def compatibility_problems(t: Topology, info: ModelInfo = ModelInfo()) -> list[Problem]:
    out = _pool_set_problems(t) + _attention_problems(t, info)
    attention = model_attention(t, info)
    for p, d in t.pairs():
        out += _pair_problems(t, p, d, attention)
    for role in ROLES:
        for g in t.pools(role):
            out += _pool_problems(t, role, g, info)
    if "\0" in t.model.path:
        out.append(Problem(("model", "path"), "holds a NUL character, which no path can"))
    if t.model.max_model_len and info.max_position and t.model.max_model_len > info.max_position:
        out.append(Problem(("model", "max_model_len"),
                           f"{t.model.max_model_len} exceeds the model's max_position_embeddings "
                           f"{info.max_position}", f"use at most {info.max_position}"))
    out += _engine_problems(t)
    out += _router_problems(t)
    out += _early_decode_problems(t)
    out += _exposure_problems(t)
    out += _collisions(t)
    # A rule that holds for a pool is met or broken once, whatever the pairs it is in.
    seen: set[tuple[Loc, str]] = set()
    return [p for p in out if not ((p.path, p.message) in seen or seen.add((p.path, p.message)))]


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
    placements: list[tuple[Loc, Placement]] = [(("engine", "placement", r), pl) for r, pl in e.placement.items()]
    placements += [((*pool_loc(t, r, g), "placement"), g.placement) for r in ROLES for g in t.pools(r)
                   if g.placement]
    for loc, pl in placements:
        for key in RAY_PLACEMENT + SLURM_PLACEMENT:
            if getattr(pl, key) and key not in own:
                out.append(Problem((*loc, key),
                                   f"'{key}' is no placement of the {e.kind} engine",
                                   f"{e.kind} placement keys: {', '.join(own)}" if own else
                                   "the local engine runs everything on this host; use engine.kind: ray or slurm"))
    parts = {loc: pl.partition for loc, pl in placements if pl.partition and loc[-1] != "proxy"}
    if len(set(parts.values())) > 1:
        loc = list(parts)[-1]
        out.append(Problem((*loc, "partition"),
                           f"the placements name different partitions ({', '.join(sorted(set(parts.values())))}); "
                           "the slurm engine runs the topology as one job, in one partition",
                           "name one partition (nodelist picks the nodes within it)"))
    if e.kind == "slurm" and e.placement.get("proxy"):
        out.append(Problem(("engine", "placement", "proxy"),
                           "the slurm engine runs the proxy where `pdctl up` runs",
                           "remove engine.placement.proxy"))
    if e.kind != "local" and t.monitoring.enabled:
        out.append(Problem(("monitoring", "enabled"), f"pdctl runs Prometheus with the local engine only, not the "
                           f"{e.kind} engine", "remove monitoring (or run your own Prometheus against the instances' "
                           "and the proxy's /metrics), or use engine.kind: local"))
    if e.kind != "local":
        for role in ROLES:
            for g in t.pools(role):
                if g.host not in ("127.0.0.1", "0.0.0.0"):
                    out.append(Problem((*pool_loc(t, role, g), "host"),
                                       f"on the {e.kind} engine an instance listens on its node's address; "
                                       f"host {g.host} is ignored", "remove it", severity="warning"))
    return out


def _early_decode_problems(t: Topology) -> list[Problem]:
    if not t.proxy.early_decode:
        return []
    loc, out = ("proxy", "early_decode"), []
    if t.proxy.kind != "pdctl":
        out.append(Problem(loc, "needs pdctl's proxy (it sends the decode request early and hands over the KV "
                           "parameters)", "remove it, or use proxy.kind: pdctl"))
    if t.connector.kind != "pdctl":
        out.append(Problem(loc, "needs pdctl's connector (the decode parks the request until the hand-over)",
                           "remove it, or use connector.kind: pdctl"))
    if t.engine.kind != "local":
        out.append(Problem(loc, f"the hand-over is a host-local socket: the {t.engine.kind} engine may place "
                           "the proxy and the decodes on different hosts", "remove it, or use engine.kind: local"))
    return out


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


def is_loopback(host: str) -> bool:
    """Whether a listen address is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it resolves to whatever the network says
        return False


def _exposure_problems(t: Topology) -> list[Problem]:
    """A warning for every server or proxy that other machines can reach while no API key is required."""
    if t.auth is not None and t.auth.api_key_env:
        return []
    hint = ("set auth.api_key_env: NAME (an environment variable holding the key) so every server and the proxy "
            "require it, or listen on 127.0.0.1")
    what = "and no API key is required (auth.api_key_env): anyone who reaches it can use the model"
    out: list[Problem] = []
    if t.engine.kind != "local":
        out.append(Problem(("engine", "kind"), f"on the {t.engine.kind} engine every instance listens on its "
                           f"node's address, {what}", hint, severity="warning"))
    else:
        for role in ROLES:
            for g in t.pools(role):
                if not is_loopback(g.host):
                    out.append(Problem((*pool_loc(t, role, g), "host"), f"{g.host} is reachable from other "
                                       f"machines, {what}", hint, severity="warning"))
    if not is_loopback(t.proxy.host):
        out.append(Problem(("proxy", "host"), f"{t.proxy.host} is reachable from other machines, {what}", hint,
                           severity="warning"))
    return out


# Measured (docs/notes/cpu-same-core-first-read-stall.md): 12-120 s on every bring-up with a prefill and a decode on
# one core, 0.16-0.56 s with the roles on different cores.
CROSS_ROLE_CORE = ("a prefill and a decode bound to the same CPU core: their first KV read was measured to stall until "
                   "the prefill's next step (12-120 s, past vLLM's 30 s KV lease); bind prefills and decodes to "
                   "different cores")


def _collisions(t: Topology) -> list[Problem]:
    """Every (host, port) and (host, platform, device) is claimed by one process at most."""
    ports: dict[tuple[str, int], str] = {}
    devices: dict[tuple[str, str, int], str] = {}
    device_role: dict[tuple[str, str, int], str] = {}  # the role of a device's first owner
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
                    key = (g.host, g.platform, dev)
                    cross = g.platform == "cpu" and device_role.setdefault(key, role) != role
                    claim(devices, key, owner, (*loc, "devices"), f"{g.platform} device",
                          "warning" if g.platform == "cpu" else "error", CROSS_ROLE_CORE if cross else None)
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
        """`--set dotted.path=value`; a TopologyError naming the flag when it is not one."""
        flag = f"--set {text}"
        key, sep, raw = text.partition("=")
        if not sep or not key.strip():
            raise TopologyError(Source(flag), [Problem(
                (), f"--set {text!r}: expected dotted.path=value, e.g. --set decode.block_size=64")])
        value = _flag_value(raw, flag) if raw.strip() else ""
        # A list index is ASCII digits only ('²'.isdigit() is true, and int() refuses it), and not absurdly long.
        path = tuple(int(k) if re.fullmatch(r"[0-9]{1,9}", k) else k for k in key.strip().split("."))
        return cls(path, value, flag)


def _flag_value(raw: str, flag: str) -> Any:
    """A flag's value as YAML (64 -> int, [0,1] -> list); text that is not YAML stays text. A value that breaks
    the loader's limits (a deep or alias-expanding document) is a TopologyError naming the flag."""
    try:
        return yamlsrc.parse_value(raw)
    except yamlsrc.YamlLimitError as e:
        raise TopologyError(Source(flag), [Problem((), e.message)]) from None
    except yamlsrc.YamlSourceError:
        return raw


def _pool_override(data: dict, o: Override) -> Override:
    """Overrides of a role written as a list of pools address a pool by name (--set decode.d64.block_size=128);
    a role-level flag (--decode-block-size) applies to a role with one pool and is refused with several."""
    role = o.path[0] if o.path else None
    pools = data.get(role) if role in ROLES else None
    if not isinstance(pools, list) or len(o.path) < 2 or isinstance(o.path[1], int):
        return o
    names = [p.get("name") for p in pools if isinstance(p, dict)]
    if o.path[1] in names:
        return replace(o, path=(role, names.index(o.path[1]), *o.path[2:]))
    if len(pools) == 1:
        return replace(o, path=(role, 0, *o.path[1:]))
    field_ = ".".join(map(str, o.path[1:]))
    raise TopologyError(Source(o.flag), [Problem(
        o.path, f"the topology has {len(pools)} {role} pools ({', '.join(map(str, names))}); say which",
        f"--set {role}.{names[0]}.{field_}=..." if names and o.path[1] in InstanceGroup.model_fields else
        f"{role} pools: {', '.join(map(str, names))}" if names else f"add a {role} pool first")])


def apply_overrides(data: dict, overrides: list[Override]) -> tuple[dict, list[Override]]:
    """The data with the overrides applied, and the overrides with pool names resolved to list indices."""
    data = copy.deepcopy(data)  # plain YAML data, bounded by yamlsrc (dates and bytes too, which JSON refuses)
    overrides = [_pool_override(data, o) for o in overrides]
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
    return data, overrides


def user_loc(problem: Problem, single: set[str]) -> Problem:
    """Problem paths as the user wrote the YAML: a role written as one mapping has no pool index."""

    def fix(loc: Loc) -> Loc:
        return (loc[0], *loc[2:]) if len(loc) > 1 and loc[0] in single and loc[1] == 0 else loc

    return replace(problem, path=fix(problem.path), related=tuple(fix(r) for r in problem.related))


@dataclass
class Loaded:
    topology: Topology
    source: Source
    base_dir: Path
    model_info: ModelInfo
    warnings: list[Problem] = field(default_factory=list)
    gate: tuple[list[str], list[str]] | None = None  # loaded for a gate: (settings applied, user's kept)


def validate_data(data: Any, source: Source, base_dir: Path) -> Loaded:
    if not isinstance(data, dict):
        raise TopologyError(source, [Problem((), "a topology is a mapping with name, model, prefill, decode")])
    single = {r for r in ROLES if isinstance(data.get(r), dict)}
    try:
        topo = Topology.model_validate(data)
    except ValidationError as e:
        raise TopologyError(source, [user_loc(p, single) for p in _from_validation_error(e, data)]) from None
    info = read_model_info(topo.model, base_dir)
    problems = [user_loc(p, single) for p in compatibility_problems(topo, info)]
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        raise TopologyError(source, errors)
    loaded = Loaded(topo, source, base_dir, info, [p for p in problems if p.severity == "warning"])
    topo._origin = loaded
    return loaded


def load_topology(path: str | Path, overrides: list[Override] = ()) -> Loaded:
    path = Path(path)
    source = Source(str(path))
    try:
        source.located = yamlsrc.load(yamlsrc.read_file(path, "the topology"))
    except yamlsrc.YamlSourceError as e:
        source.filename = f"{path}:{e.line}" if e.line else str(path)
        raise TopologyError(source, [Problem((), e.message)]) from None
    data = source.located.data
    if overrides:
        if not isinstance(data, dict):
            data = {}
        data, resolved = apply_overrides(data, list(overrides))
        source.overridden = {o.path: o.flag for o in resolved}
    try:
        base_dir = path.resolve().parent
    except (OSError, RuntimeError):  # it was just read, so this is a race; relative to where it was named
        base_dir = path.absolute().parent
    return validate_data(data, source, base_dir)


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


# `pdctl up --monitoring`: monitoring.enabled set from the command line (a problem it causes names the flag).
MONITORING_ON = Override(("monitoring", "enabled"), True, "--monitoring")


def overrides_from_flags(flags: dict[str, str | None], sets: list[str] = ()) -> list[Override]:
    """Typed flags arrive as text so a bad value is a topology error (exit 1), not a usage error."""
    out = []
    for key, raw in flags.items():
        if raw is None:
            continue
        flag, path = OVERRIDE_FLAGS[key]
        out.append(Override(path, _flag_value(raw, f"{flag} {raw}"), f"{flag} {raw}"))
    return out + [Override.parse_set(s) for s in sets]
