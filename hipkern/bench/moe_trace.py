"""Phase timeline of fused_moe's kernels (a diagnostic, NVIDIA only).

``python -m hipkern.bench.moe_trace [--shape T,D,I,E,k] [--block-m 8] [--variant decode|grouped] [--case N]``
builds a separate copy of the fused_moe module with ``HK_MOE_TRACE`` defined, in which thread 0 of
every block records ``%globaltimer`` at the phase boundaries (csrc_hip/fused_moe/gemm.h, decode.h): of
the one-launch decode kernel, or of the grouped chain's gated GEMM, down GEMM and combine launches
(moe_sorting, its own module, where the chain runs it above 256 pairs, is not traced). It runs the variant on random bf16 weights and prints per
point the minimum, 10th percentile, median, 90th percentile and maximum over the blocks in
microseconds from the earliest block start, and the call's median time by events. ``--case N`` traces
benchmark case N (bf16) as the benchmark and the database run it, and gives each GEMM phase's rate
over its activated weight bytes. ``%globaltimer`` ticks in about 0.25-1 us steps: read the spread, not
the last digit. The library's own modules are never built with the define.
"""
from __future__ import annotations

import argparse
import ctypes

import torch

from hipkern.bench import traced_module

POINTS = {"decode": ("start", "routed", "gated items done", "down: last release", "down items done",
                     "grid barrier passed", "end"),
          "grouped": ("gated: start", "gated: input ready", "gated: end", "down: start", "down: input ready",
                      "down: end", "combine: input ready", "combine: end")}
MAX_BLOCKS = 4096  # the trace table's rows (gemm.h)


def run(tokens: int, dim: int, inter: int, experts: int, topk: int, block_m: int, variant: str = "decode",
        calls: int = 20) -> None:
    """Trace random bf16 weights and a random top-k routing of this shape."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.randn(experts, 2 * inter, dim, device="cuda", dtype=torch.bfloat16, generator=g) * dim ** -0.5
    w2 = torch.randn(experts, dim, inter, device="cuda", dtype=torch.bfloat16, generator=g) * inter ** -0.5
    x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.rand(tokens, experts, device="cuda", generator=g).topk(topk, dim=1).indices.int().contiguous()
    w = torch.rand(tokens, topk, device="cuda", generator=g) + 0.1
    trace(x, w1, w2, w / w.sum(1, keepdim=True), ids, block_m, variant, calls,
          f"{variant}, T={tokens} D={dim} I={inter} E={experts} k={topk} block_m={block_m}")


def run_case(num: int, calls: int = 20, block_m: int | None = None) -> None:
    """Trace benchmark case `num` (bf16) with the benchmark's weights and first routing, as the database
    runs it (or at `block_m`, the variant then the op's choice for it); for the grouped chain also each
    GEMM phase's rate over its activated weight bytes."""
    from hipkern.bench import moe as bench

    cases = {case.num: case for case in bench.all_cases()}
    if num not in cases:
        raise SystemExit(f"--case {num}: no such case; the benchmark's cases are {min(cases)}-{max(cases)}")
    c = cases[num]
    if c.dtype != torch.bfloat16:
        raise SystemExit(f"--case {num}: the traced module is bf16 only; case {num} is {bench.DTYPE_NAMES[c.dtype]}")
    variant, block_m = bench.launch_config(c, block_m).split("/")
    if variant not in POINTS:  # the gemv kernels record no timeline
        raise SystemExit(f"--case {num}: the op runs it as {variant} here, whose kernels record no trace (traced: "
                         f"{', '.join(sorted(POINTS))}); --shape with --variant traces those at any shape")
    w1, w2 = bench.WeightCache().get(c)
    w, ids = bench.routings(c)[0][0]
    experts = torch.unique(ids).numel()
    gated, down = 2 * experts * c.model_dim * c.inter_dim * 2, experts * c.model_dim * c.inter_dim * 2
    trace(bench.hidden_states(c), w1, w2, w, ids, int(block_m), variant, calls,
          f"{c.header()} ({variant}/{block_m}; {experts} experts: gated {gated / 1e6:.0f} MB, down {down / 1e6:.0f} MB)",
          phase_bytes=(gated, down))


def trace(x, w1, w2, topk_weights, topk_ids, block_m: int, variant: str, calls: int, title: str,
          phase_bytes: tuple[int, int] | None = None) -> None:
    """Time `calls` calls of the traced module by events and print the last call's points."""
    import hipkern
    from hipkern.ops import _common

    mod = traced_module("fused_moe", "HK_MOE_TRACE", "hk_fused_moe_trace", block_m=block_m)
    with _common.module_override(mod, "fused_moe", torch.cuda.current_device(), dtype="bfloat16",
                                 block_m=block_m):  # the op calls the traced copy
        out = torch.empty_like(x)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
        for start, end in events:
            start.record()
            hipkern.fused_moe(x, w1, w2, topk_weights, topk_ids, block_m=block_m, variant=variant, out=out)
            end.record()
        torch.cuda.synchronize()
        call_us = sorted(s.elapsed_time(e) * 1e3 for s, e in events)[calls // 2]
    buf = (ctypes.c_uint64 * (MAX_BLOCKS * 8))()
    mod.check(mod.hk_fused_moe_trace(ctypes.addressof(buf), MAX_BLOCKS), "fused_moe trace")
    t = torch.tensor(list(buf), dtype=torch.float64).view(MAX_BLOCKS, 8)
    origin = t[:, 0][t[:, 0] > 0].min()
    print(f"{title}: call {call_us:.1f} us by events (points: us from the first block's start; min / p10 / median / "
          "p90 / max over the blocks)")
    q = torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], dtype=torch.float64)
    points = {}
    for i, name in enumerate(POINTS[variant]):
        c = t[:, i][t[:, i] > 0]  # the blocks of the launch that records this point
        if c.numel() == 0:
            continue
        points[name] = v = torch.quantile((c - origin) / 1000.0, q).tolist()
        print(f"  {name:22s} " + " ".join(f"{x:8.2f}" for x in v) + f"   ({c.numel()} blocks)")
    if phase_bytes and variant == "grouped" and len(points) == len(POINTS["grouped"]):
        # gated: from its input (median) to its last block; down: from the gated phase's last block
        # (its input is ready then) to its own last block
        g0, g1, d1 = points["gated: input ready"][2], points["gated: end"][4], points["down: end"][4]
        print(f"  phases: gated {phase_bytes[0] / (g1 - g0) / 1e6:.2f} TB/s over {g1 - g0:.1f} us, "
              f"down {phase_bytes[1] / (d1 - g1) / 1e6:.2f} TB/s over {d1 - g1:.1f} us")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", action="append", help="T,D,I,E,k (repeatable); default: 1 and 4 tokens of "
                    "7168/256 E256 top-8, 1 token of 4096/14336 E8 top-2")
    ap.add_argument("--block-m", type=int, help="block_m of --shape (default 8), and of --case in place of the "
                    "database's choice")
    ap.add_argument("--variant", choices=sorted(POINTS), default="decode")
    ap.add_argument("--case", type=int, action="append", help="a bf16 case of `python -m hipkern.bench moe` "
                    "(repeatable), with its weights, first routing and the database's variant and block_m")
    a = ap.parse_args(argv)
    for num in a.case or []:
        run_case(num, block_m=a.block_m)
    if a.case and not a.shape:
        return
    shapes = a.shape or ["1,7168,256,256,8", "4,7168,256,256,8", "1,4096,14336,8,2"]
    for s in shapes:
        run(*map(int, s.split(",")), block_m=a.block_m or 8, variant=a.variant)


if __name__ == "__main__":
    main()
