"""The gates: check (parity) and eval (accuracy)."""

import json
from pathlib import Path
from typing import Annotated

import typer

from pdctl import api, render
from pdctl.api import UserError
from pdctl.cli.common import (
    AllowUngatedOpt,
    DataDirOpt,
    ExpectedOpt,
    JsonOpt,
    StateDirOpt,
    TimeoutOpt,
    app,
    err,
    gate_target,
    options_from,
    out,
    say,
    topology_command,
)


@app.command()
@topology_command
def check(
    topology: Annotated[Path | None, typer.Argument(help="topology to bring up (or --proxy and --reference)")] = None,
    proxy_url: Annotated[str | None, typer.Option("--proxy", help="running P/D proxy URL")] = None,
    reference_url: Annotated[str | None, typer.Option("--reference", help="running aggregated server URL")] = None,
    decode_url: Annotated[list[str] | None, typer.Option("--decode", help="decode URL for the transfer proof "
                                                         "(default: from the proxy's /ready)")] = None,
    model: Annotated[str | None, typer.Option(help="served model name (running systems)")] = None,
    vocab: Annotated[int, typer.Option(help="random prompt token ids are drawn below this")] = 1000,
    max_tokens: Annotated[int, typer.Option(help="tokens generated per prompt")] = 16,
    concurrency: Annotated[int, typer.Option(help="prompts in flight at once")] = 1,
    data_dir: Annotated[Path | None, typer.Option(help="dir with GSM8K test/train.jsonl: adds 5-shot prompts")] = None,
    reference_first: Annotated[bool, typer.Option(help="run the reference alone first and record its answers, "
                                                  "then bring up P/D: for hosts too small for both at once (e.g. "
                                                  "decode TP 2 on 2 cores)")] = False,
    mixed_prompts: Annotated[int, typer.Option(help="fleets: prompts pinned over every pair at once after the "
                                               "per-pair phases (0: none)")] = 16,
    mixed_concurrency: Annotated[int, typer.Option(help="fleets: prompts in flight in the mixed phase")] = 12,
    seed: Annotated[int | None, typer.Option(help="prompt seed (default: fresh every run)")] = None,
    lengths: Annotated[str | None, typer.Option(help="only random prompts of these token lengths, e.g. 65,129,300")]
    = None,
    json_: JsonOpt = False,
    junit: Annotated[Path | None, typer.Option(help="write a JUnit XML report here")] = None,
    stream: Annotated[bool, typer.Option(help="stream every request and compare the text a client reads "
                                         "(asking pdctl's proxy for the prefill's token first)")] = False,
    timeout: TimeoutOpt = api.READY_TIMEOUT_S,
    state_dir: StateDirOpt = None,
    overrides: list = (),
) -> None:
    """Parity gate: P/D output must equal an aggregated reference token for token, and the KV must travel.

    With a TOPOLOGY, brings it up plus an aggregated reference (same model, mode, block size and TP as the
    decode, no connector), checks, and tears everything down. A fleet (several pools per role) is checked per
    prefill pool x decode pool pair: prompts pinned to the pair (x-pdctl-route) around both pools' block
    boundaries, each pair's KV proven from its decode pool's metrics and, with pdctl's connector, from the
    decodes' logs (which prefill each read came from); then prompts over every pair at once.

    Prompts: random tokens at every block boundary of
    both sides, prompts sharing a prefix with earlier ones, and GSM8K 5-shot prompts with --data-dir. The
    decode's /metrics must show the prompts arrived by KV transfer. Exit 1 on any mismatch or missing transfer.

    Examples:

      pdctl check configs/cpu-demo.yaml

      pdctl check configs/cpu-demo.yaml --prefill-block-size 128 --decode-block-size 32   # either direction

      pdctl check configs/cpu-demo.yaml --decode-block-size 128 --junit results/parity.xml

      pdctl check configs/cpu-demo.yaml --decode-tp 2 --set "decode.devices=[0,1]" --reference-first

      pdctl check configs/cpu-demo.yaml --stream   # as a streaming client reads it

      pdctl check --proxy http://127.0.0.1:8000 --reference http://127.0.0.1:8300 --model tiny --json

      pdctl check configs/cpu-fleet.yaml --json     # a fleet: every prefill pool x decode pool pair, pinned

      pdctl check --state-dir .pdctl/cpu-fleet --reference http://127.0.0.1:8300   # a fleet that is up
    """
    try:
        only = [int(n) for n in lengths.split(",")] if lengths else None
    except ValueError:
        raise UserError(f"--lengths {lengths}: expected token counts separated by commas, e.g. 65,129,300") from None
    opts = options_from(api.CheckOptions, locals(), timeout_s=timeout, lengths=only)
    target = gate_target(topology, overrides, state_dir)
    if topology is None:  # the state dir is the running topology's, not one to bring up
        opts.state_dir = None
    with err.status("checking ...") as st:
        report = api.check(target, proxy=proxy_url, reference=reference_url, decodes=decode_url, model=model,
                           options=opts, say=say, progress=lambda text: st.update(f"{text} ..."))
    if json_:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        render.check(out, report)
    raise typer.Exit(0 if report.passed else 1)


@app.command("eval")
@topology_command
def eval_(
    topology: Annotated[Path | None, typer.Argument(help="topology to bring up (or --proxy)")] = None,
    proxy: Annotated[str | None, typer.Option(help="running P/D proxy URL instead of a topology")] = None,
    reference: Annotated[str | None, typer.Option(help="aggregated reference URL to compare with; 'auto' "
                                                  "starts one beside the topology")] = None,
    limit: Annotated[int | None, typer.Option(help="evaluate the first N test rows")] = None,
    num_fewshot: Annotated[int, typer.Option(help="few-shot examples per prompt")] = 5,
    concurrency: Annotated[int, typer.Option(help="requests in flight; above 1, batches differ between the P/D "
                                             "and reference runs and so does float rounding: per-sample "
                                             "agreement is exact only at 1")] = 1,
    data_dir: DataDirOpt = None,
    expected: ExpectedOpt = None, allow_ungated: AllowUngatedOpt = False,
    model: Annotated[str | None, typer.Option(help="served model name (with --proxy)")] = None,
    tokenizer: Annotated[str | None, typer.Option(help="tokenizer path or id (default: the model's path)")] = None,
    min_agreement: Annotated[float | None, typer.Option(help="with a reference: minimum per-sample agreement "
                                                        "(default: expected.yaml's relative gate, else 1.0)")]
    = None,
    tolerance: Annotated[float | None, typer.Option(help="with a reference: maximum |accuracy difference| "
                                                    "(default: expected.yaml's relative gate, else 0.0)")] = None,
    results: Annotated[Path | None, typer.Option(help="results directory")] = None,
    timeout: TimeoutOpt = api.READY_TIMEOUT_S,
    state_dir: StateDirOpt = None,
    json_: JsonOpt = False,
    overrides: list = (),
) -> None:
    """Accuracy gate: lm-eval's gsm8k through the P/D proxy, against an expected-accuracy table (pdctl's own).

    Runs lm-eval's `local-completions` model (tokenized requests off) with gsm8k's strict-match and
    flexible-extract filters. With --data-dir, the dataset is read from local jsonl files (same prompts, few-shot
    source and answer extraction: the task is lm-eval's own gsm8k config); else $GSM8K_DIR, else a cached copy of
    openai/gsm8k, else the hub; with none of them it stops before anything starts.

    The gate is expected.yaml's for the model: absolute (accuracy within rtol of a known value) and/or relative
    (per-sample agreement and accuracy delta against an aggregated reference, for a model whose accuracy says
    nothing, like the random tiny one). --reference URL|auto evaluates an aggregated reference too (any model:
    agreement >= --min-agreement, |delta| <= --tolerance). A model with a relative gate needs a reference: with a
    TOPOLOGY pdctl starts one beside it (as --reference auto); with --proxy, give --reference URL. The topology runs
    with proxy.on_prefill_down=reject and connector.kv_load_failure_policy=fail (unless set on the command line):
    a fallback never counts as P/D. Exit 1 on FAIL, and on UNGATED (a model the table lacks) unless --allow-ungated.

    Examples:

      pdctl eval configs/cpu-demo.yaml --data-dir ../shared/data/gsm8k --limit 20 --reference auto

      pdctl eval configs/cpu-demo.yaml --decode-block-size 64 --data-dir ../shared/data/gsm8k --limit 20

      pdctl eval --proxy http://127.0.0.1:8000 --model Qwen/Qwen3-0.6B --tokenizer Qwen/Qwen3-0.6B
    """
    opts = options_from(api.EvalOptions, locals(), timeout_s=timeout)
    target = gate_target(topology, overrides, state_dir)
    with err.status("evaluating ...") as st:
        r = api.evaluate(target, proxy=proxy, reference=reference, model=model, options=opts, say=say,
                         progress=lambda text: st.update(f"{text} ..."))
    if json_:
        print(json.dumps(r.summary, indent=2))
    else:
        render.accuracy(out, err, r.summary, expected)
        out.print(f"{r.status}  (results: {r.out_dir})", highlight=False)
    raise typer.Exit(0 if r.passed else 1)
