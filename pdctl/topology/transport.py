"""UCX settings for where each pair runs, and what a pool's own UCX settings may not do (pure).

NIXL opens UCX endpoints with peer-failure handling. UCX's shared-memory transports serve such endpoints only with
`UCX_MM_ERROR_HANDLING=y` (without it `UCX_TLS=sm,self` is refused at start: "no peer failure handler"), so by
default NIXL's notifications and UCX's wire-up travel over TCP, whose progress needs the *target's* worker: a first
read between two processes of one host then waits for the prefill's next step (docs/notes/ucx-transports.md).
"""

from __future__ import annotations

from pdctl.topology.schema import ROLES, Pool, Topology

# One host, KV in host memory: shared-memory lanes with peer-failure handling, no TCP lane for UCX (NIXL's side
# channel stays ZMQ over TCP); reads go over cma (process_vm_readv by the reader).
TLS_ENV, MM_ERROR_ENV, NET_DEVICES_ENV = "UCX_TLS", "UCX_MM_ERROR_HANDLING", "UCX_NET_DEVICES"
UCX_ONE_HOST = {TLS_ENV: "posix,cma,self", MM_ERROR_ENV: "y", "UCX_RESOLVE_REMOTE_EP_ID": "n"}
# Anything else: UCX picks its transports (RDMA where there is some); a TCP endpoint connects without blocking the
# worker (a blocking connect() to a dead peer follows Linux's SYN retries, 1+2+4+8+16 = 31 s).
UCX_ACROSS_HOSTS = {"UCX_TCP_CONN_NB": "y"}

# UCX_TLS names by what they can do for NIXL: carry its notifications and UCX's wire-up within one host (active
# messages over shared memory), or reach another host.
SHARED_MEMORY_AM = {"sm", "shm", "posix", "sysv"}
ONE_HOST_ONLY = SHARED_MEMORY_AM | {"cma", "xpmem", "knem", "self", "cuda_ipc", "rocm_ipc", "cuda_copy", "rocm_copy"}


def transport_env(t: Topology) -> dict[str, str]:
    """UCX settings for every server of the topology, from where its pairs run: one host (the local engine) with
    every pool's KV in host memory, or anything else (cluster engines place instances on several hosts; device
    memory on one host needs UCX's device transports, which a shared-memory-only list would exclude)."""
    one_host = t.engine.kind == "local"
    host_memory = all(t.kv_buffer_device(g) == "cpu" for role in ROLES for g in t.pools(role))
    return dict(UCX_ONE_HOST) if one_host and host_memory else dict(UCX_ACROSS_HOSTS)


def pool_ucx(t: Topology, pool: Pool) -> dict[str, str]:
    """The UCX settings a pool's servers get: pdctl's for the placement, then the pool's own `env`."""
    env = {**transport_env(t), **({NET_DEVICES_ENV: pool.net_devices} if pool.net_devices else {})}
    return {**env, **{k: v for k, v in pool.env.items() if k.startswith("UCX_")}}


def tls_list(value: str) -> set[str] | None:
    """UCX_TLS as a set of names; None when it is not a plain list (`^` excludes, `all` is everything)."""
    names = {n.strip().lower() for n in value.split(",") if n.strip()}
    if value.strip().startswith("^") or "all" in names:
        return None
    return names


def ucx_problem(env: dict[str, str], crosses_hosts: bool) -> tuple[str, str] | None:
    """(why, fix) when these UCX settings cannot carry NIXL's transfers, else None."""
    tls = tls_list(env.get(TLS_ENV, "all"))
    if tls is None:
        return None
    network = tls - ONE_HOST_ONLY
    if crosses_hosts and not network:
        return (f"UCX_TLS={env['UCX_TLS']} has only transports within one host, and this pool's pairs cross hosts",
                "add a network transport (tcp, rc, ud, dc) or leave UCX_TLS to pdctl")
    if not network and not tls & SHARED_MEMORY_AM:
        return (f"UCX_TLS={env['UCX_TLS']} has no transport for NIXL's notifications (active messages: "
                f"{', '.join(sorted(SHARED_MEMORY_AM))} or a network one)", "add posix, or leave UCX_TLS to pdctl")
    if not network and env.get(MM_ERROR_ENV, "n").lower() not in ("y", "yes", "on", "1"):
        return (f"UCX_TLS={env['UCX_TLS']}: NIXL opens its endpoints with peer-failure handling, which UCX's "
                "shared-memory transports serve only with UCX_MM_ERROR_HANDLING=y (vLLM fails at start: "
                "'no peer failure handler')", "set UCX_MM_ERROR_HANDLING=y as well, or leave UCX_TLS to pdctl")
    return None
