"""The gates: `check` (P/D == aggregated, token for token, the KV proven to have travelled) and `evaluate`
(GSM8K through lm-eval against the expected-accuracy table)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

from pdctl.api.common import Say, UserError, _quiet
from pdctl.api.deploy import (
    Deployment,
    _api_key,
    _brought_up,
    _check_url,
    _local_engine,
    _preflight,
    _running_warning,
    _served_model,
)
from pdctl.api.topology import _gated, load, origin, plan
from pdctl.launch.waits import READY_TIMEOUT_S
from pdctl.plan import Plan
from pdctl.topology import Topology


@dataclass
class CheckOptions:
    max_tokens: int = 16
    concurrency: int = 1
    vocab: int = 1000  # random prompt ids are drawn below this (a loaded model's own vocabulary wins)
    data_dir: Path | None = None  # GSM8K (test/train.jsonl): adds 5-shot prompts
    seed: int | None = None  # fresh prompts every run by default
    lengths: list[int] | None = None  # only random prompts of these token lengths
    mixed_prompts: int = 16  # fleets: prompts pinned over every pair at once after the per-pair phases
    mixed_concurrency: int = 12
    reference_first: bool = False  # the reference alone first, its answers recorded, then P/D
    timeout_s: float = READY_TIMEOUT_S
    junit: Path | None = None  # write a JUnit XML report here
    state_dir: Path | None = None  # where the brought-up topology keeps its state (default .pdctl/<name>)
    stream: bool = False  # streamed requests (the prefill's token first), compared as the text a client reads


def check(target: Topology | Deployment | str | Path | None = None, *, proxy: str | None = None,
          reference: str | None = None, decodes: list[str] | None = None, model: str | None = None,
          options: CheckOptions | None = None, say: Say = _quiet, progress: Say = _quiet):
    """Parity gate: P/D output equals an aggregated reference token for token, and the KV travelled.

    target: a Topology (or its file; brought up beside an aggregated reference, checked, taken down:
    check_topology); a running Deployment (with `reference` URL, or its own reference: check_deployment); or None
    with `proxy` and `reference` URLs (check_urls). A fleet is checked per pool pair. Returns a ParityReport or
    FleetReport (`.passed`, `.to_dict()`)."""
    o = _check_options(options)
    for flag, url in (("--proxy", proxy), ("--reference", reference), *(("--decode", u) for u in decodes or ())):
        _check_url(flag, url)
    if isinstance(target, (str, Path)):
        target = load(target, gated=True)
    if isinstance(target, Topology):
        return check_topology(target, options=o, say=say, progress=progress)
    if isinstance(target, Deployment) and proxy is None:
        return check_deployment(target, reference=reference, model=model, options=o, say=say, progress=progress)
    if target is not None and not isinstance(target, Deployment):
        raise UserError(f"check: cannot check a {type(target).__name__}; give a Topology, a Deployment or URLs")
    if isinstance(target, Deployment) and (o.reference_first or o.state_dir):
        raise UserError("--reference-first and --state-dir are for a topology pdctl brings up, not a running one")
    if not (proxy and reference):
        raise UserError("give a TOPOLOGY, --state-dir of a running one with --reference, or both --proxy and "
                        "--reference for running systems")
    say(_running_warning(target))
    return check_urls(proxy, reference, decodes=decodes, model=model, options=o, progress=progress)


def _check_options(options: CheckOptions | None) -> CheckOptions:
    from pdctl.gates import gsm8k

    o = options or CheckOptions()
    if o.data_dir is not None:
        try:
            gsm8k.check_dir(Path(o.data_dir), "--data-dir ")
        except gsm8k.DataError as e:
            raise UserError(str(e)) from None
    return o


def _prompts(o: CheckOptions, blocks: list[int], vocab: int, max_prompt: int, seed: int | None,
             window: int | None) -> list:
    from pdctl.gates import prompts as prompts_mod

    return prompts_mod.prompts_for(blocks, vocab, max_prompt, o.data_dir, seed, o.lengths, window)


def _pair_prompts(o: CheckOptions, vocab: int, max_prompt: int, window: int | None):
    """A fleet's prompts: pair k draws from its own seed (fleet.pair_seed)."""
    from pdctl.gates import fleet

    return lambda pb, db, k: _prompts(o, [pb, db], vocab, max_prompt, fleet.pair_seed(o.seed, k), window)


def check_urls(proxy: str, reference: str, *, decodes: list[str] | None = None, model: str | None = None,
               options: CheckOptions | None = None, progress: Say = _quiet):
    """The parity gate on running systems known only by their URLs: P/D through `proxy` against the aggregated
    server at `reference`; the KV's travel proven on `decodes` (default: the decodes the proxy's /ready lists)."""
    from pdctl.gates import parity

    o = _check_options(options)
    urls = decodes or [i["url"] for i in _ready_instances(proxy) if i.get("role") == "decode"]
    if not urls:
        raise UserError("no decode URL to prove the transfer with: pass --decode URL")
    name = model or _served_model(reference)
    progress(f"sending prompts through P/D {proxy} and the reference {reference}")
    report = parity.run_parity(proxy, reference, urls, name, _prompts(o, [], o.vocab, 1024, o.seed, None),
                               o.max_tokens, o.concurrency, stream=o.stream)
    return _reported(report, o)


def check_deployment(d: Deployment, *, reference: str | None = None, model: str | None = None,
                     options: CheckOptions | None = None, say: Say = _quiet, progress: Say = _quiet):
    """The parity gate on a running deployment, against `reference` (an aggregated server's URL) or its own."""
    o = _check_options(options)
    if o.reference_first or o.state_dir:
        raise UserError("--reference-first and --state-dir are for a topology pdctl brings up, not a running one")
    ref = reference or d.reference_url
    if not ref:
        raise UserError("a running topology is checked against a running reference: give --reference URL of an "
                        "aggregated server")
    say(_running_warning(d))
    t = d.topology
    key = _api_key(t)
    vocab = (t.origin.model_info.vocab_size if t.origin else None) or o.vocab
    max_prompt = (t.model.max_model_len or 2048) - o.max_tokens - 1
    report = _check_fleet(d.plan, d.proxy_url, ref, model or t.model.name,
                          _pair_prompts(o, vocab, max_prompt, _sliding_window(d)), replace(o, vocab=vocab), progress,
                          key)
    return _reported(report, o)


def check_topology(t: Topology, *, options: CheckOptions | None = None, say: Say = _quiet, progress: Say = _quiet):
    """The parity gate on a topology pdctl brings up beside an aggregated reference, checks and takes down."""
    from pdctl.gates import parity

    o = _check_options(options)
    t = _gated(t, say)
    _local_engine(t)
    key = _api_key(t)  # before anything starts
    vocab = origin(t).model_info.vocab_size or o.vocab
    window = origin(t).model_info.sliding_window
    max_prompt = (t.model.max_model_len or 2048) - o.max_tokens - 1
    p = plan(t, state_dir=o.state_dir, reference_port=t.reference.port)
    ref = p.get("reference")
    if len(t.prefill) > 1 or len(t.decode) > 1 or t.proxy.kind == "vllm-router":
        if o.reference_first:
            raise UserError("--reference-first is for one prefill and one decode pool behind pdctl's proxy; a "
                            "fleet's check pins fresh prompts to every pair while it runs (vllm-router's check "
                            "sends every pair's prompts at once)")
        with _brought_up(p, t, o.timeout_s, progress, f"bringing up {p.name} and an aggregated reference") as d:
            report = _check_fleet(d.plan, d.proxy_url, ref.http_url, t.model.name,
                                  _pair_prompts(o, vocab, max_prompt, window), replace(o, vocab=vocab),
                                  progress, key)
        return _reported(report, o)
    ps = _prompts(o, [t.prefill[0].block_size, t.decode[0].block_size], vocab, max_prompt, o.seed, window)
    answers: str | list = ref.http_url
    if o.reference_first:
        _preflight(p, t)  # the whole plan, before the reference alone starts
        alone, p = p.with_processes([ref]), p.with_processes([s for s in p.processes if s is not ref])
        with _brought_up(alone, t, o.timeout_s, progress, "bringing up the aggregated reference alone"):
            progress(f"recording the reference's answers to {len(ps)} prompts")
            answers = parity.reference_answers(ref.http_url, t.model.name, ps, o.max_tokens, o.concurrency, key,
                                               o.stream)
    beside = "" if o.reference_first else " and an aggregated reference"
    with _brought_up(p, t, o.timeout_s, progress, f"bringing up {p.name}{beside}") as d:
        progress(f"sending {len(ps)} prompts through P/D{'' if o.reference_first else ' and the reference'}")
        report = parity.run_parity(d.proxy_url, answers, [s.http_url for s in d.plan.by_role("decode")],
                                   t.model.name, ps, o.max_tokens, o.concurrency, api_key=key, stream=o.stream,
                                   tie=parity.tie_nats(t.model.dtype))
    return _reported(report, o)


def _sliding_window(d: Deployment) -> int | None:
    """A running topology's model window (a hybrid model's), from the config.json its servers were given."""
    from pdctl.topology import ModelSpec, read_model_info

    if d.topology.origin is not None:
        return d.topology.origin.model_info.sliding_window
    model = next((s.model for s in d.plan.processes if s.model), None)
    return read_model_info(ModelSpec(path=model), Path("/")).sliding_window if model else None


def _ready_instances(proxy_url: str) -> list[dict]:
    from pdctl.launch import probe

    try:
        body = json.loads(probe.http_get(proxy_url.rstrip("/") + "/ready")[1] or "{}")
    except ValueError:
        return []
    got = body.get("instances") if isinstance(body, dict) else None
    return [i for i in got if isinstance(i, dict) and "url" in i] if isinstance(got, list) else []


def _check_fleet(p: Plan, proxy_url: str, reference: str, model: str, prompts_for, o: CheckOptions, progress: Say,
                 api_key: str | None = None):
    from pdctl.gates import fleet

    if p.topology.proxy.kind == "vllm-router":
        progress("checking every pool pair's prompts through vllm-router (it cannot pin a pair: the transfer is "
                 "proven per decode instance)")
        return fleet.check_unpinned(p, proxy_url, reference, model, prompts_for, o.max_tokens, o.concurrency,
                                    progress=lambda text: progress(f"checking {text}"), stream=o.stream)
    progress("checking every pool pair")
    return fleet.check_fleet(p, proxy_url, reference, model, prompts_for, o.max_tokens, o.concurrency,
                             o.mixed_prompts, o.mixed_concurrency, o.vocab, o.seed,
                             progress=lambda text: progress(f"checking {text}"), api_key=api_key, stream=o.stream)


def _reported(report, o: CheckOptions):
    if o.junit:
        from pdctl.gates.junit import junit_xml

        junit = Path(o.junit)
        junit.parent.mkdir(parents=True, exist_ok=True)
        junit.write_text(junit_xml(report))
    return report


# ----------------------------------------------------------------------------------------------------------------
# Accuracy gate


@dataclass
class EvalOptions:
    limit: int | None = None  # the first N test rows
    num_fewshot: int = 5
    concurrency: int = 1  # per-sample agreement with the reference is exact only at 1
    data_dir: Path | None = None  # GSM8K jsonl here; else $GSM8K_DIR, a cached copy, the hub
    expected: Path | None = None  # the expected-accuracy table (None: pdctl's own, gates.accuracy.DEFAULT_TABLE)
    allow_ungated: bool = False  # a model the table does not know passes (UNGATED) instead of failing
    tokenizer: str | None = None
    min_agreement: float | None = None
    tolerance: float | None = None
    timeout_s: float = READY_TIMEOUT_S
    results: Path | None = None
    state_dir: Path | None = None  # where the brought-up topology keeps its state (default .pdctl/<name>)


@dataclass
class EvalResult:
    status: str  # PASS | FAIL | UNGATED
    model: str
    summary: dict  # what lm-eval measured and how each gate judged it (written as summary.json)
    out_dir: Path
    allow_ungated: bool = False

    @property
    def passed(self) -> bool:
        """PASS; UNGATED (no gate for the model) only when allowed: a gate that judged nothing is not a pass."""
        return self.status == "PASS" or (self.status == "UNGATED" and self.allow_ungated)

    def to_dict(self) -> dict:
        return self.summary


def expected_table(path: str | Path | None) -> dict:
    """The expected-accuracy table at `path` (None: pdctl's own); a path that is not a file is refused."""
    from pdctl.gates import accuracy

    path = Path(path) if path is not None else accuracy.DEFAULT_TABLE
    if not path.is_file():
        raise UserError(f"--expected: {path} is not a file (the expected-accuracy table; leave it out for pdctl's "
                        f"own, {accuracy.DEFAULT_TABLE})")
    try:
        return accuracy.load_expected(path)
    except (ValueError, OSError) as e:
        raise UserError(str(e)) from None


def gsm8k_source(data_dir: Path | None, say: Say = _quiet) -> Path | None:
    """Where GSM8K comes from, settled before anything starts (a bring-up of minutes must not end in lm-eval's
    ConnectionError); sets the environment lm-eval reads."""
    from pdctl.gates import gsm8k

    try:
        source = gsm8k.data_source(Path(data_dir) if data_dir else None)
    except gsm8k.DataError as e:
        raise UserError(str(e)) from None
    os.environ.update(source.env)
    say(f"GSM8K: {source.detail}")
    return source.data_dir


def evaluate(target: Topology | Deployment | str | Path | None = None, *, proxy: str | None = None,
             reference: str | None = None, model: str | None = None, options: EvalOptions | None = None,
             say: Say = _quiet, progress: Say = _quiet, **renamed) -> EvalResult:
    """Accuracy gate: lm-eval's gsm8k through the P/D proxy, judged by expected.yaml (absolute and/or relative to
    an aggregated reference). target: a Topology (or its file; brought up, with a reference when the gate needs
    one or reference='auto'), a running Deployment, or None with `proxy`, the URL of a running proxy."""
    from pdctl.gates import accuracy

    for old, new in (("url", "proxy"), ("baseline", "reference")):  # renamed in 0.2; said for one release
        if old in renamed:
            raise UserError(f"evaluate({old}=...): renamed to {new}=")
    if renamed:
        raise TypeError(f"evaluate() got unexpected keyword arguments {sorted(renamed)}")
    url = proxy
    o = options or EvalOptions()
    table = expected_table(o.expected)
    _check_url("--proxy", url)
    if reference != "auto":
        _check_url("--reference", reference)
    if isinstance(target, (str, Path)):
        target = load(target, gated=True)
    if target is not None and not isinstance(target, (Topology, Deployment)):
        raise UserError(f"evaluate: cannot evaluate a {type(target).__name__}; give a Topology, a Deployment or a URL")
    if target is None and not url:
        raise UserError("give a TOPOLOGY, or --proxy URL of a running P/D proxy")
    if not isinstance(target, Topology) and reference == "auto":
        raise UserError("--reference auto needs a TOPOLOGY; with --proxy give the reference's URL")
    data_dir = gsm8k_source(o.data_dir, say)
    stamp = time.strftime("%Y%m%d-%H%M%S")

    def run(proxy_url: str, ref_url: str | None, name: str, tok: str | None, out_dir: Path,
            key: str | None) -> EvalResult:
        progress(f"lm-eval gsm8k via P/D {proxy_url}" + (f" and the reference {ref_url}" if ref_url else "")
                 + f" (limit {o.limit})")
        s = accuracy.run_gate(proxy_url, ref_url, name, out_dir, table, tokenizer=tok, limit=o.limit,
                              num_fewshot=o.num_fewshot, concurrency=o.concurrency, data_dir=data_dir,
                              min_agreement=o.min_agreement, tolerance=o.tolerance, api_key=key)
        return EvalResult(s["status"], name, s, out_dir, o.allow_ungated)

    if not isinstance(target, Topology):
        d = target if isinstance(target, Deployment) else None
        key = _api_key(d.topology if d else None)
        proxy_url = url or d.proxy_url
        reference = reference or (d.reference_url if d else None)
        name = model or (d.topology.model.name if d else _served_model(proxy_url, key))
        if accuracy.needs_reference(table, name) and not reference:
            raise UserError(f"model '{name}' has a relative gsm8k gate in {accuracy.table_name(o.expected)} "
                            "(per-sample agreement and accuracy delta against an aggregated reference): give "
                            "--reference URL of an aggregated server of the same model, or a TOPOLOGY (pdctl then "
                            "starts one)")
        say(_running_warning(d, "eval"))
        local = d is not None and d.engine.name == "local"  # a cluster node's model path means nothing here
        return run(proxy_url, reference, name, o.tokenizer or (_served_path(d) if local else None),
                   o.results or Path("results") / f"eval-{stamp}", key)

    t = _gated(target, say)
    _local_engine(t)
    key = _api_key(t)  # before anything starts
    if accuracy.needs_reference(table, t.model.name) and not reference:
        reference = "auto"  # the gate cannot be judged without it, and the topology says how to start one
        say(f"model '{t.model.name}' has a relative gsm8k gate in {accuracy.table_name(o.expected)}: starting "
            "an aggregated reference beside the topology to compare with (as --reference auto)")
    p = plan(t, state_dir=o.state_dir, reference_port=t.reference.port if reference == "auto" else None)
    tok = o.tokenizer or _model_path(t)
    out_dir = o.results or Path("results") / f"eval-{t.name}-{stamp}"
    label = f"bringing up {p.name}{' and an aggregated reference' if reference == 'auto' else ''}"
    with _brought_up(p, t, o.timeout_s, progress, label) as d:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "topology.json").write_text(json.dumps(p.to_dict()["topology"], indent=2))
        return run(d.proxy_url, d.reference_url if reference == "auto" else reference, t.model.name, tok, out_dir, key)


def _served_path(d: Deployment) -> str:
    """The model path a deployment's decodes were started with (their tokenizer too)."""
    return d.plan.by_role("decode")[0].model


def _model_path(t: Topology) -> str:
    from pdctl.topology import resolved_model

    return resolved_model(t, t.decode[0], origin(t).base_dir)
