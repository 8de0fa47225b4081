"""Profiling targets: `python -m hipkern.bench.profile CASE` runs one shape a few times (warm-up,
then the calls a profiler is told to skip to) so that Nsight Compute or torch.profiler can look at
one steady-state launch; with --breakdown it prints torch.profiler's device time per kernel instead.

Cases: pa64 (paged attention, 32 x 2048, 64 q heads on 1 KV head of 256, bf16, its default variant),
pa8 (32 x 2048, 64 q / 8 kv, head 128), moe1 (fused_moe bf16, 1 token, D 7168, I 256, E 256, top-8),
or any paged-attention shape as pa:BATCH:CONTEXT:QHEADS:KVHEADS:HEADSIZE[:VARIANT] (bf16, block 16).
"""
from __future__ import annotations

import argparse
import sys

import torch

import hipkern


def pa(hq, hkv, d, batch=32, ctx=2048, variant=None):
    from hipkern.bench.paged_attention import make_inputs

    q, k, v, bt, cl = make_inputs([ctx] * batch, hq, hkv, d)
    return lambda: hipkern.paged_attention_decode(q, k, v, bt, cl, variant=variant)


def pa_case(text):
    """pa:BATCH:CONTEXT:QHEADS:KVHEADS:HEADSIZE[:VARIANT]"""
    f = text.split(":")
    if len(f) not in (6, 7) or f[0] != "pa" or not all(x.isdigit() for x in f[1:6]):
        raise argparse.ArgumentTypeError(f"expected pa:BATCH:CONTEXT:QHEADS:KVHEADS:HEADSIZE[:VARIANT], got {text!r}")
    b, c, hq, hkv, d = map(int, f[1:6])
    return lambda: pa(hq, hkv, d, b, c, f[6] if len(f) == 7 else None)


def moe1(tokens=1, dim=7168, inter=256, experts=256, topk=8):
    g = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.randn(experts, 2 * inter, dim, generator=g, device="cuda", dtype=torch.bfloat16) * dim ** -0.5
    w2 = torch.randn(experts, dim, inter, generator=g, device="cuda", dtype=torch.bfloat16) * inter ** -0.5
    x = torch.randn(tokens, dim, generator=g, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(tokens, experts, generator=g, device="cuda").topk(topk, dim=1).indices.to(torch.int32)
    w = torch.full((tokens, topk), 1.0 / topk, device="cuda")
    out = torch.empty_like(x)
    return lambda: hipkern.fused_moe(x, w1, w2, w, ids, out=out)


CASES = {"pa64": lambda: pa(64, 1, 256), "pa8": lambda: pa(64, 8, 128), "moe1": moe1}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hipkern.bench.profile")
    ap.add_argument("case", type=lambda t: CASES[t] if t in CASES else pa_case(t),
                    help=f"one of {sorted(CASES)} or pa:BATCH:CONTEXT:QHEADS:KVHEADS:HEADSIZE[:VARIANT]")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--breakdown", action="store_true", help="torch.profiler device time per kernel")
    args = ap.parse_args(argv)
    fn = args.case()
    for _ in range(args.calls):
        fn()
    torch.cuda.synchronize()
    if args.breakdown:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=90))
    return 0


if __name__ == "__main__":
    sys.exit(main())
