"""The topology's schema: the pydantic models of the YAML (model, pools per role, proxy, connector, engine,
supervision, reference, monitoring, auth, and Topology itself), with the defaults they fill in.

Pure: no file is read here, and no rule between fields of different sections is checked (the rules_* modules).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, model_validator

from pdctl.auth import ENV_NAME_PATTERN
from pdctl.protocol import ConnectorSettings, ProxyMetric

Platform = Literal["cuda", "cpu", "xpu", "hpu"]
Role = Literal["prefill", "decode"]
ROLES: tuple[Role, Role] = ("prefill", "decode")

# vLLM names the per-layer cache layout by its dimension order; HND/NHD are the short forms used by the
# NIXL connector (kv_cache_layout), LBHNC/LBNHC the long ones.
_LAYOUT_ALIASES = {"HND": "HND", "NHD": "NHD", "LBHNC": "HND", "LBNHC": "NHD"}
# A pool's kv_layout as vLLM's VLLM_KV_CACHE_LAYOUT names it (vLLM 0.32-0.34: HND and NHD are aliases of these).
VLLM_CACHE_LAYOUT = {"HND": "LBHNC", "NHD": "LBNHC"}
KV_LAYOUT_ENV = "VLLM_KV_CACHE_LAYOUT"
# Platforms whose cache layout is their attention backend's own, whatever VLLM_KV_CACHE_LAYOUT says: vLLM-CPU's
# CPU_ATTN packs blocks head-major (and refuses to start with NHD); vllm-gaudi keeps K and V as token-major slots.
FIXED_LAYOUT = {"cpu": "HND", "hpu": "NHD"}

# Platform defaults when a role leaves block_size out (the attention backends' usual kernel block).
DEFAULT_BLOCK_SIZE: dict[str, int] = {"cuda": 16, "cpu": 32, "xpu": 64, "hpu": 128}
CPU_BLOCK_MULTIPLE = 32  # CPU_ATTN kernel: "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"


def _layout(v: Any) -> Any:
    if isinstance(v, str) and v.upper() in _LAYOUT_ALIASES:
        return _LAYOUT_ALIASES[v.upper()]
    return v


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
    """prefill-0 in a single-pool role, prefill-p32-0 in a named pool."""
    return f"{role}-{index}" if pool == DEFAULT_POOL else f"{role}-{pool}-{index}"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class ModelSpec(_Strict):
    path: str = Field(min_length=1, description="local directory or hub id")
    served_name: str | None = Field(None, description="the model name clients send (vLLM's --served-model-name); "
                                    "default: the path")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="weights and activations (vLLM's --dtype); the same on every server, so P/D and the "
        "aggregated reference compute the same tokens")
    max_model_len: int | None = Field(None, ge=16, description="longest prompt plus output a request may have "
                                      "(vLLM's --max-model-len); default: the model's")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto", description="every pool's KV cache element type (a pool may set its own); P and D must agree")
    kv_heads: int | None = Field(None, ge=1, le=2**16, description="KV heads, when config.json is not local")
    attention: Literal["full", "hybrid"] | None = Field(
        None, description="the model's attention, when config.json is not local: full, or hybrid (sliding-window "
        "and full-attention layers, e.g. gpt-oss, Gemma 2/3), which vLLM's hybrid KV cache manager keeps in one KV "
        "cache group per kind and the connector rules treat apart. A local config.json decides; this field must "
        "then agree with it")
    seed: int = Field(0, description="vLLM's --seed on every server: sampling with temperature > 0 repeats")

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


class Pool(_Strict):
    """One pool: instances of one role that share hardware and settings. Instance i gets http_port+i,
    side_channel_port+i, devices[i*tp:(i+1)*tp]. Ports left out are assigned after every explicit one
    (Topology._assign_ports), so pools never collide."""

    name: str = Field(pattern=POOL_NAME_PATTERN,
                      description="pool name (an identifier): in instance names, logs, metrics and reports")
    platform: Platform = Field("cpu", description="the pool's accelerator: cuda, cpu, xpu (Intel GPU) or hpu "
                               "(Intel Gaudi)")
    count: int = Field(1, ge=1, le=64, description="instances in the pool (each its own vLLM server)")
    block_size: int | None = Field(None, ge=1, le=2048, description="KV block size in tokens; default the "
                                   "platform's (cuda 16, cpu 32, xpu 64, hpu 128); P and D may differ")
    tp: int = Field(1, ge=1, le=64, description="tensor-parallel size of each instance")
    devices: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, description="device ids (CPU: cores) for the pool's instances, tp per instance in order; default: "
        "none pinned (the platform's own choice)")
    kv_layout: KvLayout | None = Field(
        None, description="the KV cache layout, set as VLLM_KV_CACHE_LAYOUT on cuda and xpu: HND (vLLM's LBHNC, "
        "heads outermost in a block: the default, and what TP between pools needs) or NHD (LBNHC, tokens "
        "outermost). cpu is HND and hpu NHD whatever is set (their attention backends' own layouts)")
    host: str = Field("127.0.0.1", description="where the pool's servers listen (and, on the local engine, run)")
    http_port: Port | None = Field(None, description="first instance's HTTP port (instance i: +i); default: "
                                   "assigned after every explicit port")
    side_channel_port: Port | None = Field(None, description="first instance's NIXL side channel port (instance "
                                           "i: +i); default: assigned")
    kv_cache_memory: ByteSize | None = Field(None, description="bytes of KV cache per instance (e.g. 512MiB); "
                                             "CPU default 256MiB")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="accelerators: the share of "
                                                 "device memory vLLM may use (instead of kv_cache_memory)")
    enforce_eager: bool | None = Field(None, description="no graph capture or compilation; default on for CPU "
                                       "(the gates compare servers in one mode)")
    model: str | None = Field(None, description="model path on this pool's hosts, if it differs")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] | None = Field(
        None, description="this pool's KV element type (default: model.kv_cache_dtype)")
    kv_buffer_device: BufferDevice | None = Field(
        None, description="where this pool's KV is registered for NIXL (default: connector.kv_buffer_device, "
        "else the platform's own memory)")
    net_devices: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.:,-]+$", description="the network devices UCX may use for this pool's KV "
        "across hosts (UCX_NET_DEVICES, e.g. mlx5_0:1 or eth0); unset, UCX picks (RDMA where there is some). On "
        "one host pdctl's shared-memory settings need none")
    weight: float = Field(1.0, gt=0, description="share of traffic relative to other pools (unequal hardware)")
    placement: Placement | None = Field(None, description="cluster placement of this pool (default: the "
                                        "role's engine.placement)")
    restart: Literal["on-failure", "always", "never"] = Field(
        "on-failure", description="what the supervisor does when an instance exits or fails its health checks "
        "persistently: on-failure (not after a clean exit 0), always, never")
    nice: int = Field(
        0, ge=-20, le=19, strict=True, description="added to the niceness of every process of each instance (API "
        "server, engine core, workers), like `nice -n`: for a host shared with other work, or servers whose threads "
        "spin (vLLM's stock connector: 19 lets the rest of a small host run). Not a latency setting: 10 on a decode "
        "pool sharing cores with prefills measured no goodput gain; below 0 needs CAP_SYS_NICE (or RLIMIT_NICE)")
    extra_args: list[str] = Field(default_factory=list, description="more vLLM server flags for this pool's "
                                  "instances, e.g. [--max-num-seqs, '64']; a flag given here wins over pdctl's "
                                  "(a CPU prefill pool's default --max-num-batched-tokens 4096)")
    env: dict[str, str] = Field(default_factory=dict, description="environment of this pool's servers; overrides "
                                "pdctl's own (e.g. UCX_TLS: validate refuses what NIXL cannot transfer with)")

    @model_validator(mode="after")
    def _platform_defaults(self) -> Pool:
        if self.block_size is None:
            self.block_size = DEFAULT_BLOCK_SIZE[self.platform]
        if self.kv_layout is None:
            self.kv_layout = FIXED_LAYOUT.get(self.platform, "HND")
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


class ProxySettings(_Strict):
    """How the proxy listens and routes: the topology's `proxy:` section and, with the instances' addresses,
    the whole configuration of a running pdctl proxy (pdctl.proxy.config.ProxyConfig): one definition each."""

    host: str = Field("127.0.0.1", description="where the proxy listens: the deployment's one endpoint")
    port: Port = Field(8000, description="the proxy's port")
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
        f"(the decode computes the prompt; counted in {ProxyMetric.FALLBACKS}_total), 'reject' answers an "
        "error at once. The gates run with 'reject'")
    connect_timeout_s: float = Field(10.0, gt=0, description="upstream TCP connect")
    first_byte_timeout_s: float = Field(600.0, gt=0, description="request sent -> first byte of the answer "
                                        "(a prefill computing a long prompt, a decode waiting for its KV)")
    read_timeout_s: float = Field(600.0, gt=0, description="between two bytes of an answer once it started")
    breaker_failures: int = Field(3, ge=1, description="consecutive failures that take an instance out of "
                                  "routing (circuit breaker)")
    breaker_open_s: float = Field(10.0, gt=0, description="how long a tripped instance stays out before one "
                                  "trial request (half-open)")


class ProxySpec(ProxySettings):
    """The topology's `proxy:` section: the settings above, and which proxy runs (kind) with what it needs."""

    kind: ProxyKind = Field("pdctl", description="pdctl (pdctl's own proxy) or vllm-router (the vLLM project's "
                            "Rust router, extra `router`): same endpoint, pdctl starts and supervises either")
    metrics_port: Port | None = Field(None, description="vllm-router only: its Prometheus /metrics port "
                                      "(default port + 1); pdctl's proxy serves /metrics on its own port")

    @property
    def router_metrics_port(self) -> int | None:
        """Where vllm-router serves /metrics (None for pdctl's proxy, which serves it on its own port)."""
        return (self.metrics_port or self.port + 1) if self.kind == "vllm-router" else None


class ConnectorSpec(_Strict):
    kind: Literal["pdctl", "nixl"] = Field(
        "pdctl", description="pdctl = pdctl's heterogeneous connector; nixl = vLLM's stock NixlConnector"
    )
    kv_buffer_device: BufferDevice | None = Field(None, description="every pool's default")
    backends: list[str] = Field(default_factory=lambda: ["UCX"], min_length=1,
                                description="NIXL transfer backends, in order of preference")
    progress_thread: bool = Field(ConnectorSettings.progress_thread, description="NIXL's progress thread (serves a "
                                  "peer's transfers while the engine is busy); off: only the engine's own polls "
                                  "progress them")
    progress_delay_us: int = Field(ConnectorSettings.progress_delay_us, ge=0,
                                   description="sleep between NIXL progress passes (pdctl only)")
    kv_load_failure_policy: Literal["recompute", "fail"] = Field(
        "recompute", description="a decode whose KV does not arrive (read failed, prefill gone, no staging "
        "room): 'recompute' computes the prompt locally (correct, slower, counted), 'fail' ends the request "
        "with an error. vLLM's own default is 'fail'; the gates run with 'fail'")
    kv_read_timeout_s: float = Field(
        ConnectorSettings.kv_read_timeout_s, gt=0, description="pdctl's connector: a KV read still in progress "
        "this long after it was posted is given up through vLLM's failure path (kv_load_failure_policy: recompute "
        "or fail), its blocks returned only once NIXL let go of them; a read is not started when it could outlast "
        "the prefill's KV lease (kv_lease_duration, which the plan sets to 30 s unless extra_config sets it). "
        "Reads on one host take milliseconds; without this bound a stalled read waits until the lease runs out")
    trace: bool = Field(
        ConnectorSettings.trace, description="per-request timing lines in each decode's log (pdctl's connector): "
        "when its scheduler saw a remote-KV request and gave it blocks, when the worker issued the read, saw it "
        "done and converted it, when the scheduler learnt the KV had arrived and scheduled the first token; joined "
        "with the proxy's own timestamps by `pdctl bench --breakdown` and scripts/bench_pd_latency.py")
    kv_fingerprint: bool = Field(
        ConnectorSettings.kv_fingerprint, description="pdctl's connector: every transfer's KV checked. Each prefill "
        "fingerprints the prompt's KV where it lies (integer sums over its bits by logical coordinates), each decode "
        "TP rank the KV it received after conversion; a mismatch fails the request's KV load "
        "(kv_load_failure_policy), logged with the first differing layer, tokens and head and counted in /metrics "
        "and `pdctl status`. Off by default: on this 2-core CPU host it costs about 9 % of TTFT at one request at "
        "a time (docs/benchmarks.md); on a GPU an estimated < 1 %")
    extra_config: dict[str, Any] = Field(default_factory=dict, description="more kv_connector_extra_config "
                                         "entries for vLLM's connector (e.g. kv_lease_duration, num_threads)")
    allow_unsafe_hybrid: bool = Field(
        False, description="negative controls only: let vLLM's stock connector (kind: nixl) pair a hybrid "
        "(sliding-window + full attention) model's KV with the hybrid KV cache manager on, which pdctl otherwise "
        "refuses (a warning instead). It exists to prove the "
        "gates catch the stock connector's silent KV corruption there; never for serving")

    @model_validator(mode="after")
    def _trace_needs_pdctl(self) -> ConnectorSpec:
        if self.trace and self.kind != "pdctl":
            raise ValueError("trace: the timing lines come from pdctl's connector; set kind: pdctl")
        if self.kv_fingerprint and self.kind != "pdctl":
            raise ValueError("kv_fingerprint: the fingerprints are pdctl's connector's; set kind: pdctl")
        return self


class ReferenceSpec(_Strict):
    """The aggregated server the gates compare P/D against (`pdctl check`, `pdctl bench`): the first decode
    pool's hardware and settings, no connector."""

    port: Port = Field(8300, description="the reference's HTTP port on the first decode pool's host while a gate "
                       "runs (check, eval --reference auto, bench): set it where 8300 is taken, or to run two "
                       "gates on one host at once")


class SupervisionSpec(_Strict):
    """How `pdctl up` keeps instances running (each pool's `restart` says whether it may)."""

    health_failures: int = Field(3, ge=1, description="consecutive failed /health probes before a restart ...")
    health_window_s: float = Field(30.0, ge=0, description="... and at least this long since the first of them "
                                   "(a /health stalled behind a busy engine on a small host is not a crash)")
    health_interval_s: float = Field(5.0, gt=0, description="seconds between health probes of one instance")
    backoff_s: float = Field(2.0, gt=0, description="wait before the first restart; doubles per restart in the window")
    backoff_max_s: float = Field(60.0, gt=0, description="the longest wait between restarts")
    max_restarts: int = Field(5, ge=0, description="restarts of one instance allowed per window; then it stays down")
    window_s: float = Field(600.0, gt=0, description="seconds over which max_restarts counts")


class MonitoringSpec(_Strict):
    """Prometheus beside the topology (`pdctl up --monitoring`): one more supervised process on this host, its
    config, rules and data in the state dir, scraping every instance and the proxy."""

    enabled: bool = Field(False, description="run Prometheus with the topology (also `pdctl up --monitoring`)")
    host: str = Field("127.0.0.1", description="where Prometheus listens")
    port: Port = Field(9090, description="Prometheus's port")
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

    kind: EngineKind = Field("local", description="local (this host's process groups), ray or slurm")
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
    """A role written as one mapping is one pool named 'default'; a list is several pools."""
    if isinstance(v, dict):
        pool: dict[Any, Any] = {"name": DEFAULT_POOL}
        pool.update(v)  # not {**v}: a non-string key (1: x) is pydantic's to reject, not a TypeError here
        return [pool]
    return v


MAX_POOLS = 64  # per role; the rules look at every prefill x decode pair
Pools = Annotated[list[Pool], BeforeValidator(_as_pools), Field(min_length=1, max_length=MAX_POOLS)]


class Topology(_Strict):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$", description="the deployment's name: its state "
                      "directory (.pdctl/<name>), `pdctl status <name>`, reports")
    model: ModelSpec
    prefill: Pools
    decode: Pools
    proxy: ProxySpec = Field(default_factory=ProxySpec)
    connector: ConnectorSpec = Field(default_factory=ConnectorSpec)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    supervision: SupervisionSpec = Field(default_factory=SupervisionSpec)
    reference: ReferenceSpec = Field(default_factory=ReferenceSpec)
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec)
    # None (not an empty AuthSpec) when the YAML has no auth: a plan's JSON then leaves it out (Plan.to_dict).
    auth: AuthSpec | None = Field(None, description="API keys (auth.api_key_env)")
    # Where it was loaded from (file, base dir, model facts, warnings): set by validate_data, never serialized.
    _origin: Any = PrivateAttr(default=None)

    @property
    def origin(self) -> Any:
        """How this topology was loaded: a Loaded (load.py), or None for one built in code or read back from a plan.
        Typed Any: the schema does not import the loader, which imports the schema."""
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

    def ports_moved(self, offset: int) -> Topology:
        """This topology with every port it listens on moved by offset (HTTP, NIXL side channel, proxy, its metrics,
        the reference, Prometheus): a second deployment of it that can be up beside the first on the same host."""
        def pools(role: Role) -> list[Pool]:
            return [g.model_copy(update={"http_port": g.http_port_of(0) + offset,
                                         "side_channel_port": g.side_channel_port_of(0) + offset})
                    for g in self.pools(role)]

        px = self.proxy
        moved = self.model_copy(update={
            "prefill": pools("prefill"), "decode": pools("decode"),
            "proxy": px.model_copy(update={"port": px.port + offset,
                                           "metrics_port": px.metrics_port and px.metrics_port + offset}),
            "reference": self.reference.model_copy(update={"port": self.reference.port + offset}),
            "monitoring": self.monitoring.model_copy(update={"port": self.monitoring.port + offset})})
        moved._origin = self._origin
        return moved

    def pools(self, role: Role) -> list[Pool]:
        return self.prefill if role == "prefill" else self.decode

    def pool(self, role: Role, name: str) -> Pool:
        return next(g for g in self.pools(role) if g.name == name)

    def pairs(self) -> list[tuple[Pool, Pool]]:
        """Every prefill pool x decode pool pair the proxy may route (exclude_pairs left out)."""
        excluded = {tuple(x) for x in self.proxy.exclude_pairs}
        return [(p, d) for p in self.prefill for d in self.decode if (p.name, d.name) not in excluded]

    def model_path(self, pool: Pool) -> str:
        return pool.model or self.model.path

    def kv_cache_dtype(self, pool: Pool) -> str:
        return pool.kv_cache_dtype or self.model.kv_cache_dtype

    def kv_buffer_device(self, pool: Pool) -> str:
        return pool.kv_buffer_device or self.connector.kv_buffer_device or (
            "cpu" if pool.platform == "cpu" else pool.platform)

    def staging_blocks(self, decode: Pool) -> int:
        """Decode blocks a decode pool withholds for prefill block > decode block: whole prefill blocks are
        read, and chunks past a request's own decode blocks land here (2*(ratio-1) per request at most, room
        for 16 at once), sized for the largest ratio among the prefill pools that reach it."""
        assert decode.block_size is not None
        ratio = max(((p.block_size or 0) // decode.block_size for p, d in self.pairs() if d is decode), default=0)
        return 32 * (ratio - 1) if ratio > 1 else 0
