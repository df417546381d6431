"""Contracts between pdctl's processes, one definition each: the proxy's headers, vLLM's P/D request parameters,
and the log lines pdctl's connector (and vLLM) write that launch, the gates and bench read. Pure: names, formats
and their parsers, standard library only (the connector imports it inside vLLM's processes)."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

# -- HTTP headers of pdctl's proxy ------------------------------------------------------------------------------
ROUTE_HEADER = "x-pdctl-route"  # PREFILL_POOL/DECODE_POOL: pins the pair (gates, operators)
REJECT_HEADER = "x-pdctl-on-prefill-down"  # "reject": this request may not fall back to decode-only (warm-up)
# Per request: "on": the prefill's token first (when the request allows it), "auto": only while the decode is
# busy, "off": the decode's stream as it is (the default, or `pdctl proxy --first-token`'s).
FIRST_HEADER = "x-pdctl-first-token"
# The error type that ends such a stream when the decode's first token is not the prefill's (a greedy near tie the
# two sides broke differently, or broken KV): the gates tell which.
FIRST_TOKEN_MISMATCH = "first_token_mismatch"
# In the proxy's answers: the instances that served the request, and why a request was served decode-only.
PREFILL_SERVED_HEADER = "x-pdctl-prefill"
DECODE_SERVED_HEADER = "x-pdctl-decode"
FALLBACK_HEADER = "x-pdctl-fallback"

# -- pdctl's proxy, told by the supervisor ------------------------------------------------------------------------
# POST {"instance": NAME, "held": true|false}: a held instance gets no request (it restarts, or its pairs are
# being proven again) until it is released; the proxy's own health probes cannot tell a restarted server whose
# KV pairs are not wired yet from one that serves.
HOLD_ROUTE = "/pdctl/hold"

# -- the plan -> connector contract ----------------------------------------------------------------------------
# pdctl's plan writes its connector's settings under kv_connector_extra_config[CONNECTOR_SETTINGS_KEY]; the
# connector reads them at start (scheduler and worker). Every key, its type and its default is ConnectorSettings'.
CONNECTOR_SETTINGS_KEY = "pdctl"
# Raised whenever a key is added, removed or changes meaning: a plan and a connector of other versions then fail
# at the server's start, naming both, instead of half-working.
CONNECTOR_SETTINGS_VERSION = 2


class SettingsError(ValueError):
    """pdctl's connector settings are not what this connector reads: `key` is the one at fault (None: the whole
    mapping)."""

    def __init__(self, key: str | None, message: str):
        where = f"kv_connector_extra_config[{CONNECTOR_SETTINGS_KEY!r}]" + (f"[{key!r}]" if key else "")
        super().__init__(f"pdctl connector: settings {where}: {message}")
        self.key = key
        self.reason = message


@dataclass(frozen=True)
class ConnectorSettings:
    """pdctl's connector settings, as the plan writes them and the connector reads them (every key required)."""

    version: int = CONNECTOR_SETTINGS_VERSION
    progress_thread: bool = True  # NIXL's progress thread (serves a peer's transfers while the engine is busy)
    progress_delay_us: int = 1000  # its sleep between passes: nixl's own thread spins a core per server
    staging_blocks: int = 0  # decode: blocks withheld for prefill block > decode block (pdctl.kv.reads)
    kv_read_timeout_s: float = 5.0  # a read in progress this long is given up (pdctl.kv.lease)
    trace: bool = False  # per-request timing lines in the decode's log
    kv_fingerprint: bool = False  # prefill: fingerprint each prompt's KV; decode: check what arrived against it

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, given: Any) -> ConnectorSettings:
        """The settings a plan wrote; SettingsError naming the key when one is unknown, missing, of another type,
        or when the plan's version is not this connector's."""
        if given is None:
            raise SettingsError(None, "missing: pdctl's plan writes these settings for every server it starts "
                                "with its connector (connector.kind: pdctl)")
        if not isinstance(given, dict):
            raise SettingsError(None, f"expected a mapping of settings, got {type(given).__name__}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise SettingsError(unknown[0], f"unknown setting (pdctl's connector reads {', '.join(known)})")
        version = given.get("version")
        if version != CONNECTOR_SETTINGS_VERSION:
            raise SettingsError("version", f"the plan was written for connector settings version {version}, this "
                                f"connector reads version {CONNECTOR_SETTINGS_VERSION}: plan and connector must come "
                                "from one pdctl (start the servers with the pdctl installed in their Python)")
        for name, f in known.items():
            if name not in given:
                raise SettingsError(name, "missing (pdctl's plan writes every setting)")
            value, (kind, what) = given[name], _KINDS[f.type]
            if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
                raise SettingsError(name, f"{value!r} is not {what}")
        return cls(**{k: float(v) if known[k].type == "float" else v for k, v in given.items()})


# A field's annotation (a string under `from __future__ import annotations`) -> the values it takes, and their name.
_KINDS: dict[str, tuple[type | tuple[type, ...], str]] = {
    "int": (int, "an integer"), "bool": (bool, "true or false"), "float": ((int, float), "a number")}

# -- environment variables pdctl sets for the processes it starts ------------------------------------------------
# pdctl's vLLM plugin calms vLLM's executor queues on CPU only where this is set (seconds a reader spins).
QUEUE_SPIN_ENV = "PDCTL_QUEUE_SPIN_S"


# -- metric names ----------------------------------------------------------------------------------------------
# One definition each, for their writer and every reader (the gates, bench, `pdctl status`, the monitoring rules).
# Exposed as named here for gauges; a counter as NAME_total; a histogram as NAME_bucket, NAME_sum and NAME_count.


class ProxyMetric:
    """pdctl's proxy's series (pdctl.proxy.metrics writes them)."""

    REQUESTS = "pdctl_proxy_requests"  # counter, by route and status
    PAIR_REQUESTS = "pdctl_proxy_pair_requests"  # counter, by prefill pool, decode pool and status
    UPSTREAM_ERRORS = "pdctl_proxy_upstream_errors"  # counter, by instance
    KV_MISSING = "pdctl_proxy_kv_transfer_missing"  # counter: prefill answers without kv_transfer_params
    FALLBACKS = "pdctl_decode_only_fallback"  # counter, by reason: a decode served a request alone
    PREFILL_RETRIES = "pdctl_proxy_prefill_retries"  # counter
    REJECTED = "pdctl_proxy_rejected"  # counter, by reason
    FIRST_TOKEN = "pdctl_proxy_first_token"  # counter, by outcome
    INFLIGHT = "pdctl_proxy_inflight"  # gauge, per instance
    BREAKER_OPEN = "pdctl_proxy_breaker_open"  # gauge, per instance
    BREAKER_TRIPS = "pdctl_proxy_breaker_trips"  # counter, per instance
    TTFT = "pdctl_proxy_ttft_seconds"  # histogram, per pair
    DURATION = "pdctl_proxy_request_duration_seconds"  # histogram, per pair and route
    PREFILL = "pdctl_proxy_prefill_seconds"  # histogram, per prefill pool


class VllmMetric:
    """vLLM 0.32's series pdctl reads (its PrometheusStatLogger, vllm/v1/metrics/loggers.py, and its NIXL
    connector's, kv_connector/v1/nixl/stats.py)."""

    RUNNING = "vllm:num_requests_running"  # gauge
    WAITING = "vllm:num_requests_waiting"  # gauge
    KV_USAGE = "vllm:kv_cache_usage_perc"  # gauge
    PROMPT_TOKENS = "vllm:prompt_tokens"  # counter
    GENERATION_TOKENS = "vllm:generation_tokens"  # counter
    PROMPT_BY_SOURCE = "vllm:prompt_tokens_by_source"  # counter, by source (local compute, KV transfer, ...)
    SUCCESS = "vllm:request_success"  # counter
    TTFT = "vllm:time_to_first_token_seconds"  # histogram
    ITL = "vllm:inter_token_latency_seconds"  # histogram
    E2E = "vllm:e2e_request_latency_seconds"  # histogram
    NIXL_FAILED = "vllm:nixl_num_failed_transfers"  # counter
    NIXL_XFER_TIME = "vllm:nixl_xfer_time_seconds"  # histogram
    NIXL_BYTES = "vllm:nixl_bytes_transferred"  # histogram


# -- the connector's handshake ------------------------------------------------------------------------------------
# vLLM's NIXL handshake has no field for a CPU cache's packing (the attention ISA): pdctl's connector appends it to
# the attention backend name it advertises, and strips it before vLLM's own code compares backends.
ISA_TAG = "+pdctl-isa="


def tag_backend(name: str, isa: str | None) -> str:
    """The attention backend name with this side's CPU attention ISA appended."""
    return f"{name}{ISA_TAG}{isa}" if isa else name


def untag_backend(name: str) -> tuple[str, str | None]:
    """(backend, ISA or None) from an advertised backend name (None: a stock prefill said nothing)."""
    base, sep, isa = name.partition(ISA_TAG)
    return base, (isa or None) if sep else None


# -- vLLM's P/D protocol ----------------------------------------------------------------------------------------
# The prefill's request: compute the prompt, hold its KV for a decode, answer with the kv_transfer_params the
# decode reads it with.
REMOTE_DECODE_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                        "remote_block_ids": None, "remote_host": None, "remote_port": None}

# vLLM's kv_connector_extra_config switch for NIXL's compatibility hash, which pdctl's plan turns off between two
# kinds of device (the hash covers the vLLM build and the attention backend).
HANDSHAKE_COMPAT_KEY = "enforce_handshake_compat"

# The prefill's KV fingerprint (pdctl.kv.fingerprint) in its kv_transfer_params, for the decode to check what it
# received against: one hex word per fingerprint chunk of the prompt, every TP rank's share added. Hex, not JSON
# integers: a 64-bit value would lose bits in a JSON reader that holds numbers as doubles (a router on the way).
FINGERPRINT_KEY = "pdctl_kv_fingerprint"
FINGERPRINT_VERSION = 2


class FingerprintError(ValueError):
    """A kv_transfer_params fingerprint that cannot be read: the message names the key and what is wrong."""


def _hex(a) -> str:
    return a.astype(">u8").tobytes().hex()


def encode_fingerprint(fp) -> dict:
    """The value under FINGERPRINT_KEY for a prompt's KV fingerprint (pdctl.kv.fingerprint.Fingerprint): its
    uint64 sums as hex words (a JSON reader holding numbers as doubles would lose bits), row by row."""
    return {"v": FINGERPRINT_VERSION, "heads": fp.heads, "chunks": _hex(fp.chunks), "layers": _hex(fp.layers)}


def decode_fingerprint(value: object):
    """The fingerprint a prefill sent (pdctl.kv.fingerprint.Fingerprint); FingerprintError naming what is wrong."""
    import numpy as np

    from pdctl.kv.fingerprint import Fingerprint

    where = f"kv_transfer_params[{FINGERPRINT_KEY!r}]"
    if not isinstance(value, dict) or value.get("v") != FINGERPRINT_VERSION:
        raise FingerprintError(f"{where}: expected {{'v': {FINGERPRINT_VERSION}, 'heads': N, 'chunks': HEX, "
                               f"'layers': HEX}}, got {value!r:.80}")
    heads = value.get("heads")
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
        raise FingerprintError(f"{where}['heads']: expected a positive integer, got {heads!r:.40}")
    rows = []
    for name in ("chunks", "layers"):
        text = value.get(name)
        try:  # bytes.fromhex checks the digits in C: a decode parses one of these per request
            raw = bytes.fromhex(text) if isinstance(text, str) and not len(text) % (16 * heads) else None
        except ValueError:
            raw = None
        if raw is None or 2 * len(raw) != len(text):
            raise FingerprintError(f"{where}[{name!r}]: not 16 hex digits per word, {heads} words per row "
                                   f"({len(text) if isinstance(text, str) else type(text).__name__})")
        rows.append(np.frombuffer(raw, dtype=">u8").astype(np.uint64).reshape(-1, heads))
    return Fingerprint(*rows)


# -- log lines --------------------------------------------------------------------------------------------------
# pdctl's connector, with its `trace` setting: "... pdctl trace <stage> <vLLM request id> <wall-clock time>".
TRACE_MARK = "pdctl trace"
TRACE_LINE = re.compile(re.escape(TRACE_MARK) + r" (\w+) (\S+) (\d+\.\d+)")


def trace_line(stage: str, req_id: str, at: float) -> str:
    return f"{TRACE_MARK} {stage} {req_id} {at:.6f}"


# pdctl's connector, per completed (or failed) read on a decode: which prefill engine (host:port of its side
# channel) it came from; the fleet gate keys it by request id.
RECEIVED_FORMAT = ("pdctl connector: %s request %s from engine %s at %s:%s (prefill block %s -> decode block %d): "
                   "%d decode blocks, %s prompt tokens; %d tokens from this engine so far; read %s ms")
RECEIVED_LINE = re.compile(r"pdctl connector: received request (\S+) from engine \S+ at ([^\s:]+):(\d+) ")
# The NIXL read (issued, posting included -> seen done by the decode's worker), at the end of a received line; "-"
# when the request's read was never posted (a full prefix hit).
READ_MS = re.compile(r"pdctl connector: received request (\S+) .*; read (\d+\.\d+) ms$")
# pdctl's connector, when a read ran past connector.kv_read_timeout_s and was given up (vLLM's failure path:
# kv_load_failure_policy decides), and when a read was not started because the prefill's hold on the blocks
# (its KV lease) was not known to be alive any more.
READ_TIMED_OUT_FORMAT = ("pdctl connector: read timed out: request %s from engine %s at %s:%s in progress for "
                         "%.1f s (connector.kv_read_timeout_s %g); given up, kv_load_failure_policy %s")
READ_TIMED_OUT_MARK = "pdctl connector: read timed out"
LEASE_REFUSED_FORMAT = ("pdctl connector: read refused: request %s from engine %s at %s:%s seen %.1f s ago; the "
                        "prefill's KV lease (%g s) may run out before a read of up to %g s ends; "
                        "kv_load_failure_policy %s")
LEASE_REFUSED_MARK = "pdctl connector: read refused"
# pdctl's connector, when a read in progress was given up because its prefill is gone (pdctl.connector.peers).
PEER_GONE_FORMAT = ("pdctl connector: read given up: request %s from engine %s at %s:%s in progress for %.1f s; the "
                    "prefill is gone (its side channel refuses connections); kv_load_failure_policy %s")
PEER_GONE_MARK = "the prefill is gone"
# pdctl's connector's counters in each server's /metrics (Prometheus adds _total), read back by `pdctl status`.
READS_TIMED_OUT = "vllm:pdctl_kv_reads_timed_out"
READS_REFUSED_LEASE = "vllm:pdctl_kv_reads_refused_lease"
READS_PEER_GONE = "vllm:pdctl_kv_reads_peer_gone"
RECOMPUTED = "vllm:pdctl_kv_recomputed_requests"
FINGERPRINTS_CHECKED = "vllm:pdctl_kv_fingerprints_checked"  # per decode TP rank
FINGERPRINT_MISMATCHES = "vllm:pdctl_kv_fingerprint_mismatches"  # per decode TP rank
# Per TP rank, prefill and decode alike: seconds its worker spent on fingerprints (computing them; checking them).
FINGERPRINT_SECONDS = "vllm:pdctl_kv_fingerprint_seconds"
# pdctl's connector, when the KV a decode received is not what the prefill computed (its load then fails).
FINGERPRINT_MISMATCH_FORMAT = ("pdctl connector: KV fingerprint mismatch: request %s from engine %s at %s:%s, "
                               "decode rank %d: first difference at %s; its KV load fails, kv_load_failure_policy %s")
FINGERPRINT_MISMATCH_MARK = "pdctl connector: KV fingerprint mismatch"
# pdctl's connector, when it refuses a P/D pair (the text after the mark says why, naming both sides).
REFUSED_MARK = "pdctl connector: unsupported"
# pdctl's connector's words when it stops a server (a pair refused, no room for staging, settings it does not
# read): what pdctl.launch.logs picks out of a server's log as the root cause.
CONNECTOR_FAILURE = re.compile(r"pdctl( connector)?: (unsupported|.*cannot |.*refus|.*needs? |settings )",
                               re.IGNORECASE)
# vLLM's decode, when a NIXL transfer failed.
TRANSFER_FAILED_MARK = "NIXL transfer failure"
# vLLM's prefill, when a decode's read arrives after the request's KV lease expired and its blocks were freed (and
# maybe reused): the decode is not told, so the gate reads it from the prefill's log.
LATE_READ = re.compile(r"Potentially invalid KV blocks for unrecognized request (\S+) were retrieved")
