#!/usr/bin/env python3
"""What a request's KV fingerprint (pdctl.kv.fingerprint) costs on each side, against the NIXL transfer of the same
KV: the first measurement issue 59 asks for, before the connector computes it on every transfer.

Per cache form, one request of --tokens tokens, one layer of a Qwen3-0.6B-like cache (8 KV heads x 128 dims, bf16;
the times are per layer, so the ratios hold for any layer count):
- transfer: a NIXL READ of the request's pages between two agents in this process (DRAM, UCX on loopback with the
  conformance harness's settings), best of --repeat;
- fingerprint: pdctl.kv.fingerprint.head_partials over the request's KV read through the form's logical view of its
  pages (what a side computes where its KV lies: the unpacking is in the time), best of --repeat;
- the ratio of the two, and the fingerprint's bandwidth.

Usage: python scripts/bench_fingerprint.py [--tokens 2048] [--repeat 15] [--out results/bench_fingerprint.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_kv import Nixl, timed  # noqa: E402
from kv_conformance import UCX_LOOPBACK  # noqa: E402

from pdctl.kv.fingerprint import head_partials  # noqa: E402
from pdctl.kv.layouts import BlockShape, layout  # noqa: E402

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

    def fingerprint():
        kk, vv = layout(lay).unpack(pages, shape)
        kk = kk.transpose(0, 1).reshape(HEADS, -1, HEAD_DIM)[:, :tokens]
        vv = vv.transpose(0, 1).reshape(HEADS, -1, HEAD_DIM)[:, :tokens]
        return head_partials(kk, vv, layer=0, first_token=0)

    nbytes = pages.numel() * pages.element_size()
    t_fp = timed(fingerprint, repeat)
    row = {"form": form, "block": block, "tokens": tokens, "bytes": nbytes, "fingerprint_ms": t_fp * 1e3,
           "fingerprint_gbps": nbytes / t_fp / 1e9}
    if nixl is not None:
        t_x = min(nixl.read([(0, 0, nbytes)]) for _ in range(repeat))
        row.update(transfer_ms=t_x * 1e3, transfer_gbps=nbytes / t_x / 1e9, fingerprint_per_transfer=t_fp / t_x)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench_fingerprint.json")
    a = ap.parse_args(argv)
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
