"""`pdctl bench`: up -> parity -> accuracy -> load benchmark -> down, one summary. The phases are the gates' own."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from pdctl import auth
from pdctl.bench import breakdown, load
from pdctl.bench.options import BenchOptions
from pdctl.gates import accuracy, fleet, parity
from pdctl.gates import prompts as gate_prompts
from pdctl.launch import probe
from pdctl.launch import run as run_mod
from pdctl.launch.engine import Engine
from pdctl.plan import Plan, ProcessSpec
from pdctl.protocol import ROUTE_HEADER
from pdctl.topology import Loaded, resolved_model
from pdctl.topology import summary as summary_line


def overall_status(summary: dict, allow_ungated: bool = False) -> str:
    """PASS when every gate that ran passed; an accuracy gate that judged nothing (UNGATED: the table does not know
    the model) fails the run unless allowed."""
    gates = [summary[k]["status"] for k in ("parity", "accuracy", "perf") if k in summary]
    if "FAIL" in gates or ("UNGATED" in gates and not allow_ungated):
        return "FAIL"
    return "PASS"


def run_bench(loaded: Loaded, plan: Plan, ref: ProcessSpec, engine: Engine, out_dir: Path, o: BenchOptions,
              expected: dict, phase: Callable[[str], None] = lambda _: None) -> dict:
    """expected: the accuracy table read from o.expected (read before anything starts)."""
    t = loaded.topology
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "topology.json").write_text(json.dumps(plan.to_dict()["topology"], indent=2))
    p0, d0 = t.prefill[0], t.decode[0]
    # Per pair (pinned parity, a load pinned to each pair) needs pdctl's proxy; vllm-router cannot pin a pair.
    router = t.proxy.kind == "vllm-router"
    fleet_mode = (len(t.prefill) > 1 or len(t.decode) > 1) and not router
    summary: dict = {"name": t.name, "prefill_block": p0.block_size, "decode_block": d0.block_size,
                     "prefill_tp": p0.tp, "decode_tp": d0.tp, "decode_layout": d0.kv_layout,
                     "connector": t.connector.kind, "pools": summary_line(t)}
    vocab = loaded.model_info.vocab_size or 1000
    seed = int(time.time())
    works: list[load.Workload] = []
    if "perf" not in o.skip:
        # The load's prompts, before anything starts (a dataset file that does not give enough fails here): one
        # workload for P/D and the reference alike, one fresh one per pool pair (the same servers as P/D's run).
        phase(f"load: {o.requests} prompts from vLLM's {o.dataset} dataset (seed {seed})")
        works = _workloads(loaded, o, seed, vocab, 1 + (len(t.pairs()) if fleet_mode else 0), phase)
    phase(f"up: {plan.name} and an aggregated reference")
    t0 = time.perf_counter()
    state = run_mod.up(plan, engine, attached=True, timeout_s=o.timeout_s)
    summary["time_to_ready_s"] = time.perf_counter() - t0
    proxy = plan.get("proxy").http_url
    decodes = [s.http_url for s in plan.by_role("decode")]
    key = auth.api_key(t)  # every call below sends it (auth.api_key_env); pre-flight made sure it is set
    key_h = auth.headers(key)
    try:
        if "check" not in o.skip:
            phase("parity check")
            max_prompt = (t.model.max_model_len or 2048) - 17

            def pair_prompts(pb: int, db: int, k: int) -> list:  # pool pair k's: fresh, its own draw
                return gate_prompts.prompts_for([pb, db], vocab, max_prompt, o.data_dir)

            if fleet_mode:
                frep = fleet.check_fleet(plan, proxy, ref.http_url, t.model.name, pair_prompts, vocab=vocab,
                                         api_key=key)
                (out_dir / "parity.json").write_text(json.dumps(frep.to_dict(), indent=2))
                summary["parity"] = {"status": "PASS" if frep.passed else "FAIL", "pass_rate": frep.pass_rate,
                                     "prompts": len(frep.results), "kv_travelled": all(
                                         p.report.proof and p.report.proof.ok for p in frep.all()),
                                     "pairs": [p.to_dict() for p in frep.pairs]}
            elif router:  # every pair's prompts, unpinned; the transfer proven per decode instance
                rep = fleet.check_unpinned(plan, proxy, ref.http_url, t.model.name, pair_prompts)
                (out_dir / "parity.json").write_text(json.dumps(rep.to_dict(), indent=2))
                summary["parity"] = {"status": "PASS" if rep.passed else "FAIL", "pass_rate": rep.pass_rate,
                                     "prompts": len(rep.results), "kv_travelled": bool(rep.proof and rep.proof.ok)
                                     and not rep.problems, "pinned": False, "note": rep.note}
            else:
                prompts = gate_prompts.prompts_for([p0.block_size, d0.block_size], vocab, max_prompt, o.data_dir)
                rep = parity.run_parity(proxy, ref.http_url, decodes, t.model.name, prompts, 16, 1, api_key=key)
                (out_dir / "parity.json").write_text(json.dumps(rep.to_dict(), indent=2))
                summary["parity"] = {"status": "PASS" if rep.passed else "FAIL", "pass_rate": rep.pass_rate,
                                     "prompts": len(rep.results), "kv_travelled": bool(rep.proof and rep.proof.ok)}
        if "eval" not in o.skip:
            phase(f"accuracy: lm-eval gsm8k, limit {o.limit}, P/D and reference")
            tok = resolved_model(t, d0, loaded.base_dir)
            # One request at a time: the same batches on both sides, so per-sample agreement is exact.
            summary["accuracy"] = accuracy.run_gate(proxy, ref.http_url, t.model.name, out_dir / "eval",
                                                    expected, tokenizer=tok, limit=o.limit,
                                                    num_fewshot=o.num_fewshot, concurrency=1,
                                                    data_dir=o.data_dir, api_key=key)
        if "perf" not in o.skip:
            how = f"{o.request_rate:g} req/s (Poisson)" if o.request_rate else f"concurrency {o.concurrency}"
            size = f" x {o.prompt_len}" if o.dataset in ("random", "prefix_repetition") else ""
            phase(f"load: {o.requests} {o.dataset} prompts{size} + {o.max_tokens} output tokens, {how}, P/D then "
                  "aggregated")
            (out_dir / "load").mkdir(exist_ok=True)
            # The same prompts to both (different servers: neither answers from its prefix cache), the same arrivals.
            since = time.time()
            pd = load.run_load("P/D", proxy, t.model.name, works[0], o.max_tokens, o.concurrency, decodes,
                               o.request_rate, seed, key_h or None)
            followed = follow(plan, proxy, since, key_h) if o.breakdown else None
            agg = load.run_load("aggregated", ref.http_url, t.model.name, works[0], o.max_tokens, o.concurrency,
                                request_rate=o.request_rate, seed=seed, headers=key_h or None)
            (out_dir / "load" / "pd.vllm.json").write_text(pd.vllm_json())  # vLLM's own result, as it gave it
            (out_dir / "load" / "aggregated.vllm.json").write_text(agg.vllm_json())
            summary["perf"] = {"pd": pd.to_dict(), "aggregated": agg.to_dict(), "ratio": load.ratios(pd, agg),
                               "dataset": o.dataset, "seed": seed,
                               "status": "PASS" if pd.errors == 0 and agg.errors == 0 else "FAIL"}
            if followed is not None:
                summary["perf"]["breakdown"] = followed
            if fleet_mode:
                # The same load pinned to each pool pair in turn (fresh prompts): what each pair costs.
                per_pair = []
                for (pp, dp), work in zip(t.pairs(), works[1:], strict=True):
                    phase(f"load: pair {pp.name} -> {dp.name}")
                    urls = [s.http_url for s in plan.by_role("decode") if s.pool == dp.name]
                    r = load.run_load(f"{pp.name}->{dp.name}", proxy, t.model.name, work, o.max_tokens,
                                      o.concurrency, urls, o.request_rate, seed,
                                      {ROUTE_HEADER: f"{pp.name}/{dp.name}", **key_h})
                    (out_dir / "load" / f"pair-{pp.name}-{dp.name}.vllm.json").write_text(r.vllm_json())
                    per_pair.append({"prefill_pool": pp.name, "decode_pool": dp.name, **r.to_dict(),
                                     "ratio": load.ratios(r, agg)})
                    if r.errors:
                        summary["perf"]["status"] = "FAIL"
                summary["perf"]["pairs"] = per_pair
    finally:
        phase("down")
        run_mod.down(state, engine)
    summary["status"] = overall_status(summary, o.allow_ungated)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _workloads(loaded: Loaded, o: BenchOptions, seed: int, vocab: int, count: int,
               phase: Callable[[str], None]) -> list[load.Workload]:
    """`count` workloads from o.dataset with the model's tokenizer, seeds seed, seed + 1, ..., no prompt in two.
    Without the tokenizer (a hub model not cached here), synthetic datasets fall back to token-id prompts."""
    path = resolved_model(loaded.topology, loaded.topology.decode[0], loaded.base_dir)
    try:
        tok = load.load_tokenizer(path)
    except Exception as e:  # noqa: BLE001 - whatever the tokenizer's loader raises: said, then token ids if we can
        if o.dataset in load.FILE_DATASETS:
            raise load.WorkloadError(f"--dataset {o.dataset}: the model's tokenizer ({path}) did not load: {e}") from e
        phase(f"load: the model's tokenizer ({path}) did not load ({e}); token-id prompts from its vocabulary")
        tok = None
    seen: set = set()
    return [load.workload(o.requests, prompt_len=o.prompt_len, max_tokens=o.max_tokens, seed=seed + i, tokenizer=tok,
                          vocab=vocab, dataset=o.dataset, dataset_path=o.dataset_path, seen=seen)
            for i in range(count)]


def follow(plan: Plan, proxy: str, since: float, headers: dict[str, str] | None = None) -> dict:
    """The proxy's P/D requests received after `since`, stage by stage: its timestamps joined with the decodes'
    timing lines (connector.trace); requests seen, followed, logs not readable here, stage stats."""
    status, text = probe.http_get(f"{proxy}/debug/timings?since={since}", timeout=30, headers=headers)
    records = json.loads(text) if status == 200 else []
    stamps: dict = {}
    unread = []
    for s in plan.by_role("decode"):
        try:
            stamps |= breakdown.connector_stamps(Path(s.log_path).read_text(errors="replace").splitlines())
        except OSError:  # a log on another node (Ray, Slurm without a shared file system)
            unread.append(s.name)
    timelines, first = breakdown.join(records, stamps), breakdown.first_token(records)
    return {"requests": len(records), "followed": len(timelines), "unread_logs": unread,
            "stages": [st.to_dict() for st in breakdown.summarize(timelines)], "first_token": len(first),
            "first_token_stages": [st.to_dict() for st in breakdown.summarize(first, breakdown.FIRST_STAGES)]}
