"""Measurement: bench (the whole job, or goodput) and sweep."""

import json
from pathlib import Path
from typing import Annotated

import typer

from pdctl import api, render
from pdctl.cli.common import (
    AllowUngatedOpt,
    DataDirOpt,
    DatasetOpt,
    ExpectedOpt,
    JsonOpt,
    SkipOpt,
    StateDirOpt,
    TimeoutOpt,
    TopologyArg,
    app,
    err,
    load_topology,
    options_from,
    out,
    say,
    topology_command,
)

SloOpt = Annotated[str, typer.Option(help="--goodput: ttft=MS,tpot=MS, or auto")]
RatesOpt = Annotated[str | None, typer.Option(help="offered req/s: --goodput's rates, e.g. 2,4,8 (default: from "
                                               "this host's capacity); else one open-loop (Poisson) rate")]
RepeatOpt = Annotated[int, typer.Option(help="--goodput: interleaved repetitions (median)")]
DurationOpt = Annotated[float | None, typer.Option(help="--goodput: seconds of arrivals per rate, not --requests")]
B, LOAD, GOODPUT = api.BenchOptions, api.LOAD_DEFAULTS, api.GOODPUT_DEFAULTS  # every default below is theirs
LimitOpt = Annotated[int | None, typer.Option(help="gsm8k rows to evaluate (sweep: per case)")]
ConcurrencyOpt = Annotated[int, typer.Option(help="load benchmark: requests in flight")]
RequestsOpt = Annotated[int | None, typer.Option(help="load: requests per side", show_default=(
    f"{LOAD['requests']}; --goodput: per rate, {GOODPUT['requests']}"))]


@app.command()
@topology_command
def bench(
    topology: TopologyArg,
    skip: SkipOpt = None,
    results: Annotated[Path | None, typer.Option(help="results directory")] = None,
    data_dir: DataDirOpt = None, limit: LimitOpt = B.limit, expected: ExpectedOpt = None,
    allow_ungated: AllowUngatedOpt = False, requests: RequestsOpt = None,
    prompt_len: Annotated[int | None, typer.Option(help="load: prompt tokens", show_default=(
        f"{LOAD['prompt_len']}; --goodput: {GOODPUT['prompt_len']}"))] = None,
    max_tokens: Annotated[int | None, typer.Option(help="load: output tokens", show_default=(
        f"{LOAD['max_tokens']}; --goodput: {GOODPUT['max_tokens']}"))] = None,
    concurrency: ConcurrencyOpt = B.concurrency, dataset: DatasetOpt = "random",
    breakdown: Annotated[bool, typer.Option(help="follow each P/D request stage by stage (connector.trace)")] = False,
    goodput: Annotated[bool, typer.Option(help="goodput under SLOs, P/D vs aggregated on the same devices")] = False,
    slo: SloOpt = "auto", rates: RatesOpt = None, repeat: RepeatOpt = B.repeat, duration: DurationOpt = None,
    alone: Annotated[bool, typer.Option(help="--goodput: bring P/D and the baseline up alone in turn (default: "
                                             "both up at once on this host's CPUs, idle CPU measured)")] = False,
    timeout: TimeoutOpt = B.timeout_s, state_dir: StateDirOpt = None, json_: JsonOpt = False, overrides: list = (),
) -> None:
    """The whole job in one command: up -> parity check -> accuracy gate -> load benchmark -> down.

    Brings the topology up beside an aggregated reference, runs `pdctl check`'s parity gate, `pdctl eval`'s
    accuracy gate (P/D and reference, per-sample agreement), then the same prompts (--dataset) through vLLM's
    serving benchmark against both (TTFT, TPOT, ITL, end-to-end p50/p99, throughput, NIXL transfer time and bytes),
    with P/D / aggregated ratios. Exit 1 if a gate failed; every artefact (resolved topology too) lands in --results.
    --goodput instead measures the highest request rate at which 90 % of requests meet both SLOs, for the topology
    and for aggregated servers on the same devices (docs/benchmarks.md): on this host's CPUs both up at once,
    taking turns rate by rate, once each idle server is measured at <= 0.05 cores (else, or with --alone, in turn).

    The accuracy gate is expected.yaml's for the model. GSM8K: --data-dir, else $GSM8K_DIR, else a cached
    openai/gsm8k, else the hub (none: it stops before anything starts). The topology runs with
    proxy.on_prefill_down=reject and connector.kv_load_failure_policy=fail (unless set): a fallback is not P/D.

    Examples:

      pdctl bench configs/cpu-demo.yaml --decode-block-size 64 --data-dir ../shared/data/gsm8k

      pdctl bench configs/qwen3-0.6b-cuda-d64.yaml --prefill-block-size 16 --decode-block-size 64 --limit 256

      pdctl bench configs/cpu-demo.yaml --skip check,eval --breakdown   # where P/D's TTFT goes

      pdctl bench configs/cpu-demo.yaml --skip check,eval --goodput --slo auto   # does P/D pay here?
    """
    opts = options_from(api.BenchOptions, locals(), timeout_s=timeout, duration_s=duration,
                        skip=api.parse_skip(skip), **api.load_rates(rates, goodput), **api.dataset_option(dataset))
    t = load_topology(topology, overrides, gated=True)
    with err.status("bench ...") as st:
        r = api.bench(t, opts, results=results, say=say, progress=lambda text: st.update(f"{text} ..."))
    if json_:
        print(json.dumps(r.summary, indent=2))
    else:
        render.bench(out, err, r.summary, expected, r.out_dir)
    raise typer.Exit(0 if r.passed else 1)


@app.command()
@topology_command
def sweep(
    topology: TopologyArg,
    matrix: Annotated[Path, typer.Option(help="YAML with `cases:`, each a name and the fields it `set:`s")],
    results: Annotated[Path | None, typer.Option(help="results directory (reuse it to resume)")] = None,
    data_dir: DataDirOpt = None, limit: LimitOpt = B.limit, expected: ExpectedOpt = None,
    requests: RequestsOpt = None, concurrency: ConcurrencyOpt = B.concurrency, dataset: DatasetOpt = "random",
    skip: SkipOpt = None, timeout: TimeoutOpt = B.timeout_s,
    goodput: Annotated[bool, typer.Option(help="cases are layouts of the same devices: goodput per layout")] = False,
    slo: SloOpt = "auto", rates: RatesOpt = None, repeat: RepeatOpt = B.repeat, duration: DurationOpt = None,
    json_: JsonOpt = False, overrides: list = (),
) -> None:
    """`pdctl bench` for every case of a matrix: one table, sweep.json, sweep.md and PNG plots.

    Resumable: a case whose summary.json exists under --results is kept, so rerunning an interrupted sweep with
    the same --results continues where it stopped. A case the topology rules refuse is reported as REFUSED.
    --set and the role flags change the topology under every case; one a case also sets is refused before any runs.

    --goodput: the layout of the topology's devices (each case one) with the highest goodput for the SLO, against
    the baseline, and the SLO at which the answer changes (docs/benchmarks.md).

    Examples:

      pdctl sweep configs/cpu-demo.yaml --matrix configs/cpu-matrix.yaml --data-dir ../shared/data/gsm8k

      pdctl sweep configs/qwen3-0.6b-cuda-d64.yaml --matrix configs/upstream-matrix.yaml --results results/pr26759

      pdctl sweep configs/cpu-demo.yaml --matrix configs/cpu-matrix.yaml --decode-tp 2 --set "decode.devices=[0,1]"

      pdctl sweep configs/cpu-fleet.yaml --matrix configs/cpu-fleet-layout-matrix.yaml --goodput --rates 1,2,3,4,6
    """
    opts = options_from(api.BenchOptions, locals(), timeout_s=timeout, duration_s=duration,
                        skip=api.parse_skip(skip), **api.load_rates(rates, goodput), **api.dataset_option(dataset))
    r = api.sweep(topology, matrix, opts, results=results, say=say, overrides=overrides)
    print(json.dumps(r.to_dict(), indent=2)) if json_ else render.sweep(out, r, matrix)
    raise typer.Exit(0 if r.passed else 1)


# ----------------------------------------------------------------------------------------------------------------
