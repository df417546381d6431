#!/usr/bin/env python
"""Prefix affinity vs least outstanding on a fleet, in one bring-up: the decodes' prefix-cache hits on a workload
where groups of requests share long prompt heads, and the outputs against an aggregated reference.

One bring-up of the fleet (default configs/cpu-fleet.yaml: 2 prefill pools x 2 decode pools) with an aggregated
reference and two proxies in front of the same instances, one per policy. Rounds alternate between the policies;
each round draws fresh prompt groups (so no policy profits from the other's cache), sends them shuffled at
`--concurrency`, and reads the decodes' `vllm:prompt_tokens_by_source_total{source="local_cache_hit"}` before
and after (and the prefills' prefix-cache hits). Every answer is compared with the reference's, token for token.

    .venv/bin/python scripts/bench_routing.py [--rounds 2] [--groups 6] [--per-group 4] [--prefix 512]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdctl.gates import parity  # noqa: E402
from pdctl.launch import probe  # noqa: E402
from pdctl.launch import run as run_mod  # noqa: E402
from pdctl.launch.local import LocalEngine  # noqa: E402
from pdctl.plan import build_plan, proxy_argv, reference_spec  # noqa: E402
from pdctl.topology import Override, load_topology  # noqa: E402

POLICIES = ("least_outstanding", "prefix_affinity")


def counters(urls: list[str]) -> dict[str, float]:
    out = {"decode_cache_hit": 0.0, "decode_transfer": 0.0}
    for u in urls:
        m = probe.metrics(u) or {}
        out["decode_cache_hit"] += parity._by_source(m, "local_cache_hit")
        out["decode_transfer"] += parity._by_source(m, "external_kv_transfer")
    return out


def prefill_hits(urls: list[str]) -> float:
    return sum((probe.metrics(u) or {}).get("vllm:prefix_cache_hits_total", 0.0) for u in urls)


def workload(groups: int, per_group: int, prefix: int, suffix: int, vocab: int, rng: random.Random) -> list[list[int]]:
    out = []
    for _ in range(groups):
        head = [rng.randrange(3, vocab) for _ in range(prefix)]
        out += [head + [rng.randrange(3, vocab) for _ in range(suffix)] for _ in range(per_group)]
    rng.shuffle(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", default=str(REPO / "configs" / "cpu-fleet.yaml"))
    ap.add_argument("--rounds", type=int, default=2, help="rounds per policy (alternating)")
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--per-group", type=int, default=4)
    ap.add_argument("--prefix", type=int, default=512, help="shared prompt head, tokens")
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--state-dir", default=str(REPO / ".pdctl" / "bench-routing"))
    ap.add_argument("--out", default=str(REPO / "results" / "bench_routing.json"))
    a = ap.parse_args()

    loaded = load_topology(a.topology, [Override(("proxy", "policy"), POLICIES[1], "bench_routing")])
    t = loaded.topology
    state = Path(a.state_dir).absolute()
    plan = build_plan(t, base_dir=loaded.base_dir, state_dir=state, python=sys.executable)
    ref = reference_spec(t, base_dir=loaded.base_dir, state_dir=state, port=t.reference.port, python=sys.executable)
    # A second proxy over the same instances, least outstanding: both policies see the same fleet in one run.
    lo = t.model_copy(update={"proxy": t.proxy.model_copy(update={"policy": POLICIES[0], "port": t.proxy.port + 1})})
    pa_proxy = plan.get("proxy")
    lo_proxy = replace(pa_proxy, name="proxy-lo", argv=proxy_argv(lo, plan.by_role("prefill") + plan.by_role(
        "decode"), sys.executable), ports={"http": lo.proxy.port}, log_path=str(state / "logs" / "proxy-lo.log"),
        readiness_url=pa_proxy.readiness_url.replace(str(t.proxy.port), str(lo.proxy.port)))
    plan = plan.with_processes([*plan.processes, lo_proxy, ref])
    urls = {POLICIES[0]: lo_proxy.http_url, POLICIES[1]: pa_proxy.http_url}
    decodes = [s.http_url for s in plan.by_role("decode")]
    prefills = [s.http_url for s in plan.by_role("prefill")]
    vocab = loaded.model_info.vocab_size or 1000
    rng = random.Random(a.seed)
    engine = LocalEngine()
    problems = run_mod.preflight(loaded, plan, engine)
    if problems:
        raise SystemExit("pre-flight failed: " + "; ".join(problems))
    print(f"bringing up {plan.name} + reference + 2 proxies ...", flush=True)
    state_ = run_mod.up(plan, engine, attached=True, timeout_s=600)
    rows: list[dict] = []
    try:
        for rnd in range(a.rounds):
            for policy in (POLICIES if rnd % 2 == 0 else POLICIES[::-1]):
                prompts = workload(a.groups, a.per_group, a.prefix, a.suffix, vocab, rng)
                before, pre_before = counters(decodes), prefill_hits(prefills)
                t0 = time.perf_counter()

                def one(ids: list[int], url: str = urls[policy]) -> tuple[list, dict]:
                    seen: dict[str, str] = {}
                    resp = parity.complete(url, t.model.name, ids, a.max_tokens, seen=seen)
                    return parity._token_ids(resp), seen

                with ThreadPoolExecutor(a.concurrency) as pool:
                    answers = list(pool.map(one, prompts))
                wall = time.perf_counter() - t0
                after, pre_after = counters(decodes), prefill_hits(prefills)
                refs = [parity._token_ids(parity.complete(ref.http_url, t.model.name, ids, a.max_tokens))
                        for ids in prompts]
                equal = sum(ans == r for (ans, _), r in zip(answers, refs, strict=True))
                pairs: dict[str, int] = {}
                for _, h in answers:
                    k = f"{h.get('x-pdctl-prefill')}->{h.get('x-pdctl-decode')}"
                    pairs[k] = pairs.get(k, 0) + 1
                row = {"round": rnd, "policy": policy, "requests": len(prompts), "equal_to_reference": equal,
                       "decode_cache_hit_tokens": after["decode_cache_hit"] - before["decode_cache_hit"],
                       "decode_transfer_tokens": after["decode_transfer"] - before["decode_transfer"],
                       "prefill_cache_hit_tokens": pre_after - pre_before, "wall_s": wall, "pairs": pairs}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        run_mod.down(state_, engine)

    def med(policy: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["policy"] == policy)

    print(f"\nprefix affinity vs least outstanding: {a.groups} groups x {a.per_group} requests sharing a "
          f"{a.prefix}-token head (+{a.suffix}), concurrency {a.concurrency}, {a.rounds} rounds each, medians\n")
    print("| policy | decode prefix-cache hit tokens | decode tokens by transfer | prefill prefix-cache hits | "
          "equal to reference | wall s |")
    print("|---|---|---|---|---|---|")
    for p in POLICIES:
        print(f"| {p} | {med(p, 'decode_cache_hit_tokens'):.0f} | {med(p, 'decode_transfer_tokens'):.0f} | "
              f"{med(p, 'prefill_cache_hit_tokens'):.0f} | "
              f"{sum(r['equal_to_reference'] for r in rows if r['policy'] == p)}/"
              f"{sum(r['requests'] for r in rows if r['policy'] == p)} | {med(p, 'wall_s'):.1f} |")
    lo_hits = med(POLICIES[0], "decode_cache_hit_tokens")
    ratio = med(POLICIES[1], "decode_cache_hit_tokens") / lo_hits if lo_hits else float("inf")
    print(f"\ndecode prefix-cache hits, prefix_affinity / least_outstanding: {ratio:.2f}x")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "rows": rows, "hit_ratio": ratio}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
