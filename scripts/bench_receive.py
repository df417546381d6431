#!/usr/bin/env python3
"""Receive-processing throughput per cache form: what the connector's conversion of one request's received blocks
costs (pdctl.kv.receive.receive_merged / receive_split on every layer of a KV group, in the cache's own form),
as a ratio to a plain torch copy of the same bytes (each layer's blocks gathered and scattered back in place:
index_select + index_copy_). Goal: at most 2x a copy.

    python scripts/bench_receive.py [--tokens 2048] [--layers 4] [--ratios 2 4 8] [--device cpu|cuda]
        [--out results/bench_receive.json]

One request of --tokens tokens, a Qwen3-0.6B-like layer (8 KV heads x 128 dims, bf16), --layers layers of one KV
group; merge: prefill block = decode block / ratio (the decode's blocks each hold `ratio` received pages), split:
prefill block = decode block x ratio (each prefill page read as `ratio` chunks, split into decode blocks). The
smaller block is 16 tokens (32 for cpu_amx, whose ISA needs blocks of 32k). Best of --repeat runs (15) each,
receive and copy in turn; a table on stdout and JSON in --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pdctl.kv.forms import form_of, joined_caches  # noqa: E402
from pdctl.kv.index import SplitChunk  # noqa: E402
from pdctl.kv.receive import receive_merged, receive_split  # noqa: E402

HEADS, HEAD_DIM = 8, 128
FORMS = ("LBHNC", "LBNHC", "BLHNC", "BLNHC", "cpu_vec", "cpu_amx")
GOAL = 2.0  # receive processing at most this many times a plain copy of the same bytes


def layers_of(form: str, blocks: int, block: int, layers: int, device: str):
    cpu = form.startswith("cpu_")
    caches = joined_caches("LBHNC" if cpu else form, blocks, HEADS, block, HEAD_DIM, layers, torch.bfloat16, device)
    for c in caches:
        c.copy_(torch.randn(c.shape, dtype=torch.bfloat16, device=device))
    if cpu:
        isa = "amx" if form == "cpu_amx" else "vec"
        return [(c, form_of(c, "CPU_ATTN", lambda n, isa=isa: isa)) for c in caches]
    return [(c, form_of(c, "FLASH_ATTN")) for c in caches]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def best_of(fns, device: str, repeat: int) -> list[float]:
    """Each function's best time over `repeat` runs, the functions run in turn each time (a drift in the host's
    load hits both sides of a ratio alike)."""
    for fn in fns:
        fn()
    sync(device)
    out = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            sync(device)
            out[i] = min(out[i], time.perf_counter() - t0)
    return out


def case(form: str, direction: str, ratio: int, tokens: int, layers: int, device: str, repeat: int) -> dict:
    small = 32 if form == "cpu_amx" else 16
    decode_block = small * ratio if direction == "merge" else small
    n = -(-tokens // decode_block)
    staging = 2 * (ratio - 1) if direction == "split" else 0
    group = layers_of(form, n + staging + 4, decode_block, layers, device)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randperm(n + 4, generator=gen)[:n].tolist()
    if direction == "merge":
        covered = -(-tokens // (decode_block // ratio))

        def receive():
            receive_merged(group, ids, ratio, covered)
    else:
        prefill_blocks = -(-n // ratio)
        spare = iter(range(n + 4, n + 4 + staging))
        chunks = [SplitChunk(src=v, dest=ids[v] if v < n else next(spare), block=v, real=v < n)
                  for v in range(prefill_blocks * ratio)]

        def receive():
            receive_split(group, chunks, ratio, tokens)

    idx = torch.tensor(ids, dtype=torch.long, device=device)

    def copy():
        for cache, _ in group:
            cache.index_copy_(0, idx, cache.index_select(0, idx))

    conv, plain = best_of([receive, copy], device, repeat)
    nbytes = sum(cache[0].numel() * cache.element_size() for cache, _ in group) * n
    return {"form": form, "direction": direction, "ratio": ratio, "decode_block": decode_block, "blocks": n,
            "bytes": nbytes, "receive_ms": conv * 1e3, "copy_ms": plain * 1e3, "x_copy": conv / plain}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ratios", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench_receive.json")
    args = ap.parse_args(argv)
    rows = [case(f, d, r, args.tokens, args.layers, args.device, args.repeat)
            for f in FORMS for d in ("merge", "split") for r in args.ratios]
    print(f"{'form':8} {'dir':6} {'ratio':>5} {'block':>5} {'MiB':>7} {'receive ms':>11} {'copy ms':>8} {'x copy':>7}")
    for r in rows:
        print(f"{r['form']:8} {r['direction']:6} {r['ratio']:>5} {r['decode_block']:>5} {r['bytes'] / 2**20:>7.1f} "
              f"{r['receive_ms']:>11.2f} {r['copy_ms']:>8.2f} {r['x_copy']:>7.2f}")
    worst = max(rows, key=lambda r: r["x_copy"])
    print(f"worst: {worst['form']} {worst['direction']} ratio {worst['ratio']}: {worst['x_copy']:.2f}x a copy "
          f"(goal <= {GOAL}x); {sum(r['x_copy'] <= GOAL for r in rows)}/{len(rows)} within the goal")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": "python scripts/bench_receive.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": args.device, "host": platform.processor() or platform.machine(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "tokens": args.tokens, "layers": args.layers, "goal_x_copy": GOAL,
        "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
