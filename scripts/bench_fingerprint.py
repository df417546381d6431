#!/usr/bin/env python3
"""What a request's KV fingerprint (pdctl.kv.fingerprint) costs on each side, against the NIXL transfer of the same
KV: the first measurement issue 59 asks for, before the connector computes it on every transfer.

Per cache form, one request of --tokens tokens, one layer of a Qwen3-0.6B-like cache (8 KV heads x 128 dims, bf16;
the times are per layer, so the ratios hold for any layer count):
- transfer: a NIXL READ of the request's pages between two agents in this process (DRAM, UCX on loopback with the
  conformance harness's settings), best of --repeat;
- fingerprint: pdctl.kv.fingerprint.head_partials over the request's KV read through the form's logical view of its
  pages, block by block in the form's own order (what a side computes where its KV lies), best of --repeat;
- the ratio of the two, and the fingerprint's bandwidth.

`--served CONFIG`: the same cost where users stand, in a deployment. CONFIG brought up with connector.kv_fingerprint
on; --requests prompts of the goodput workload's shape (2048 tokens, 64 out) at one request at a time, then the
same number at --rate req/s (open loop). Per phase, the seconds the prefill's and the decode's workers spent on
fingerprints (each server's vllm:pdctl_kv_fingerprint_seconds_total, read before and after) per request, against
the phase's TTFT: the fingerprint's share of TTFT, measured in the one run that paid it.

Usage: python scripts/bench_fingerprint.py [--tokens 2048] [--repeat 15] [--out results/bench_fingerprint.json]
       python scripts/bench_fingerprint.py --served configs/cpu-demo.yaml [--requests 32] [--rate 4]
           [--out results/bench_fingerprint_served.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.request
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_kv import Nixl, timed  # noqa: E402
from kv_conformance import UCX_LOOPBACK  # noqa: E402

from pdctl import api, protocol  # noqa: E402
from pdctl.bench import load  # noqa: E402
from pdctl.bench.options import BenchOptions  # noqa: E402
from pdctl.kv.fingerprint import head_partials  # noqa: E402
from pdctl.kv.layouts import BlockShape, layout  # noqa: E402
from pdctl.launch.probe import parse_metrics  # noqa: E402
from pdctl.topology import resolved_model  # noqa: E402

HEADS, HEAD_DIM = 8, 128
# (form, its pdctl.kv layout, block size): CUDA's two joined layouts at 16, CPU_ATTN's packings at 32, Gaudi's at 128.
FORMS = [("LBHNC", "HND", 16), ("LBNHC", "NHD", 16), ("cpu_vec", "cpu_vec", 32), ("cpu_amx", "cpu_amx", 32),
         ("hpu", "hpu", 128), ("host:hpu", "hpu_host", 128)]


def case(form: str, lay: str, block: int, tokens: int, repeat: int, nixl: Nixl | None) -> dict:
    shape = BlockShape(HEADS, block, HEAD_DIM)
    blocks = -(-tokens // block)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(blocks, HEADS, block, HEAD_DIM, generator=g).to(torch.bfloat16)
    v = torch.randn(blocks, HEADS, block, HEAD_DIM, generator=g).to(torch.bfloat16)
    pages = layout(lay).pack(k, v, shape)  # [blocks, page]: the request's pages as the form lays them out

    def fingerprint():  # as the connector reads it: the pages' blocks in the form's own order, no copy
        kk, vv = layout(lay).unpack(pages, shape)
        return head_partials(kk, vv, layer=0, first_token=0, end=tokens)

    nbytes = pages.numel() * pages.element_size()
    t_fp = timed(fingerprint, repeat)
    row = {"form": form, "block": block, "tokens": tokens, "bytes": nbytes, "fingerprint_ms": t_fp * 1e3,
           "fingerprint_gbps": nbytes / t_fp / 1e9}
    if nixl is not None:
        t_x = min(nixl.read([(0, 0, nbytes)]) for _ in range(repeat))
        row.update(transfer_ms=t_x * 1e3, transfer_gbps=nbytes / t_x / 1e9, fingerprint_per_transfer=t_fp / t_x)
    return row


def fingerprint_seconds(url: str) -> tuple[float, float]:
    """A server's fingerprint seconds and checks so far, over its TP ranks."""
    m = parse_metrics(urllib.request.urlopen(url + "/metrics", timeout=10).read().decode())
    return m.get(f"{protocol.FINGERPRINT_SECONDS}_total", 0.0), m.get(f"{protocol.FINGERPRINTS_CHECKED}_total", 0.0)


def served(config: str, requests: int, rate: float, out: Path) -> int:
    o = BenchOptions(goodput=True).resolved()  # the goodput workload's shape: the demo's load
    t = api.load(config, ["connector.kv_fingerprint=true"], gated=True)
    loaded = api.origin(t)
    tok = load.load_tokenizer(resolved_model(t, t.decode[0], loaded.base_dir))
    rows = []
    with api.up(t, state_dir=Path("/tmp/pdctl-bench-fingerprint")) as d:
        plan = d.plan
        sides = {role: [s.http_url for s in plan.by_role(role)] for role in ("prefill", "decode")}
        proxy = plan.by_role("proxy")[0].http_url
        seen: set = set()
        for phase, concurrency, arrivals in (("concurrency 1", 1, None), (f"{rate:g} req/s", requests, rate)):
            work = load.workload(requests, o.prompt_len, loaded.model_info.vocab_size or 1000, 9100 + len(rows),
                                 max_tokens=o.max_tokens, tokenizer=tok, seen=seen)
            before = {r: [fingerprint_seconds(u) for u in urls] for r, urls in sides.items()}
            res = load.run_load(phase, proxy, t.model.name, work, o.max_tokens, concurrency,
                                request_rate=arrivals, seed=len(rows))
            after = {r: [fingerprint_seconds(u) for u in urls] for r, urls in sides.items()}
            spent = {r: sum(a[0] - b[0] for a, b in zip(after[r], before[r], strict=True)) for r in sides}
            checked = sum(a[1] - b[1] for a, b in zip(after["decode"], before["decode"], strict=True))
            n = res.requests  # completed ones
            if not n:
                raise SystemExit(f"{phase}: no request completed ({res.errors} errors); see the servers' logs")
            ttft_mean = (res.vllm or {}).get("mean_ttft_ms", res.ttft_ms_p50)
            row = {"phase": phase, "requests": n, "checked": checked, "ttft_ms_mean": ttft_mean,
                   "ttft_ms_p50": res.ttft_ms_p50, "prefill_ms_per_request": spent["prefill"] * 1e3 / n,
                   "decode_ms_per_request": spent["decode"] * 1e3 / n}
            row["share_of_ttft"] = (row["prefill_ms_per_request"] + row["decode_ms_per_request"]) / ttft_mean
            rows.append(row)
            print(f"{phase}: {n} requests, {checked:g} checks; TTFT mean {ttft_mean:.1f} ms (p50 "
                  f"{res.ttft_ms_p50:.1f}); fingerprint per request: prefill {row['prefill_ms_per_request']:.2f} "
                  f"ms, decode {row['decode_ms_per_request']:.2f} ms: {100 * row['share_of_ttft']:.1f} % of TTFT",
                  flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "prompt_len": o.prompt_len,
                               "max_tokens": o.max_tokens, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--served", metavar="CONFIG", help="measure in a deployment of CONFIG instead")
    ap.add_argument("--requests", type=int, default=32, help="--served: prompts per phase")
    ap.add_argument("--rate", type=float, default=4.0, help="--served: the loaded phase's req/s")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    if a.served:
        return served(a.served, a.requests, a.rate, a.out or ROOT / "results" / "bench_fingerprint_served.json")
    a.out = a.out or ROOT / "results" / "bench_fingerprint.json"
    torch.set_num_threads(max(1, torch.get_num_threads()))
    nbytes = -(-a.tokens // 16) * 16 * HEADS * HEAD_DIM * 2 * 2 + (1 << 20)
    os.environ.update(UCX_LOOPBACK)  # two agents of one host: before NIXL loads
    try:
        nixl = Nixl(nbytes)
    except Exception as e:  # noqa: BLE001 - the fingerprint alone is still worth a table
        print(f"NIXL loopback unavailable ({e}); transfer times left out")
        nixl = None
    rows = [case(form, lay, block, a.tokens, a.repeat, nixl) for form, lay, block in FORMS]
    print(f"one layer, {a.tokens} tokens, {HEADS} KV heads x {HEAD_DIM}, bf16; {torch.get_num_threads()} threads")
    print(f"{'form':9} {'block':>5} {'MiB':>6} {'fingerprint ms':>14} {'GB/s':>6} {'transfer ms':>11} {'GB/s':>6} "
          f"{'fp / transfer':>13}")
    for r in rows:
        x = (f"{r['transfer_ms']:>11.3f} {r['transfer_gbps']:>6.2f} {r['fingerprint_per_transfer']:>13.2f}"
             if "transfer_ms" in r else "")
        print(f"{r['form']:9} {r['block']:>5} {r['bytes'] / 2**20:>6.2f} {r['fingerprint_ms']:>14.3f} "
              f"{r['fingerprint_gbps']:>6.2f} {x}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"tokens": a.tokens, "heads": HEADS, "head_dim": HEAD_DIM,
                                 "threads": torch.get_num_threads(), "rows": rows}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
