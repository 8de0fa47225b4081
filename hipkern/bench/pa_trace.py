"""Timeline of paged_attention_decode's matrix-core blocks (a diagnostic, NVIDIA only).

``python -m hipkern.bench.pa_trace [--shape B,CTX,HQ,HKV,D] [--variant v16|v6|v5] [--calls 20]``
builds a separate copy of the bf16 paged-attention module with ``HK_PA_TRACE`` defined, in which
thread 0 of every block records ``%globaltimer`` at the points of common.h (start, context length
known, first tile in shared memory, loop done, states merged, cluster barrier passed, end). Each call
runs on the benchmark's inputs (block size 16, random block tables) with L2 flushed before it, as the
benchmark times small shapes. Per point it prints the median over the calls of the minimum, 10th
percentile, median, 90th percentile and maximum over the blocks, in microseconds from the call's
earliest block start (time the calls themselves with the benchmark: the trace's stores are not free).
``%globaltimer`` ticks in steps of 32 ns to 1 us depending on the GPU (0.256 us on the H100s here):
read the spread, not the last digit. The merge kernel of split
launches that do not merge in clusters is not traced. The library's own modules are never built with
the define.
"""
from __future__ import annotations

import argparse
import ctypes

import torch

from hipkern.bench import traced_module

POINTS = ("start", "context length known", "first tile in smem", "loop done", "states merged",
          "cluster barrier passed", "end")
MAX_BLOCKS, NUM_POINTS = 4096, 8  # the trace table (common.h: kTraceBlocks, kTracePoints)


def run(batch: int, ctx: int, hq: int, hkv: int, d: int, variant: str | None = None, calls: int = 20) -> dict:
    """Trace `calls` calls of this shape; prints the points and returns {point: [min, p10, median, p90,
    max]} (us) for the points the launch records."""
    import hipkern
    from hipkern.bench.paged_attention import make_inputs
    from hipkern.ops import _common
    from hipkern.ops.paged_attention import VARIANTS, choose_variant
    from hipkern.testing import l2_bytes

    if torch.version.cuda is None:
        raise SystemExit("pa_trace: the traced build is NVIDIA only")
    q, k, v, bt, cl = make_inputs([ctx] * batch, hq, hkv, d)
    chosen = variant or "{}{}".format(*choose_variant(q, k, bt, "NHD"))
    if VARIANTS[chosen.split("{")[0]].kernel == "simt":
        raise SystemExit(f"pa_trace: {chosen} runs the CUDA-core kernel, which records no points (matrix-core "
                         "variants only: v16, v6, v5)")
    mod = traced_module("paged_attention", "HK_PA_TRACE", "hk_paged_attention_trace", head_size=d)
    flush = torch.ones(2 * l2_bytes() // 4, dtype=torch.int32, device="cuda")
    buf = (ctypes.c_uint64 * (MAX_BLOCKS * NUM_POINTS))()
    rows = []
    with _common.module_override(mod, "paged_attention", torch.cuda.current_device(), dtype="bfloat16",
                                 head_size=d):  # the op calls the traced copy
        out = torch.empty_like(q)
        for i in range(calls + 2):  # two warm-up calls (build, first-use costs)
            flush.sum()
            hipkern.paged_attention_decode(q, k, v, bt, cl, out=out, variant=variant)
            torch.cuda.synchronize()
            mod.check(mod.hk_paged_attention_trace(ctypes.addressof(buf), MAX_BLOCKS), "paged_attention trace")
            if i < 2:
                continue
            t = torch.tensor(list(buf), dtype=torch.float64).view(MAX_BLOCKS, NUM_POINTS)
            t = t[t[:, 0] > 0]
            rows.append((t - t[:, 0].min()) / 1000.0)
    print(f"{batch} x {ctx}, {hq} q / {hkv} kv heads of {d} ({chosen}; {rows[0].shape[0]} blocks; points: us from "
          "the first block's start, the median over the calls of min / p10 / median / p90 / max over the blocks)")
    q5 = torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], dtype=torch.float64)
    table = {}
    for i, name in enumerate(POINTS):
        per_call = []
        for r in rows:
            c = r[:, i][r[:, i] >= 0] if i == 0 else r[:, i][r[:, i] > 0]
            if c.numel():
                per_call.append(torch.quantile(c, q5))
        if per_call:
            table[name] = v = torch.stack(per_call).median(dim=0).values.tolist()
            print(f"  {name:24s} " + " ".join(f"{x:8.2f}" for x in v))
    return table


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", action="append", help="B,CTX,HQ,HKV,D (repeatable); default: 1,256,64,1,256 "
                    "and 1,256,64,8,128")
    ap.add_argument("--variant", default=None, choices=("v16", "v6", "v5"), help="a matrix-core variant with its "
                    "default parameters (default: the tuning database's choice)")
    ap.add_argument("--calls", type=int, default=20)
    a = ap.parse_args(argv)
    for s in a.shape or ["1,256,64,1,256", "1,256,64,8,128"]:
        run(*map(int, s.split(",")), variant=a.variant, calls=a.calls)


if __name__ == "__main__":
    main()
