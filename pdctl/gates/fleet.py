"""The parity gate over a fleet: every allowed prefill pool x decode pool pair, pinned with the proxy's pair
header, token for token against the aggregated reference, with proof per pair that the KV travelled and that it
came from that pair's prefill pool.

Pairs run one after another, so the decode pool's own counters (vLLM's prompt tokens by source, NIXL bytes) over
a pair's phase are that pair's. Which prefill the KV came from is in no vLLM metric: pdctl's connector logs one
line per received request, keyed by the request id the gate sent (`pdctl connector: received request ...`).
A last, mixed phase sends prompts pinned round-robin over every pair at once, so transfers of different
block-size ratios overlap on one decode.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from pdctl.gates.parity import ParityReport, Prompt, PromptResult, random_prompts, run_parity, tie_nats
from pdctl.plan import Plan
from pdctl.protocol import LATE_READ, RECEIVED_LINE
from pdctl.topology import ROLES

MIXED_LENGTHS = (65, 129, 200, 300, 97, 515, 700, 33)
# Shorter prompts may be computed by the decode itself (vLLM leaves it the last token): not every one logs a read.
MIN_LOGGED_PROMPT = 32


@dataclass
class PairReport:
    prefill_pool: str
    decode_pool: str
    report: ParityReport
    kv_from: dict[str, int] = field(default_factory=dict)  # prefill instance -> requests whose KV it sent
    problems: list[str] = field(default_factory=list)  # misrouted requests, KV from another pool, no log line

    @property
    def passed(self) -> bool:
        return self.report.passed and not self.problems

    def to_dict(self) -> dict:
        proof = self.report.proof
        return {"prefill_pool": self.prefill_pool, "decode_pool": self.decode_pool,
                "prompts": len(self.report.results), "passed": sum(r.passed for r in self.report.results),
                "ok": self.passed, "tokens_by_transfer": proof.external_kv_tokens if proof else 0,
                "tokens_computed": proof.local_compute_tokens if proof else 0,
                "bytes_transferred": proof.bytes_transferred if proof else 0,
                "fingerprints_checked": proof.fingerprints_checked if proof else 0,
                "kv_travelled": bool(proof and proof.ok), "kv_proof": proof.message if proof else "no proof",
                "kv_from": self.kv_from, "problems": self.problems}


@dataclass
class FleetReport:
    pairs: list[PairReport]
    mixed: PairReport | None = None
    logs_checked: bool = False

    @property
    def passed(self) -> bool:
        return bool(self.pairs) and all(p.passed for p in self.pairs) and (self.mixed is None or self.mixed.passed)

    @property
    def results(self) -> list[PromptResult]:
        return [r for p in self.all() for r in p.report.results]

    @property
    def pass_rate(self) -> float:
        return sum(r.passed for r in self.results) / max(1, len(self.results))

    def all(self) -> list[PairReport]:
        return self.pairs + ([self.mixed] if self.mixed else [])

    def to_dict(self) -> dict:
        return {"passed": self.passed, "pass_rate": self.pass_rate, "logs_checked": self.logs_checked,
                "pairs": [p.to_dict() for p in self.pairs], "mixed": self.mixed.to_dict() if self.mixed else None,
                "results": [{"pair": f"{p.prefill_pool}/{p.decode_pool}", **r.to_dict()}
                            for p in self.all() for r in p.report.results]}


def _gate_lines(log_paths: dict[str, str], pattern: re.Pattern):
    """(log's key, match, the gate's request id) for each line of these logs that `pattern` matches (its group 1
    holds vLLM's request id) and that names a request the gate sent; unreadable logs are skipped."""
    for key, path in log_paths.items():
        try:
            text = Path(path).read_text(errors="replace")
        except OSError:
            continue
        for m in pattern.finditer(text):
            if rid := re.search(r"pdctl-check-[0-9a-f]{16}", m.group(1)):
                yield key, m, rid.group(0)


def received_from(log_paths: list[str]) -> dict[str, list[tuple[str, int]]]:
    """Request id (as the gate sent it, inside vLLM's own id) -> the prefill side channels its KV came from."""
    out: dict[str, list[tuple[str, int]]] = {}
    for _, m, rid in _gate_lines({p: p for p in log_paths}, RECEIVED_LINE):
        out.setdefault(rid, []).append((m.group(2), int(m.group(3))))
    return out


def late_reads(log_paths: dict[str, str]) -> dict[str, str]:
    """Request id (as the gate sent it) -> the prefill instance whose log says a decode read that request's KV
    after the prefill had released it (log_paths: instance name -> its log)."""
    return {rid: name for name, _, rid in _gate_lines(log_paths, LATE_READ)}


def attribute(pair: PairReport, plan: Plan, received: dict[str, list[tuple[str, int]]], pools: dict[str, str],
              late: dict[str, str] | None = None) -> None:
    """Fill kv_from and problems: every request went to the pinned pools, each logged read came from one of the
    pinned prefill pool's instances (pools: instance name -> pool; a mixed phase pins per prompt), and none
    arrived after its prefill had released the KV (late: late_reads)."""
    by_port = {s.ports["side_channel"]: s.name for s in plan.by_role("prefill")}
    for r in pair.report.results:
        if late and r.request_id in late:
            pair.problems.append(f"{r.label}: the decode read its KV after {late[r.request_id]} had released it "
                                 "(vLLM's KV lease expired first): its tokens may be another request's")
        want_p, want_d = _wanted(pair, r)
        if r.prefill and pools.get(r.prefill) != want_p or r.decode and pools.get(r.decode) != want_d:
            pair.problems.append(f"{r.label}: served by {r.prefill} -> {r.decode}, pinned to {want_p}/{want_d}")
        sources = [by_port.get(port, f"{host}:{port}") for host, port in received.get(r.request_id or "", [])]
        for src in sources:
            pair.kv_from[src] = pair.kv_from.get(src, 0) + 1
            if pools.get(src) != want_p:
                pair.problems.append(f"{r.label}: the decode read its KV from {src}, not prefill pool {want_p}")
        fresh = not r.label.startswith("prefix")
        if fresh and r.passed and r.prompt_tokens > MIN_LOGGED_PROMPT and not sources:
            pair.problems.append(f"{r.label}: no connector line says where its KV came from")


def _wanted(pair: PairReport, r: PromptResult) -> tuple[str, str]:
    if pair.prefill_pool != "*":
        return pair.prefill_pool, pair.decode_pool
    return tuple(r.label.split(" ", 1)[0].split("/"))  # mixed phase: "P/D random-65"


PAIR_SEED_STRIDE = 7919


def pair_seed(seed: int | None, k: int) -> int | None:
    """Pool pair k's prompt seed for a run seeded N: one seed for all would send two pairs into one decode the
    same prompts, and the second would find them in that decode's prefix cache (no KV to prove it travelled)."""
    return None if seed is None else seed + PAIR_SEED_STRIDE * k


def mixed_seed(seed: int | None, i: int) -> int | None:
    """The mixed phase's prompt i: seeds below every pair's, so no mixed prompt repeats one a pair sent."""
    return None if seed is None else seed - 1 - i


def check_fleet(plan: Plan, proxy_url: str, reference: str, model: str, prompts_for, max_tokens: int = 16,
                concurrency: int = 1, mixed: int = 16, mixed_concurrency: int = 12, vocab: int = 1000,
                seed: int | None = None, read_logs: bool = True, progress=lambda _: None,
                api_key: str | None = None, stream: bool = False) -> FleetReport:
    """prompts_for(prefill_block, decode_block, k) -> the prompts for pair k (boundaries of both sides; its own
    seed: pair_seed); `api_key`
    goes with every call (auth.api_key_env)."""
    t = plan.topology
    blocks = {(role, g.name): g.block_size for role in ROLES for g in t.pools(role)}
    pairs = [(p.name, d.name) for p, d in t.pairs()]
    decodes = {d.name: [s.http_url for s in plan.by_role("decode") if s.pool == d.name] for d in t.decode}
    report = FleetReport([])
    for k, (p, d) in enumerate(pairs):
        progress(f"pair {p} -> {d}")
        prompts = prompts_for(blocks[("prefill", p)], blocks[("decode", d)], k)
        rep = run_parity(proxy_url, reference, decodes[d], model, prompts, max_tokens, concurrency, f"{p}/{d}",
                         api_key, stream, tie=tie_nats(t.model.dtype))
        report.pairs.append(PairReport(p, d, rep))
    if mixed:
        progress(f"{mixed} prompts over every pair at once, {mixed_concurrency} in flight")
        prompts: list[Prompt] = []
        routes: list[str] = []
        for i, n in enumerate((MIXED_LENGTHS * (mixed // len(MIXED_LENGTHS) + 1))[:mixed]):
            p, d = pairs[i % len(pairs)]
            (prompt,) = random_prompts([n], vocab, mixed_seed(seed, i))
            prompt.label = f"{p}/{d} {prompt.label}"
            prompts.append(prompt)
            routes.append(f"{p}/{d}")
        all_decodes = [u for urls in decodes.values() for u in urls]
        rep = run_parity(proxy_url, reference, all_decodes, model, prompts, max_tokens, mixed_concurrency, routes,
                         api_key, stream, tie=tie_nats(t.model.dtype))
        report.mixed = PairReport("*", "*", rep)
    if read_logs and t.connector.kind == "pdctl":
        received = received_from([s.log_path for s in plan.by_role("decode")])
        late = late_reads({s.name: s.log_path for s in plan.by_role("prefill")})
        pools = {s.name: s.pool for s in plan.processes if s.pool}
        for pair in report.all():
            attribute(pair, plan, received, pools, late)
        report.logs_checked = True
    return report


# vllm-router's request id names the instances it chose: "cmpl-___prefill_addr_H:P___decode_addr_H:P_<uuid>".
ROUTER_ID = re.compile(r"___prefill_addr_(\S+?)___decode_addr_(\S+?)_[0-9a-f]{32}")


@dataclass
class UnpinnedReport(ParityReport):
    """A parity run through a proxy that cannot pin a pool pair (vllm-router): the transfer is proven per decode
    instance, from its own counters, instead of per pair."""

    per_decode: dict[str, dict] = field(default_factory=dict)  # decode instance -> its counters' growth
    problems: list[str] = field(default_factory=list)
    note: str = ("the proxy cannot pin a pool pair: the KV transfer is proven per decode instance (its own "
                 "counters), not per pair")

    @property
    def passed(self) -> bool:
        return super().passed and not self.problems

    def to_dict(self) -> dict:
        return {**super().to_dict(), "passed": self.passed, "pinned": False, "note": self.note,
                "per_decode": self.per_decode, "problems": self.problems}


def per_decode_problems(grown: dict[str, dict[str, float]]) -> list[str]:
    """Every decode instance that computed or received prompt tokens in the run received some by transfer."""
    out = []
    for name, g in grown.items():
        served = g["external"] + g["local"] + g["cache_hit"]
        if served > 0 and g["external"] <= 0:
            out.append(f"{name}: served {served:.0f} prompt tokens, none by KV transfer")
        if g["failed"] > 0:
            out.append(f"{name}: {g['failed']:.0f} NIXL transfers failed")
    return out


def check_unpinned(plan: Plan, proxy_url: str, reference: str, model: str, prompts_for, max_tokens: int = 16,
                   concurrency: int = 1, progress=lambda _: None, stream: bool = False) -> UnpinnedReport:
    """Every pool pair's prompts (prompts_for(prefill_block, decode_block, k)), sent through the proxy unpinned."""
    from pdctl.gates.parity import decode_counters

    t = plan.topology
    prompts = [pr for k, (p, d) in enumerate(t.pairs()) for pr in prompts_for(p.block_size, d.block_size, k)]
    decodes = {s.name: s.http_url for s in plan.by_role("decode")}
    before = {n: decode_counters([u]) for n, u in decodes.items()}
    progress(f"{len(prompts)} prompts for {len(t.pairs())} pool pair(s), unpinned")
    rep = run_parity(proxy_url, reference, list(decodes.values()), model, prompts, max_tokens, concurrency,
                     stream=stream, tie=tie_nats(t.model.dtype))
    grown = {n: {k: v - before[n][k] for k, v in decode_counters([u]).items()} for n, u in decodes.items()}
    by_addr = {s.http_url.removeprefix("http://"): s.name for s in plan.processes}
    for r in rep.results:
        m = ROUTER_ID.search(r.served_id or "")
        if m:
            r.prefill, r.decode = by_addr.get(m.group(1), m.group(1)), by_addr.get(m.group(2), m.group(2))
    for n in decodes:
        grown[n]["requests"] = sum(r.decode == n for r in rep.results)
    return UnpinnedReport(rep.results, rep.proof, grown, per_decode_problems(grown))
