"""When a decode may start a KV read, and when it must give one up: pure decisions on one host's monotonic clock.

A prefill holds a request's KV blocks for `kv_lease_duration` seconds from when it answered (vLLM's lease), then
releases them to its allocator, which may hand them to another request. The decode cannot read the prefill's
clock (hosts' clocks differ), and vLLM's heartbeats that extend the lease are not acknowledged, so what the decode
knows for certain is its own: the prefill answered before the decode's scheduler saw the request's KV parameters.
A read may start only when it is bound to end (its timeout) before the earliest moment the lease can run out; a
read still in progress after its timeout is given up, through vLLM's failure path (kv_load_failure_policy).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

KV_LEASE_S = 30  # vLLM's default kv_lease_duration; pdctl's plan sets it explicitly on every side

# The proxy's hop, from the prefill's answer to the decode's scheduler seeing the request (same-host or LAN).
HOP_MARGIN_S = 1.0
# A read in progress this long has its prefill asked whether it is still there (a healthy read takes milliseconds;
# a dead prefill's reads are given up then, not at the timeout).
PEER_CHECK_AFTER_S = 0.5


def read_allowed(seen_at: float, now: float, lease_s: float, read_timeout_s: float,
                 margin_s: float = HOP_MARGIN_S) -> bool:
    """Whether a read started `now` ends, at the latest, before the prefill's hold on the blocks can run out.

    `seen_at`: when the decode's scheduler saw the request's KV parameters (the lease began before it)."""
    return (now - seen_at) + margin_s + read_timeout_s <= lease_s


def expired_reads(posted_at: Mapping[str, float], now: float, read_timeout_s: float) -> list[str]:
    """The requests whose read, posted at `posted_at[req]`, has been in progress longer than the timeout."""
    return sorted(r for r, t in posted_at.items() if now - t > read_timeout_s)


def reads_of_gone_peers(posted_at: Mapping[str, float], peer_of: Mapping[str, object], gone: Callable[[object], bool],
                        now: float, after_s: float = PEER_CHECK_AFTER_S) -> list[str]:
    """The requests whose read has been in progress longer than `after_s` from a prefill that `gone(peer)` says is
    no longer there. `gone` is asked only for those reads' peers, each once."""
    late = sorted(r for r, t in posted_at.items() if now - t > after_s and r in peer_of)
    verdict: dict[object, bool] = {}
    for r in late:
        if peer_of[r] not in verdict:
            verdict[peer_of[r]] = gone(peer_of[r])
    return [r for r in late if verdict[peer_of[r]]]


def check_settings(lease_s: float, read_timeout_s: float, margin_s: float = HOP_MARGIN_S) -> str | None:
    """Why a lease and a read timeout cannot work together (None when they can): a read must be able to start
    and end inside the lease, with room for the request to wait on the decode."""
    if read_timeout_s <= 0:
        return f"the read timeout must be above 0 s (got {read_timeout_s:g})"
    if read_timeout_s + margin_s > lease_s / 2:
        return (f"a read timeout of {read_timeout_s:g} s leaves a KV lease of {lease_s:g} s too little room: a read "
                f"must fit in the lease with the proxy's hop ({margin_s:g} s) and the wait on the decode; keep the "
                f"timeout at most {max(lease_s / 2 - margin_s, 0):g} s or lengthen the lease")
    return None
