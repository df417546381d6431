"""Where P/D's time to first token goes, and P/D vs aggregated, in one bring-up.

One fleet (configs/cpu-latency.yaml: prefill pools p32/p64 x decode pools d64/d32, connector.trace on) beside an
aggregated reference with vLLM's executor queues calmed (pdctl's plugin, the default) and one as plain vLLM. Per
load mode (one request at a time, then Poisson arrivals at --rate) and repeat, every side gets the same fresh
prompts (vLLM's benchmark machinery, pdctl.bench.load), sides in rotating order: each pinned pair through the proxy,
then the two references. Each P/D run's requests are followed stage by stage (proxy /debug/timings joined with the
decode's timing lines, pdctl.bench.breakdown). Reports: the waterfall per pair and mode (median over repeats of
each stage's p50 and p99), P/D / aggregated ratios of TTFT and TPOT p50 (median of per-repeat ratios, with their
spread), hetero / homogeneous pair with the same decode block, and at --stall-concurrency requests in flight the
p99 gap between tokens. Runs where most streams arrived in one burst (TPOT ~0) are counted and left out of TPOT.

Usage: python scripts/bench_pd_latency.py [--label after] [--repeat 5] [--requests 16] [--rate 6]
       [--pairs p32/d64,p64/d32,p64/d64,p32/d32] [--out results/bench_pd_latency-LABEL.json]
With results/bench_pd_latency-before.json present, an `--label after` run also prints before -> after per stage.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from plain_reference import with_plain_reference  # scripts/plain_reference.py

import pdctl
from pdctl.bench import breakdown, load
from pdctl.bench.run import follow
from pdctl.protocol import FIRST_HEADER, ROUTE_HEADER
from pdctl.topology import resolved_model

REFS = {"aggregated (calmed)": "reference", "aggregated (plain vLLM)": "reference-plain"}


def instance_processes(key: str) -> dict[int, str]:
    """pid -> value of environment variable `key` for every process started with it and every descendant of one.
    Descendants by parentage, not by their own environ: vLLM's engine cores and workers rename themselves
    (setproctitle), which overwrites what /proc/PID/environ shows."""
    parent, own = {}, {}
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            parent[pid] = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if key in env:
            own[pid] = env[key]
    out = {}
    for pid in parent:
        p = pid
        while p > 1 and p not in own:
            p = parent.get(p, 0)
        if p in own:
            out[pid] = own[p]
    return out


def each_thread(pids, fn) -> int:
    """fn(tid) for every thread of these processes (gone ones skipped); the threads done."""
    n = 0
    for pid in pids:
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                fn(int(tid))
                n += 1
        except OSError:
            continue
    return n


def pin_instances() -> int:
    """Every thread of every vLLM server process (API server, engine core, workers; pdctl's servers and the
    references) bound to the cores of its instance's VLLM_CPU_OMP_THREADS_BIND; the threads bound."""
    n = 0
    for pid, cores in instance_processes("VLLM_CPU_OMP_THREADS_BIND").items():
        cpus = {c for part in cores.split("|")[0].split(",") for c in range(int(part.split("-")[0]),
                                                                           int(part.split("-")[-1]) + 1)}
        n += each_thread([pid], lambda tid, cpus=cpus: os.sched_setaffinity(tid, cpus))
    return n


def renice(plan, role: str, nice: int) -> int:
    """Every thread of every process of the plan's `role` instances (API server, engine core, workers; found by
    their NIXL side-channel port) set to `nice`; the threads set."""
    ports = {str(s.ports["side_channel"]) for s in plan.by_role(role)}
    mine = [pid for pid, port in instance_processes("VLLM_NIXL_SIDE_CHANNEL_PORT").items() if port in ports]
    return each_thread(mine, lambda tid: os.setpriority(os.PRIO_PROCESS, tid, nice))


def role_nice(text: str) -> tuple[str, int]:
    """--nice-ab's ROLE=N."""
    role, _, n = text.partition("=")
    try:
        nice = int(n)
    except ValueError:
        nice = None
    if role not in ("prefill", "decode") or nice is None or not -20 <= nice <= 19:
        raise argparse.ArgumentTypeError(f"{text!r}: ROLE=N with ROLE prefill or decode and N a niceness -20..19")
    return role, nice


# The A/B runs (one per run): flag -> the suffixed sides' suffix, their header (None: none), whether the unsuffixed
# side is the variant (the prefill's first token is 'PAIR', the decode's 'PAIR dec1st'), the report's key and what its
# ratio is.
AB = {
    "nice_ab": (" nice", None, False, "nice_vs_plain", "reniced / not"),
    "first_token_ab": (" dec1st", (FIRST_HEADER, "off"), True, "first_token_vs_decode",
                       "prefill's first token / the decode's"),
}


def med(xs):
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def spread(xs):
    xs = [x for x in xs if x == x]
    return [min(xs), max(xs)] if xs else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", default="configs/cpu-latency.yaml")
    ap.add_argument("--set", action="append", default=[], help="topology override, e.g. decode.block_size=128")
    ap.add_argument("--pairs", default="p32/d64,p64/d32,p64/d64,p32/d32", help="pinned PREFILL/DECODE pools")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--requests", type=int, default=16, help="requests per side per run")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals (req/s) for the loaded mode; 0: skip")
    ap.add_argument("--stall-concurrency", type=int, default=16, help="0: skip the stall check")
    ap.add_argument("--no-floor", dest="floor", action="store_false",
                    help="skip the per-request floor (a 4-token prompt through each aggregated reference)")
    ap.add_argument("--first-token-ab", default=None, choices=("on", "auto"),
                    help="each pair run twice per repeat: the prefill's token first (PAIR, header x-pdctl-first-"
                    "token: on|auto) and the decode's (PAIR dec1st, header: off); reports one / the other")
    ap.add_argument("--pin-instances", action="store_true",
                    help="bind every thread of each vLLM server (API server, engine core, worker) to its instance's "
                    "core, not only the model's compute threads: instances then share no core, as on separate hosts")
    ap.add_argument("--nice-ab", default=None, metavar="ROLE=N", type=role_nice,
                    help="each pair run twice per repeat: with every thread of the ROLE (prefill|decode) instances at "
                    "niceness N (PAIR nice) and at 0 (PAIR); reports nice / plain per pair")
    ap.add_argument("--label", default="run")
    ap.add_argument("--out", default=None, help="default results/bench_pd_latency-LABEL.json")
    a = ap.parse_args()
    ab = [flag for flag in AB if getattr(a, flag)]
    if len(ab) > 1:
        ap.error("--nice-ab, --first-token-ab: one A/B per run")
    suffix, ab_header, *_ = AB[ab[0]] if ab else (None, None)
    out = Path(a.out or f"results/bench_pd_latency-{a.label}.json")

    try:
        t = pdctl.load(a.topology, [*a.set, "connector.trace=true"])
    except pdctl.TopologyError as e:
        ap.error(str(e))
    state_dir = Path("/tmp/pdctl-bench-latency")
    port = t.reference.port
    plan = with_plain_reference(pdctl.plan(t, state_dir=state_dir, reference_port=port), port=port + 1)
    pairs = [tuple(p.split("/")) for p in a.pairs.split(",")]
    pools = ({g.name for g in t.prefill}, {g.name for g in t.decode})
    for pair in pairs:  # refused before the servers start, not as failed requests after
        if len(pair) != 2 or pair[0] not in pools[0] or pair[1] not in pools[1]:
            ap.error(f"--pairs: {'/'.join(pair)!r} is not PREFILL/DECODE of {a.topology}'s pools (prefill "
                     f"{', '.join(sorted(pools[0]))}; decode {', '.join(sorted(pools[1]))})")
    sides = [f"{p}->{d}" for p, d in pairs]
    if suffix:  # the same pairs once more: the ordinary way, handed over by the proxy, or reniced
        sides, pairs = sides + [f"{sd}{suffix}" for sd in sides], pairs + pairs
    sides += list(REFS)
    modes = [("c=1", 1, None)] + ([(f"{a.rate:g} req/s", a.requests, a.rate)] if a.rate else [])
    runs: list[dict] = []
    tok = load.load_tokenizer(resolved_model(t, t.decode[0], t.origin.base_dir))
    seen: set = set()  # every prompt sent: none goes twice to a server (its prefix cache would answer)

    def work(n: int, seed: int) -> load.Workload:
        return load.workload(n, a.prompt_len, seed=seed, max_tokens=a.max_tokens, tokenizer=tok, seen=seen)

    with pdctl.up(plan, timeout_s=600) as d:
        if a.pin_instances:
            print(f"pinned {pin_instances()} threads of vLLM servers to their instances' cores", flush=True)
        urls = {s: d.proxy_url for s in sides[: len(pairs)]} | {k: d.plan.get(v).http_url for k, v in REFS.items()}
        seed = int(time.time())
        for mode, conc, rate in modes:
            for rep in range(a.repeat):
                # Fresh prompts per repeat and per pair (pairs share prefill and decode servers); the references
                # (servers of their own) get the first pair's, so that pair and the references see the same prompts.
                seed += 100
                works = {side: work(a.requests, seed + i) for i, side in enumerate(sides[: len(pairs)])}
                works |= dict.fromkeys(REFS, works[sides[0]])
                order = sides[rep % len(sides):] + sides[: rep % len(sides)]
                for side in order:
                    pair = dict(zip(sides, pairs, strict=False)).get(side)
                    headers = {ROUTE_HEADER: f"{pair[0]}/{pair[1]}"} if pair else None
                    if ab_header and side.endswith(suffix):
                        headers[ab_header[0]] = ab_header[1]
                    elif a.first_token_ab and pair:  # the variant: the prefill's token first, asked per request
                        headers[FIRST_HEADER] = a.first_token_ab
                    decodes = [s.http_url for s in d.plan.by_role("decode") if pair and s.pool == pair[1]]
                    if a.nice_ab and pair:
                        renice(d.plan, a.nice_ab[0], a.nice_ab[1] if side.endswith(suffix) else 0)
                    since = time.time()
                    r = load.run_load(side, urls[side], t.model.name, works[side], a.max_tokens, conc, decodes, rate,
                                      seed, headers)
                    row = {"mode": mode, "repeat": rep, "side": side, **r.to_dict()}
                    if pair:
                        f = follow(d.plan, d.proxy_url, since)
                        row["breakdown"], row["followed"] = f["stages"], f["followed"]
                        row["first_token"], row["first_token_stages"] = f["first_token"], f["first_token_stages"]
                    runs.append(row)
                    print(f"{mode:>10} rep {rep} {side:24} TTFT p50 {r.ttft_ms_p50:7.1f} ms  TPOT p50 "
                          f"{r.tpot_ms_p50:6.2f} ms  bunched {r.bunched}/{r.requests}  errors {r.errors}"
                          + (f"  followed {row['followed']}" if pair else "")
                          + (f"  first token from the prefill {row['first_token']}" if row.get("first_token") else ""),
                          flush=True)
        # What one more vLLM request costs on this host whatever pdctl does: a 4-token prompt (its compute is next to
        # nothing) through each aggregated reference, one at a time. P/D makes two requests of each prompt, so its
        # TTFT floor is the aggregated TTFT plus this.
        floor_runs = []
        for rep in range(a.repeat if a.floor else 0):
            for ref in REFS:
                r = load.run_load(f"{ref} floor", urls[ref], t.model.name,
                                  load.workload(a.requests, 4, seed=seed + 500 + rep, max_tokens=a.max_tokens,
                                                tokenizer=tok, seen=seen), a.max_tokens, 1, [], None, seed)
                floor_runs.append({"repeat": rep, "side": ref, "ttft_ms_p50": r.ttft_ms_p50})
                print(f"{'floor':>10} rep {rep} {ref:24} TTFT p50 {r.ttft_ms_p50:7.1f} ms (4-token prompt)", flush=True)
        stall = None
        if a.stall_concurrency:
            p, dd = pairs[0]
            r = load.run_load("stall", d.proxy_url, t.model.name, work(4 * a.stall_concurrency, seed + 99),
                              a.max_tokens * 4, a.stall_concurrency, headers={ROUTE_HEADER: f"{p}/{dd}"})
            stall = {"pair": f"{p}->{dd}", "concurrency": a.stall_concurrency, **r.to_dict()}
            print(f"stall check {p}->{dd} c={a.stall_concurrency}: ITL p50 {r.itl_ms_p50:.2f} ms, p99 "
                  f"{r.itl_ms_p99:.2f} ms, errors {r.errors}")
    report = summarize(runs, sides, pairs, modes)
    for flag, (sfx, _, unsuffixed, key, _) in AB.items():
        report[key] = variant_over_base(runs, sides, modes, sfx, unsuffixed) if flag in ab else []
    report["stall"] = stall
    report["floor"] = floor(floor_runs, report["ratios"])
    print_report(report)
    before = out.with_name("bench_pd_latency-before.json")
    if a.label != "before" and before.exists():
        print_before_after(json.loads(before.read_text())["report"], report)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    panels = {key.replace(" | ", " "): [breakdown.StageStat(**s) for s in st]
              for key, st in report["waterfall"].items()}
    calmed = {r["mode"]: r["aggregated"]["ttft_ms_p50"] for r in report["ratios"] if r["versus"] == next(iter(REFS))}
    breakdown.plot(panels, png, {k: calmed.get(k.split(" ", 1)[1]) for k in panels})
    out.write_text(json.dumps({"command": " ".join(sys.argv), "label": a.label, "report": report, "runs": runs},
                              indent=2))
    print(f"\nwrote {out} and {png}")
    return 0


def summarize(runs: list[dict], sides: list[str], pairs: list[tuple], modes: list) -> dict:
    """Medians over repeats: each stage's p50/p99 per pair and mode; ratios per repeat, then their median."""
    waterfall, ratios, hetero = {}, [], []
    for mode, *_ in modes:
        rs = [r for r in runs if r["mode"] == mode]
        for side, (field, tail) in ((sd, f) for sd in sides[: len(pairs)] for f in (
                ("breakdown", ""), ("first_token_stages", " | first token from the prefill"))):
            mine = [r[field] for r in rs if r["side"] == side and r.get(field)]
            if mine:
                waterfall[f"{side} | {mode}{tail}"] = [
                    {**mine[0][i], "p50_ms": med(m[i]["p50_ms"] for m in mine),
                     "p99_ms": med(m[i]["p99_ms"] for m in mine), "mean_ms": med(m[i]["mean_ms"] for m in mine)}
                    for i in range(len(mine[0]))]
        reps = sorted({r["repeat"] for r in rs})

        def per_rep(side, key, ref, rs=rs, reps=reps):
            out = []
            for k in reps:
                x = next((r for r in rs if r["side"] == side and r["repeat"] == k), None)
                y = next((r for r in rs if r["side"] == ref and r["repeat"] == k), None)
                if not x or not y or not y[key]:
                    continue
                if key.startswith("tpot") and (x["bunched"] > x["requests"] // 2 or y["bunched"] > y["requests"] // 2):
                    continue  # a burst-delivered run's TPOT measures nothing
                out.append(x[key] / y[key])
            return out

        for side in sides[: len(pairs)]:
            for ref in REFS:
                row = {"mode": mode, "pair": side, "versus": ref}
                for key in ("ttft_ms_p50", "tpot_ms_p50"):
                    xs = per_rep(side, key, ref)
                    row[key] = {"ratio": med(xs), "spread": spread(xs), "repeats": len(xs)}
                row["pd"] = {k: med(r[k] for r in rs if r["side"] == side) for k in ("ttft_ms_p50", "tpot_ms_p50")}
                row["aggregated"] = {k: med(r[k] for r in rs if r["side"] == ref)
                                     for k in ("ttft_ms_p50", "tpot_ms_p50")}
                row["bunched_runs"] = sum(r["bunched"] > r["requests"] // 2 for r in rs if r["side"] in (side, ref))
                ratios.append(row)
        by_pool = {s: p for s, p in zip(sides, pairs, strict=False)}
        for side, (_, dpool) in by_pool.items():
            variant = side.partition(" ")[2]  # 'seq', 'nice': compared with the homogeneous pair's same variant
            homog = next((s for s, (pp, dd) in by_pool.items()
                          if dd == dpool and pp[1:] == dd[1:] and s.partition(" ")[2] == variant), None)
            if homog and homog != side:
                row = {"mode": mode, "pair": side, "versus": homog}
                for key in ("ttft_ms_p50", "tpot_ms_p50"):
                    xs = per_rep(side, key, homog)
                    row[key] = {"ratio": med(xs), "spread": spread(xs), "repeats": len(xs)}
                hetero.append(row)
    return {"waterfall": waterfall, "ratios": ratios, "hetero": hetero}


def variant_over_base(runs: list[dict], sides: list[str], modes: list, suffix: str,
                      base_suffixed: bool = False) -> list[dict]:
    """Per pair and mode, per repeat of one run: the variant's TTFT and TPOT p50 over the base's. The sides
    'PAIR' and 'PAIR{suffix}'; the suffixed one is the variant (or the base, with base_suffixed: the prefill's
    first token is 'PAIR', the decode's 'PAIR dec1st')."""
    out = []
    for mode, *_ in modes:
        for side in [sd for sd in sides if f"{sd}{suffix}" in sides]:
            row = {"mode": mode, "pair": side}
            var, base = (side, f"{side}{suffix}") if base_suffixed else (f"{side}{suffix}", side)
            for key in ("ttft_ms_p50", "tpot_ms_p50", "itl_ms_p99"):
                xs = []
                for r in runs:
                    if r["mode"] == mode and r["side"] == var:
                        o = next((q for q in runs if q["mode"] == mode and q["side"] == base
                                  and q["repeat"] == r["repeat"]), None)
                        if o and o[key] and not (key.startswith("tpot") and (r["bunched"] > r["requests"] // 2
                                                                               or o["bunched"] > o["requests"] // 2)):
                            xs.append(r[key] / o[key])
                row[key] = {"ratio": med(xs), "spread": spread(xs), "repeats": len(xs)}
            out.append(row)
    return out


def floor(floor_runs: list[dict], ratios: list[dict]) -> list[dict]:
    """Per pair at c=1: P/D TTFT against the aggregated TTFT plus one minimal vLLM request on the same server."""
    out = []
    for r in ratios:
        minimal = med(f["ttft_ms_p50"] for f in floor_runs if f["side"] == r["versus"])
        if r["mode"] != "c=1" or minimal != minimal:
            continue
        bound = r["aggregated"]["ttft_ms_p50"] + minimal
        out.append({"pair": r["pair"], "versus": r["versus"], "minimal_request_ttft_ms_p50": minimal,
                    "floor_ttft_ms": bound, "pd_ttft_ms_p50": r["pd"]["ttft_ms_p50"],
                    "pd_over_floor": r["pd"]["ttft_ms_p50"] / bound,
                    "floor_over_aggregated": bound / r["aggregated"]["ttft_ms_p50"]})
    return out


def sp(s) -> str:
    return f"{s[0]:.2f}-{s[1]:.2f}" if s else "-"


def print_report(rep: dict) -> None:
    for key, stats in rep["waterfall"].items():
        print("\n" + breakdown.table([breakdown.StageStat(**s) for s in stats], key))
    print(f"\n{'mode':>10} {'pair':9} {'versus':24} {'TTFT P/D':>9} {'agg':>7} {'ratio':>6} {'spread':>13}"
          f" {'TPOT P/D':>9} {'agg':>6} {'ratio':>6} {'spread':>11}")
    for r in rep["ratios"]:
        t, p = r["ttft_ms_p50"], r["tpot_ms_p50"]
        print(f"{r['mode']:>10} {r['pair']:9} {r['versus']:24} {r['pd']['ttft_ms_p50']:9.1f} "
              f"{r['aggregated']['ttft_ms_p50']:7.1f} {t['ratio']:6.2f} {sp(t['spread']):>13} "
              f"{r['pd']['tpot_ms_p50']:9.2f} {r['aggregated']['tpot_ms_p50']:6.2f} {p['ratio']:6.2f} "
              f"{sp(p['spread']):>11}")
    for r in rep.get("floor") or []:
        print(f"       c=1 {r['pair']:9} {r['versus']:24} floor = aggregated TTFT + a 4-token request "
              f"({r['minimal_request_ttft_ms_p50']:.1f} ms) = {r['floor_ttft_ms']:.1f} ms "
              f"({r['floor_over_aggregated']:.2f}x aggregated); P/D {r['pd_ttft_ms_p50']:.1f} ms = "
              f"{r['pd_over_floor']:.2f}x floor")
    for _, _, _, key, what in AB.values():
        for r in rep.get(key) or []:
            t, p = r["ttft_ms_p50"], r["tpot_ms_p50"]
            print(f"{r['mode']:>10} {r['pair']}: {what}: TTFT x{t['ratio']:.3f} ({sp(t['spread'])}), "
                  f"TPOT x{p['ratio']:.3f} ({sp(p['spread'])}), ITL p99 x{r['itl_ms_p99']['ratio']:.3f}, "
                  f"{t['repeats']} repeats")
    for r in rep["hetero"]:
        print(f"{r['mode']:>10} hetero {r['pair']} / homogeneous {r['versus']}: TTFT x{r['ttft_ms_p50']['ratio']:.3f}"
              f", TPOT x{r['tpot_ms_p50']['ratio']:.3f}")


def print_before_after(before: dict, after: dict) -> None:
    print("\nbefore -> after (stage p50 ms, median over repeats)")
    for key, stats in after["waterfall"].items():
        old = {s["name"]: s for s in before["waterfall"].get(key, [])}
        print(f"  {key}")
        for s in stats:
            o = old.get(s["name"])
            print(f"    {s['name']:14} {o['p50_ms'] if o else float('nan'):8.2f} -> {s['p50_ms']:8.2f}")


if __name__ == "__main__":
    sys.exit(main())
