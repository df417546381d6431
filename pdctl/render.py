"""How the command line shows pdctl's typed results: rich tables and lines on a console. Nothing else."""

from __future__ import annotations

import contextlib
import enum
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from pdctl.bench import breakdown, host
from pdctl.bench import goodput as goodput_math


class Output(enum.StrEnum):
    """`-o/--output`: what a listing command prints."""

    default = "default"  # the columns that matter, fitting 80 columns
    wide = "wide"  # every column
    json = "json"
    yaml = "yaml"


def fmt(v, spec: str = "", none: str = "-") -> str:
    return none if v is None else format(v, spec)


def plain(out: Console) -> bool:
    """No box drawing and no colour: stdout is not a terminal (a pipe, a file, CI) or NO_COLOR is set."""
    return not out.is_terminal or bool(os.environ.get("NO_COLOR"))


def listing(out: Console, title: str | None, columns: list[str], keep: tuple[str, ...] = ()) -> Table:
    """A table for a listing: no vertical rules (they cost 3 characters a column), header rule only on a
    terminal; a value too long for its column wraps (fold) instead of ending in an ellipsis, and the `keep`
    columns (names, addresses) never wrap: other columns give way first."""
    style = "none" if plain(out) else "bold"
    t = Table(title=title, title_justify="left", box=None if plain(out) else box.SIMPLE_HEAD, pad_edge=False,
              show_edge=False, header_style=style, title_style=style)
    for c in columns:
        t.add_column(c, overflow="fold", no_wrap=c in keep)
    return t


def stdout_console() -> Console:
    """The CLI's stdout. Off a terminal (a pipe, a CI log) tables print at their natural width, like `kubectl get`
    in a pipe: folding them at 80 columns cuts words in half. COLUMNS still sets a width where one is asked for."""
    return Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 100_000)


def boxed(out: Console) -> box.Box | None:
    """A report table's frame: rich's default on a terminal, none off one or with NO_COLOR (CI logs, files)."""
    return None if plain(out) else box.HEAVY_HEAD


def show(out: Console, table: RenderableType, wide: bool = False) -> None:
    """-o wide: every column at its natural width, lines as long as they need (like kubectl's), not folded."""
    if wide:
        out = Console(file=out.file, width=100_000, color_system=out.color_system, highlight=False,
                      force_terminal=out.is_terminal)
    out.print(table)


def machine(data: dict, output: Output) -> None:
    """-o json|yaml: the data on stdout as it is, no console markup."""
    if output is Output.yaml:
        import yaml

        print(yaml.safe_dump(data, sort_keys=False, width=1_000_000), end="")
    else:
        print(json.dumps(data, indent=2))


def plan(out: Console, p, output: Output = Output.default, batch: str | None = None) -> None:
    if output in (Output.json, Output.yaml):
        machine({**p.to_dict(), **({"batch_script": batch} if batch else {})}, output)
        return
    wide = output is Output.wide
    cols = (["instance", "pool", "platform", "block", "TP", "layout", "HTTP", "side channel", "readiness"] if wide
            else ["instance", "block", "TP", "layout", "URL"])
    table = listing(out, f"plan: {p.name} (state {p.state_dir})", cols, keep=("instance", "URL", "HTTP"))
    for s in p.processes:  # in pool order: the plan lists each pool's instances together
        common = [str(s.block_size or "-"), str(s.tp or "-"), s.kv_layout or "-"]
        table.add_row(*([s.name, s.pool or "-", s.platform, *common, f"{s.host}:{s.ports['http']}",
                         str(s.ports.get("side_channel", "-")), s.readiness_url] if wide else
                        [s.name, *common, s.http_url]))
    show(out, table, wide)
    if batch:
        out.print("\nSlurm batch script (pdctl up submits it; the proxy runs here):", highlight=False)
        out.print(batch, highlight=False, markup=False, soft_wrap=True)
    for s in p.processes:
        # A secret (the API key) as the shell reference it is resolved from at spawn: its name, never its value.
        env = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in s.env.items()),
                        *(f'{k}="${v}"' for k, v in s.secret_env.items())])
        out.print(f"\n[bold]{s.name}[/bold]  log: {s.log_path}", highlight=False)
        nice = ["nice", "-n", str(s.nice)] if s.nice else []  # the guard does this at spawn
        out.print(f"{env} {shlex.join([*nice, *s.argv])}", highlight=False, markup=False, soft_wrap=True)


def progress(rows: list) -> Table:
    table = Table(show_header=True, header_style="bold")
    for col in ("instance", "state", "elapsed"):
        table.add_column(col, overflow="fold")
    colors = {"ready": "green", "loading": "yellow", "starting": "cyan"}
    for r in rows:
        table.add_row(r.name, f"[{colors.get(r.phase, 'red')}]{r.phase}[/]", f"{r.elapsed_s:5.1f} s")
    return table


@contextlib.contextmanager
def live_progress(err: Console):
    """An on_progress callback that shows the instances' table, from the first report on (a pre-flight error
    before it is not preceded by an empty table)."""
    live = Live(progress([]), console=err, refresh_per_second=4, transient=False)

    def on_progress(rows: list) -> None:
        if not live.is_started:
            live.start()
        live.update(progress(rows))

    try:
        yield on_progress
    finally:
        started = live.is_started
        live.stop()
        if started and not err.is_terminal:
            err.file.write("\n")  # off a terminal, Live's last frame ends without one (the next line joined it)


def launch_failed(err: Console, e) -> None:
    """The root cause first (pdctl's own error line, else the first exception of the failing process), then
    where the whole log is; a few last lines only when no cause line was found."""
    err.print(f"[red]launch failed:[/red] {e.name}: {e.reason}", highlight=False)
    cause = e.cause
    if cause and cause not in e.reason:
        err.print(f"  cause: {cause}", markup=False, highlight=False)
    elif not cause and e.log_tail:
        last = e.log_tail[-8:]
        err.print(f"--- last {len(last)} lines of {e.log_path}:", highlight=False)
        err.print("\n".join(last), markup=False, highlight=False)
    err.print((f"log: {e.log_path}\n" if e.log_path else "") + "every process was stopped", highlight=False)


def down(out: Console, r) -> None:
    if r.supervisor:
        out.print(f"stopped the {r.supervisor} supervisor", highlight=False)
    if r.by_foreground_up:
        out.print("its `pdctl up` stopped every process", highlight=False)
        return
    if r.nothing:
        out.print(f"nothing to stop: {r.nothing}", highlight=False)
        return
    for n in r.stopped:
        out.print(f"stopped {n}" + (" (SIGKILL after the grace period)" if n in r.killed else ""))
    for n in r.already_gone:
        out.print(f"{n} was already gone (stale state)", highlight=False)
    out.print(f"{r.name} is down", highlight=False)


def status_view(out: Console, s, output: Output = Output.default) -> RenderableType:
    """The status listing: default = instance, pool, host:port, block, TP, health, restarts, KV %; wide adds where,
    pid, side channel, uptime and the requests running/waiting. Then the supervisor and how instances ended."""
    wide = output is Output.wide
    cols = ["instance", "pool", "host:port", "block", "TP", "health", "restarts", "KV"]
    if wide:
        cols[3:3] = ["where", "pid", "side ch."]
        cols += ["uptime", "run", "wait"]
    table = listing(out, f"{s.name} ({s.state_dir})", cols, keep=("instance", "host:port"))
    color = not plain(out)
    for r in s.instances:
        health = "ok" if r.healthy else ("running" if r.running else "down")
        if r.phase in ("starting", "backoff", "failed", "exited") and not r.healthy:
            health += f" ({r.phase})"
        if color:
            health = f"[{'green' if r.healthy else 'yellow' if r.running else 'red'}]{health}[/]"
        kv = fmt(r.kv_usage and 100 * r.kv_usage, ".1f") + ("%" if r.kv_usage is not None else "")
        row = [r.name, r.pool or "-", f"{r.host}:{r.http_port}", fmt(r.block_size), fmt(r.tp), health,
               str(r.restarts), kv]
        if wide:
            row[3:3] = [r.where, fmt(r.pid), fmt(r.side_channel_port)]
            row += [fmt(r.uptime_s, ".0f") + ("s" if r.uptime_s else ""), fmt(r.requests_running, ".0f"),
                    fmt(r.requests_waiting, ".0f")]
        table.add_row(*row)
    sup = s.supervisor
    lines = [f"supervisor: {sup['mode']} pid {sup['pid']}" if sup else
             "supervisor: none (nothing restarts failed instances)"]
    if s.prometheus:
        lines.append(f"monitoring: Prometheus {s.prometheus}")
    if s.probes:
        slowest = max(s.probes, key=s.probes.get)
        lines.append(f"pairs probed at start: {len(s.probes)}, slowest first read {s.probes[slowest] * 1e3:.1f} ms "
                     f"({slowest})")
    trouble = [(r.name, r.kv_reads_timed_out, r.kv_reads_peer_gone, r.kv_reads_refused, r.kv_recomputed)
               for r in s.instances if any((r.kv_reads_timed_out, r.kv_reads_peer_gone, r.kv_reads_refused,
                                            r.kv_recomputed))]
    lines += [f"{n}: KV reads timed out {fmt(t, '.0f')}, given up (prefill gone) {fmt(g, '.0f')}, refused (lease) "
              f"{fmt(f, '.0f')}, requests recomputed {fmt(c, '.0f')}" for n, t, g, f, c in trouble]
    lines += [f"{r.name}: received KV not the prefill's (fingerprint mismatches) {r.kv_fingerprint_mismatches:.0f}"
              for r in s.instances if r.kv_fingerprint_mismatches]
    lines += [f"{r.name}: last exit: {r.last_exit or '-'}" + (f"; last error: {r.last_error}" if r.last_error else "")
              for r in s.instances if r.last_exit or r.last_error]
    return Group(table, *(Text(line) for line in lines))


def status(out: Console, s, output: Output = Output.default) -> None:
    if output in (Output.json, Output.yaml):
        machine(s.to_dict(), output)
    else:
        show(out, status_view(out, s, output), output is Output.wide)


def watch(out: Console, view: Callable[[], RenderableType], interval_s: float) -> None:
    """Redraw `view()` every interval until Ctrl-C. On a terminal the view is redrawn in place; piped, each
    refresh is printed after the last one (a log of snapshots), stamped with the time."""

    def stamped() -> RenderableType:
        return Group(Text(f"every {interval_s:g} s, {time.strftime('%H:%M:%S')} (Ctrl-C to leave)"), view())

    try:
        if not out.is_terminal:
            while True:
                out.print(stamped())
                out.print()
                out.file.flush()
                time.sleep(interval_s)
        with Live(stamped(), console=out, auto_refresh=False, screen=False) as live:
            while True:
                time.sleep(interval_s)
                live.update(stamped(), refresh=True)
    except KeyboardInterrupt:
        pass


def parity(out: Console, report) -> None:
    table = Table(box=boxed(out), title="parity: P/D vs aggregated reference (greedy, token ids)")
    for col in ("prompt", "tokens", "result", "first divergence"):
        table.add_column(col, overflow="fold")
    for r in report.results:
        table.add_row(r.label, str(r.prompt_tokens), "[red]FAIL[/]" if not r.passed else
                      "[yellow]pass (near tie)[/]" if r.divergence else "[green]pass[/]",
                      r.outcome.removeprefix("first divergent token ") or "-")
    out.print(table)
    p = report.proof
    if p:
        verdict = "[green]KV travelled[/]" if p.ok else "[red]KV did NOT travel[/]"
        checked = ""
        if p.fingerprints_checked or p.fingerprint_mismatches:
            checked = (f"; KV fingerprints checked {p.fingerprints_checked:.0f}, " +
                       (f"[red]{p.fingerprint_mismatches:.0f} NOT the prefill's KV[/]" if p.fingerprint_mismatches
                        else "all equal"))
        out.print(f"{verdict}: decode prompt tokens by transfer {p.external_kv_tokens:.0f}, computed locally "
                  f"{p.local_compute_tokens:.0f} (fresh prompt tokens {p.prompt_tokens}), NIXL bytes "
                  f"{p.bytes_transferred:.0f}{checked}", highlight=False)
    out.print(f"pass rate {100 * report.pass_rate:.1f}% -> " + ("[green]PASS[/]" if report.passed else "[red]FAIL[/]"))


def fleet(out: Console, report) -> None:
    table = Table(box=boxed(out), title="parity per pool pair: P/D vs aggregated reference (greedy, token ids)")
    for col in ("prefill", "decode", "prompts", "passed", "by transfer", "computed", "KV from", "result"):
        table.add_column(col, overflow="fold")
    for pair in report.all():
        d = pair.to_dict()
        name = ("all pairs", "at once") if pair.prefill_pool == "*" else (pair.prefill_pool, pair.decode_pool)
        table.add_row(*name, str(d["prompts"]), str(d["passed"]), f"{d['tokens_by_transfer']:.0f}",
                      f"{d['tokens_computed']:.0f}", ", ".join(f"{k} x{v}" for k, v in d["kv_from"].items()) or "-",
                      "[green]pass[/]" if pair.passed else "[red]FAIL[/]")
    out.print(table)
    for pair in report.all():
        for r in pair.report.results:
            if r.first_divergence is not None:
                verdict = "[red]FAIL[/]" if not r.passed else "[yellow]pass[/]"
                out.print(f"{verdict} {pair.prefill_pool}/{pair.decode_pool} {r.label}: {r.outcome}",
                          highlight=False)
        for problem in pair.problems:
            out.print(f"[red]FAIL[/] {pair.prefill_pool}/{pair.decode_pool} {problem}", highlight=False)
    if not report.logs_checked:
        out.print("the decodes' logs were not read (stock connector): where each KV came from is not proven",
                  highlight=False)
    out.print(f"pass rate {100 * report.pass_rate:.1f}% -> " + ("[green]PASS[/]" if report.passed else "[red]FAIL[/]"))


def check(out: Console, report) -> None:
    """A parity or fleet report, then why a transfer proof failed (the first reason, per pair for a fleet)."""
    (fleet if hasattr(report, "pairs") else parity)(out, report)
    for pair in getattr(report, "all", lambda: [report])():
        rep = getattr(pair, "report", pair)
        name = f"{pair.prefill_pool}/{pair.decode_pool} " if hasattr(pair, "prefill_pool") else ""
        if rep.proof is not None and not rep.proof.ok:
            out.print(f"[red]FAIL[/] {name}{rep.proof.message}", highlight=False)
    if hasattr(report, "per_decode"):  # through vllm-router: proven per decode instance
        out.print(f"note: {report.note}", highlight=False, markup=False)
        for n, g in report.per_decode.items():
            out.print(f"  {n}: {g['requests']:.0f} requests, {g['external']:.0f} prompt tokens by transfer, "
                      f"{g['local']:.0f} computed, NIXL bytes {g['bytes']:.0f}", highlight=False, markup=False)
        for problem in report.problems:
            out.print(f"[red]FAIL[/] {problem}", highlight=False)


def accuracy(out: Console, err: Console, summary: dict, expected_file: str | Path | None) -> None:
    """The table vLLM PR #26759 reported its results in, plus the expected values and verdicts (expected_file:
    the table judged by; None: pdctl's own)."""
    from pdctl.gates.accuracy import table_name

    expected_file = table_name(expected_file)
    task, shots = summary["task"], summary["num_fewshot"]
    t = Table(box=boxed(out), title=f"{summary['model']}: {task} ({shots}-shot, limit {summary['limit']}) via P/D")
    for col in ("Task", "Filter", "n-shot", "Metric", "Value", "Stderr", "Gate", "Expected", "Status"):
        t.add_column(col, overflow="fold")
    for v in summary["verdicts"]:
        metric, _, filt = v["metric"].partition(",")
        gate = v.get("gate", "absolute")
        if v["expected"] is None:
            want = "-"
        elif gate == "relative":  # the aggregated reference's value on the same rows
            want = f"reference {v['expected']:.4f} ± {v['rtol']}"
        else:
            want = f"{v['expected']} ± {v['rtol']}"
        t.add_row(task, filt, str(shots), metric, fmt(v["measured"], ".4f"), fmt(v["stderr"], ".4f"), gate, want,
                  v["status"])
    out.print(t)
    for line in summary.get("gates", []):  # which gate was applied, and how it came out
        out.print(line, highlight=False, markup=False, soft_wrap=True)
    for v in summary["verdicts"]:
        if v["status"] == "FAIL" and v.get("message"):
            out.print(f"FAIL {v['message']}", highlight=False, markup=False, soft_wrap=True)
    if "reference" in summary:
        for d in summary["reference"].get("diverged", [])[:10]:
            out.print(f"  doc {d['doc_id']}: texts differ from character {d['first_diff_char']} of {d['length']}",
                      highlight=False)
    if summary["status"] == "UNGATED":
        err.print(f"warning: no expected accuracy for model '{summary['model']}' in {expected_file}: not gated",
                  style="yellow")


def bench(out: Console, err: Console, s: dict, expected_file: str | Path | None, out_dir: Path) -> None:
    if "accuracy" in s:
        accuracy(out, err, s["accuracy"], expected_file)
    if "perf" in s:
        pd, agg, r = s["perf"]["pd"], s["perf"]["aggregated"], s["perf"]["ratio"]
        t = Table(box=boxed(out),
                  title=f"load ({s['perf'].get('dataset', 'random')} prompts): P/D vs aggregated (ms; p50 / p99)")
        for col in ("", "TTFT", "TPOT", "ITL", "end-to-end", "req/s", "out tok/s", "errors"):
            t.add_column(col, overflow="fold")
        rows = [("P/D", pd), ("aggregated", agg)] + [(f"pair {x['prefill_pool']} -> {x['decode_pool']}", x)
                                                       for x in s["perf"].get("pairs", [])]
        for name, x in rows:
            t.add_row(name, f"{x['ttft_ms_p50']:.1f} / {x['ttft_ms_p99']:.1f}",
                      f"{x['tpot_ms_p50']:.1f} / {x['tpot_ms_p99']:.1f}",
                      f"{x['itl_ms_p50']:.1f} / {x['itl_ms_p99']:.1f}",
                      f"{x['e2e_ms_p50']:.0f} / {x['e2e_ms_p99']:.0f}", f"{x['req_per_s']:.2f}",
                      f"{x['out_tok_per_s']:.1f}", str(x["errors"]))
        t.add_row("P/D / aggregated", f"{r['ttft_ms_p50']:.2f}x", f"{r['tpot_ms_p50']:.2f}x", f"{r['itl_ms_p50']:.2f}x",
                  f"{r['e2e_ms_p50']:.2f}x", f"{r['req_per_s']:.2f}x", f"{r['out_tok_per_s']:.2f}x", "")
        out.print(t)
        if pd.get("kv_bytes") is not None:
            out.print(f"KV transfer (decode metrics): {pd['kv_bytes'] / 2**20:.1f} MiB in "
                      f"{1e3 * (pd['kv_xfer_s'] or 0):.1f} ms of NIXL transfer time", highlight=False)
        if "breakdown" in s["perf"]:
            bd = s["perf"]["breakdown"]
            stats = [breakdown.StageStat(**x) for x in bd["stages"]]
            out.print(breakdown.table(stats, f"where P/D's TTFT goes ({bd['followed']} of {bd['requests']} "
                                             "requests followed; ms)"), highlight=False)
            if bd["unread_logs"]:
                err.print(f"breakdown: could not read the logs of {', '.join(bd['unread_logs'])} on this host")
    if "goodput" in s:
        goodput(out, s["goodput"])
    summary = Table(box=boxed(out), title=f"bench {s['pools']}")
    for col in ("gate", "result", "detail"):
        summary.add_column(col, overflow="fold")
    if "parity" in s:
        pz = s["parity"]
        summary.add_row("parity", pz["status"], f"{100 * pz['pass_rate']:.0f}% of {pz['prompts']} prompts, KV "
                        + ("travelled" if pz["kv_travelled"] else "did NOT travel"))
    if "accuracy" in s:
        a = s["accuracy"]
        measured = {v["metric"]: v["measured"] for v in a["verdicts"]}  # absolute and relative rows: one value
        detail = f"{a.get('gate', 'absolute')} gate: " + ", ".join(f"{m} {fmt(x, '.3f')}" for m, x in
                                                                  measured.items())
        if "reference" in a:
            b = a["reference"]
            detail += f"; agreement {b.get('agreed', round(b['agreement'] * b['samples']))}/{b['samples']}"
        summary.add_row("accuracy", a["status"], detail)
    if "perf" in s:
        r = s["perf"]["ratio"]
        summary.add_row("load", s["perf"]["status"], f"TTFT {r['ttft_ms_p50']:.2f}x, TPOT {r['tpot_ms_p50']:.2f}x "
                        "of aggregated (p50)")
    if "goodput" in s:
        g = s["goodput"]
        summary.add_row("goodput", g["status"].lower(), _goodput_answer(g))
    ready = f"time to ready {s['time_to_ready_s']:.0f} s; " if "time_to_ready_s" in s else ""
    summary.add_row("overall", s["status"], f"{ready}results {out_dir}")
    out.print(summary)


def _goodput_answer(g: dict) -> str:
    """The goodput measurement in one sentence (goodput.answer_line), with P/D's ratio where both sustained a rate."""
    from pdctl.bench import goodput

    a = g.get("answer") or goodput.answer([float(r) for side in ("pd", "baseline")
                                           for r in g[side].get("attainment_median", {})],
                                          g["pd"]["sustained_req_s"], g["baseline"]["sustained_req_s"])
    ratio = g.get("ratio_pd_over_baseline")
    return goodput.answer_line(a) + (f"; P/D {ratio:.2f}x" if ratio and a["kind"] == "compared" else "")


def _load_said(g: dict) -> str:
    """The goodput run's load: SLO, requests per rate, where the rates came from, the workload."""
    per_rate = (f"{g['duration_s']:g} s of arrivals per rate" if g.get("duration_s") is not None
                else f"{g['requests_per_rate']} requests per rate")
    rates = g.get("rates") or {}
    if rates.get("from") == "capacity":
        per_rate += f"; rates from this host's capacity ({rates['capacity']['said']})"
    return f"SLO: {g['slo']['origin']}; {per_rate}, {g['dataset']} {g['prompt_len']}/{g['max_tokens']} tokens"


def _sustained(side: dict) -> str:
    """A side's sustained rate; one that missed even the lowest rate tried sustains less than it, not 0 req/s."""
    x = side["sustained_req_s"]
    tried = [float(r) for r in side.get("attainment_median", {})]
    return f"< {min(tried):g}" if x == 0 and tried else f"{x:g}"


def goodput(out: Console, g: dict) -> None:
    """Per offered rate (medians over the repetitions): the share of requests within the SLOs and goodput for each
    deployment, then their TTFT and TPOT percentiles; the highest rate each sustained at >= 90 %, and where P/D
    starts to pay."""
    sides = ("pd", "baseline")
    rates = sorted({float(r) for side in sides for r in g[side]["attainment_median"]})
    stats = {side: g[side].get("stats_median", {}) for side in sides}
    t = Table(box=boxed(out), title=f"goodput: requests within {g['slo']['origin'].split(':')[0]} SLO "
              f"(TTFT <= {g['slo']['ttft_ms']:g} ms, TPOT <= {g['slo']['tpot_ms']:g} ms), median of {g['repeat']}")
    for col in ("offered req/s", "P/D within SLO", "aggregated within SLO", "P/D goodput req/s",
                "aggregated goodput req/s"):
        t.add_column(col, overflow="fold")
    for r in rates:
        cells = [g[side]["attainment_median"].get(f"{r:g}") for side in sides]
        good = [stats[side].get(f"{r:g}", {}).get("goodput_req_s") for side in sides]
        t.add_row(f"{r:g}", *("-" if c is None else f"{100 * c:.0f}%" for c in cells), *(fmt(x, ".2f") for x in good))
    t.add_row("sustained (>= 90 %)", f"{_sustained(g['pd'])} req/s", f"{_sustained(g['baseline'])} "
              "req/s", "", "")
    out.print(t)
    if any(stats.values()):
        lat = Table(box=boxed(out), title="latency per offered rate (ms, completed requests, median of the runs)")
        for col in ("req/s", "side", "TTFT p50", "p90", "p99", "TPOT p50", "p90", "p99", "steal"):
            lat.add_column(col, overflow="fold")
        for r in rates:
            for side, name in (("pd", "P/D"), ("baseline", "agg")):
                st = stats[side].get(f"{r:g}")
                if st:
                    steal = st.get("cpu_steal")
                    lat.add_row(f"{r:g}", name, *(fmt(st.get(f"ttft_ms_p{q}"), ".0f") for q in (50, 90, 99)),
                                *(fmt(st.get(f"tpot_ms_p{q}"), ".1f") for q in (50, 90, 99)),
                                "-" if steal is None else f"{100 * steal:.0f}%")
        out.print(lat)
    _cores_table(out, g, rates, stats)
    _steal_note(out, g, sides)
    _speed_note(out, g)
    out.print(_goodput_answer(g), highlight=False)
    cross = g.get("crossover") or {}
    if cross.get("winner") == "baseline":
        out.print("the aggregated deployment sustains the higher rate at this SLO and workload: P/D does not pay "
                  "here", highlight=False)
    elif cross.get("from_req_s") is not None:
        out.print(f"P/D pays from {cross['from_req_s']:g} req/s offered: from there up to where both miss the "
                  "target, at least as many of its requests meet the SLOs as the aggregated deployment's",
                  highlight=False)
    elif cross.get("winner") in ("pd", "tie"):
        out.print("P/D meets the SLOs for at least as many requests as the aggregated deployment at every rate where "
                  "either meets the target", highlight=False)
    _beside_note(out, g)
    out.print(_load_said(g), highlight=False)
    if g.get("plots"):
        out.print("plots: " + ", ".join(g["plots"]), highlight=False)


def goodput_sweep(out: Console, g: dict, refused: dict[str, str]) -> None:
    """Each layout's goodput (median sustained rate) at the SLO, the recommended one, and the SLO tightness at
    which the recommendation changes."""
    rec = g["recommendation"]
    t = Table(box=boxed(out), title=f"goodput per layout of the same devices (TTFT <= {g['slo']['ttft_ms']:g} ms, "
              f"TPOT <= {g['slo']['tpot_ms']:g} ms; median of {g['repeat']})")
    for col in ("layout", "sustained req/s", "what runs"):
        t.add_column(col, overflow="fold")
    for name in g["deployments"]:
        mark = " (recommended)" if name == rec["best"] else ""
        down = sum(bool(r.get("failed")) for r in g[name]["runs"])
        said = f" (did not come up {down} of {len(g[name]['runs'])} times)" if down else ""
        t.add_row(name + mark, f"{rec['sustained_req_s'][name]:g}{said}", g["layouts"][name])
    for name, why in refused.items():
        t.add_row(name, "REFUSED", why)
    out.print(t)
    sens = g["slo_sensitivity"]
    s = Table(box=boxed(out), title="the recommendation as the SLOs tighten or loosen (both scaled)")
    for col in ("x SLO", "TTFT ms", "TPOT ms", "best layout", "its req/s"):
        s.add_column(col, overflow="fold")
    for row in sens["rows"]:
        s.add_row(f"{row['factor']:g}", f"{row['ttft_ms']:g}", f"{row['tpot_ms']:g}", row["best"],
                  f"{row['sustained_req_s'][row['best']]:g}")
    out.print(s)
    changes = ", ".join(f"{f:g}x" for f in sens["changes_at"])
    out.print(f"recommended at this SLO: {rec['best']} ({g['layouts'][rec['best']]}); "
              + (f"the answer changes at {changes} the SLO" if changes else "the same answer at every SLO scaling "
                 "tried"), highlight=False)
    _beyond_bound_note(out, g, {name: f"layout {name}:" for name in g["deployments"]})
    _steal_note(out, g, tuple(g["deployments"]))
    _speed_note(out, g)
    out.print(_load_said(g), highlight=False)


def _cores_table(out: Console, g: dict, rates: list[float], stats: dict[str, dict]) -> None:
    """Where the host's cores went at each rate: busy, each role's servers, the proxy, pdctl's load generator, and
    the busiest idle process beside the side under load (both up at once)."""
    if not any(v is not None for side in stats.values() for st in side.values() for k, v in st.items()
               if k.startswith("cores_")):
        return
    cpus = g.get("host_cpus")
    t = Table(box=boxed(out), title="CPU per offered rate (cores" + (f" of {cpus}" if cpus else "")
              + ", median of the runs)")
    for col in ("req/s", "side", "busy", "servers", "proxy", "pdctl", "idle beside"):
        t.add_column(col, overflow="fold")
    for r in rates:
        for side, name in (("pd", "P/D"), ("baseline", "agg")):
            st = stats[side].get(f"{r:g}")
            if st:
                servers = " + ".join(f"{role} {v:.2f}" for role, v in goodput_math.server_cores(st).items())
                t.add_row(f"{r:g}", name, fmt(st.get("cores_busy"), ".2f"), servers or "-",
                          *(fmt(st.get(k), ".2f") for k in ("cores_proxy", "cores_pdctl")),
                          fmt(st.get("cores_idle_max"), ".3f"))
    out.print(t)
    _beyond_bound_note(out, g, {"pd": "P/D's", "baseline": "the aggregated deployment's"})


def _beyond_bound_note(out: Console, g: dict, whose: dict[str, str]) -> None:
    """A role whose servers used more cores than their workers are bound to, at the lowest rate where it did."""
    for side, role, rate, used, bound in goodput_math.beyond_bound_cores(g, tuple(whose)):
        out.print(f"{whose[side]} {role} servers used {used:.2f} cores at {rate:g} req/s, more than the {bound} their "
                  f"workers are bound to: at least {used - bound:.2f} of it (API servers, engine cores) ran on other "
                  "servers' cores" + ("" if role == "baseline" else f" (a layout with more {role} cores may pay)"),
                  highlight=False)


def _beside_note(out: Console, g: dict) -> None:
    """How the two were run: up at once (with the idle CPU that allowed it, before and during the other's load)
    or in turn (and why)."""
    b = g.get("beside") or {}
    n = b.get("repetitions_up_at_once", 0)
    idle = [x for rep in b.get("idle_cores", [])[:n] for x in rep.values()]  # a refusal ends the at-once runs
    if n:
        which = "" if n == g["repeat"] else f" in {n} of {g['repeat']} repetitions"
        during = goodput_math.max_idle_beside(g, ("pd", "baseline"))
        said = "" if during is None else f"; while the other ran its load, at most {during:.3f}"
        out.print(f"both up at once{which}, taking turns rate by rate; idle, the busiest process used "
                  f"{max(idle):.3f} cores (at most {b['idle_cores_max']:g} allowed){said}", highlight=False)
    if b.get("why_not") not in (None, "not asked"):
        out.print(f"{'then each' if n else 'each'} brought up alone in turn: {b['why_not']}", highlight=False)


def _speed_note(out: Console, g: dict) -> None:
    """A host whose speed moved between repetitions (with or without steal) makes them incomparable: say so."""
    speed = g.get("host_speed") or {}
    if (speed.get("ttft_spread") or 0) < goodput_math.SPEED_NOTE:
        return
    ttfts = ", ".join(f"{x['ttft_ms_p50']:.1f}" for x in speed["unloaded"])
    out.print(f"this host's speed moved during the run: one unloaded baseline instance's TTFT p50 was {ttfts} ms at "
              f"the start of each repetition ({speed['ttft_spread']:.2f}x apart; the SLO came from the first): "
              "compare deployments within a repetition, not across", highlight=False)


def _steal_note(out: Console, g: dict, sides: tuple[str, ...]) -> None:
    """A shared VM's neighbours slow every deployment at once; a reader should know when they were busy."""
    worst = goodput_math.max_steal(g, sides)
    if host.worth_saying(worst):
        out.print(f"this host lost up to {worst:.0%} of its CPU time to other guests during a point (CPU steal): "
                  "compare deployments within a repetition, and read the medians", highlight=False)


def sweep(out: Console, result, matrix: Path) -> None:
    if hasattr(result, "refused"):  # sweep --goodput
        return goodput_sweep(out, result.summary, result.refused)
    rows = result.table()
    t = Table(box=boxed(out), title=f"sweep {matrix} ({result.out_dir})")
    for col in (c for c in rows[0] if c != "error"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(*("-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
                    for k, v in r.items() if k != "error"))
    out.print(t)
    out.print("reports: " + ", ".join(str(p) for p in result.reports), highlight=False)
