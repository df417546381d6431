"""Where a P/D request's time to first token goes: the proxy's own timestamps (GET /debug/timings) joined with
the decode connector's timing lines (connector.trace), stage by stage.

Every stamp is wall-clock time (time.time()) taken in a different process: on one host they share the clock;
across hosts the stages that cross machines carry the clocks' offset. Pure: parsing, joining and statistics;
the caller fetches the proxy's records and reads the decode logs.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from pdctl.protocol import TRACE_LINE


@dataclass(frozen=True)
class Stage:
    name: str
    start: str  # stamp names: the proxy's (recv, prefill_sent, ...) or the connector's (sched_seen, ...)
    end: str
    what: str


# In request order; consecutive, so their sum is the proxy's receive -> first byte to the client (TTFT).
STAGES: tuple[Stage, ...] = (
    Stage("proxy in", "recv", "prefill_sent", "proxy: request read, prefill chosen and sent"),
    Stage("prefill", "prefill_sent", "prefill_done", "prefill server: its API, the prompt's compute, its answer"),
    Stage("proxy hop", "prefill_done", "decode_sent", "proxy: prefill answer parsed, decode request sent"),
    Stage("decode API", "decode_sent", "sched_seen", "decode API server and engine input until its scheduler "
          "sees the request"),
    Stage("blocks", "sched_seen", "sched_alloc", "decode scheduler: until it gives the request blocks"),
    Stage("read issue", "sched_alloc", "read_issued", "scheduler output to the worker, NIXL read issued"),
    Stage("read post", "read_issued", "read_posted", "vLLM's read plan (descriptors) and NIXL's post of the read"),
    Stage("KV read", "read_posted", "read_done", "NIXL read, until the worker's poll sees it done"),
    Stage("convert", "read_done", "converted", "post-receive layout conversion (merge / split / zero)"),
    Stage("KV ready", "converted", "sched_kv_ready", "worker result back to the scheduler"),
    Stage("to compute", "sched_kv_ready", "sched_first", "until the scheduler schedules the step that computes "
          "the first token"),
    Stage("first token", "sched_first", "decode_first", "that step (one token over the received KV), its "
          "output through the decode's API server (detokenized, streamed)"),
    Stage("proxy out", "decode_first", "client_first", "proxy: first event written to the client"),
)
TOTAL = Stage("TTFT (proxy)", "recv", "client_first", "proxy receive -> first byte to the client")
# first_token: the client's first token is the prefill's; the decode's stages lead to its second token.
FIRST_STAGES: tuple[Stage, ...] = (*STAGES[:2], Stage("token out", "prefill_done", "client_first", "proxy: the "
                                                      "prefill's token written to the client (first_token)"))


def connector_stamps(lines: Iterable[str]) -> dict[str, dict[str, float]]:
    """vLLM request id -> {stage: time} from a decode's log; the first stamp of a stage wins."""
    out: dict[str, dict[str, float]] = {}
    for line in lines:
        m = TRACE_LINE.search(line)
        if m:
            out.setdefault(m.group(2), {}).setdefault(m.group(1), float(m.group(3)))
    return out


def join(proxy_records: Iterable[dict], stamps: dict[str, dict[str, float]]) -> list[dict[str, float]]:
    """Each proxied P/D request's stamps, the proxy's and its decode's together. vLLM's request id holds the
    proxy's X-Request-Id (e.g. cmpl-<id>-0-<suffix>); requests without every stamp are left out (a fallback,
    an error, a read that failed)."""
    records = {r["id"]: r for r in proxy_records if r.get("id") and r.get("status") == 200 and not r.get("fallback")
               and r.get("first") != "prefill"}  # their first token did not come through the decode: first_token()
    found: dict[str, list[dict[str, float]]] = {}
    for vid, s in stamps.items():
        parts = vid.split("-")  # the proxy's id is some run of vLLM's id's dash-separated parts
        for rid in {"-".join(parts[i:j]) for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)}:
            if rid in records:
                found.setdefault(rid, []).append(s)
    out = []
    for rid, rec in records.items():
        theirs = found.get(rid, [])
        if len(theirs) != 1:  # none, or several (n > 1 completions): not one P/D read to follow
            continue
        merged = {k: v for k, v in rec.items() if isinstance(v, float)} | theirs[0]
        if all(s.start in merged and s.end in merged for s in STAGES):
            out.append(merged)
    return out


def first_token(proxy_records: Iterable[dict]) -> list[dict[str, float]]:
    """The proxy's stamps of the requests whose first token was the prefill's (first_token): FIRST_STAGES."""
    return [{k: v for k, v in r.items() if isinstance(v, float)} for r in proxy_records
            if r.get("status") == 200 and r.get("first") == "prefill"
            and all(isinstance(r.get(s.start), float) and isinstance(r.get(s.end), float) for s in FIRST_STAGES)]


def quantile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(p) - 1]


@dataclass
class StageStat:
    name: str
    what: str
    p50_ms: float
    p99_ms: float
    mean_ms: float

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(timelines: list[dict[str, float]], stages: tuple[Stage, ...] = STAGES) -> list[StageStat]:
    """p50/p99/mean per stage (ms), then the total; empty when no request had every stamp."""
    if not timelines:
        return []
    out = []
    for s in (*stages, TOTAL):
        ms = [1e3 * (t[s.end] - t[s.start]) for t in timelines]
        out.append(StageStat(s.name, s.what, quantile(ms, 50), quantile(ms, 99), statistics.fmean(ms)))
    return out


def table(stats: list[StageStat], title: str = "") -> str:
    """A text waterfall: each stage's p50 / p99 and a bar placed where it starts (by the p50s)."""
    if not stats:
        return f"{title}: no request carried every stamp (is connector.trace on?)" if title else ""
    # Stage p50s need not add up to the total's p50: scale by the larger so every bar fits.
    total = max(stats[-1].p50_ms, sum(max(s.p50_ms, 0.0) for s in stats[:-1])) or 1.0
    width = 30
    lines = [title] if title else []
    lines.append(f"{'stage':14} {'p50 ms':>8} {'p99 ms':>8}  {'':{width}}")
    at = 0.0
    for s in stats[:-1]:
        start = min(width - 1, int(width * at / total))
        n = max(1, round(width * max(s.p50_ms, 0.0) / total))
        lines.append(f"{s.name:14} {s.p50_ms:8.2f} {s.p99_ms:8.2f}  {' ' * start}{'#' * min(n, width - start)}")
        at += max(s.p50_ms, 0.0)
    t = stats[-1]
    lines.append(f"{t.name:14} {t.p50_ms:8.2f} {t.p99_ms:8.2f}  (sum of stage p50s {at:.2f})")
    return "\n".join(lines)


def plot(panels: dict[str, list[StageStat]], path, references: dict[str, float] | None = None) -> None:
    """A waterfall PNG: one row per panel (e.g. pair and load), stages stacked by p50; `references`: per panel, an
    aggregated server's TTFT p50 in the same run, drawn as a mark on that row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(s.name for s in (*STAGES, *FIRST_STAGES)))
    colors = plt.get_cmap("tab20").colors
    fig, ax = plt.subplots(figsize=(11, 0.7 * len(panels) + 2))
    labelled: set[str] = set()
    for row, stats in enumerate(panels.values()):
        left = 0.0
        for s in stats[:-1]:  # the stages; the last is the total
            w = max(s.p50_ms, 0.0)
            i = names.index(s.name) if s.name in names else len(names)
            ax.barh(row, w, left=left, color=colors[i % len(colors)], label=None if s.name in labelled else s.name)
            labelled.add(s.name)
            left += w
        if stats:
            ax.text(left, row, f" {stats[-1].p50_ms:.1f} ms (p50 TTFT)", va="center", fontsize=8)
        ref = (references or {}).get(list(panels)[row])
        if ref:
            ax.plot([ref, ref], [row - 0.45, row + 0.45], color="black", linestyle="--", linewidth=1,
                    label="aggregated TTFT p50" if row == 0 else None)
    ax.set_yticks(range(len(panels)), list(panels))
    ax.invert_yaxis()
    ax.set_xlabel("ms from the proxy receiving the request (stage p50s, stacked)")
    ax.legend(ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
