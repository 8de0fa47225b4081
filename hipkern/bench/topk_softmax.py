"""topk_softmax against torch (softmax in float32 + topk + renormalise), and the eager overhead."""
from __future__ import annotations

from pathlib import Path

import torch

import hipkern
from hipkern.ops._common import DTYPE_NAMES, module_for, raw_stream
from hipkern.reference import topk_softmax_ref
from hipkern.testing import BenchTable, checkAllclose, run_perftest

from . import COPY_BW_TBPS
from .host_time import per_call

TOKENS = (1, 32, 1024, 16384)
EXPERTS_TOPK = ((8, 2), (64, 8), (256, 8))
DTYPES = (torch.float32, torch.bfloat16)


def torch_topk_softmax(logits, k):
    """What a model does without a fused router: three torch ops."""
    w, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1)
    return w / w.sum(dim=-1, keepdim=True), ids


def eager_overhead(out_dir: Path) -> BenchTable:
    """Host time of one eager call (T=1: the kernel is shorter than the host work, so the loop is
    host-bound), from the raw C launcher up to the public function."""
    x = torch.randn(1, 8, device="cuda")
    w = torch.empty(1, 2, device="cuda")
    i = torch.empty(1, 2, device="cuda", dtype=torch.int32)
    mod = module_for("topk_softmax", 0, dtype="float32")
    xp, wp, ip = x.data_ptr(), w.data_ptr(), i.data_ptr()
    cases = {
        "C launcher via ctypes (floor)": lambda: mod.hk_topk_softmax(xp, wp, ip, 1, 8, 2, 1, 0, raw_stream(0)),
        "torch.ops.hipkern.topk_softmax_out": lambda: torch.ops.hipkern.topk_softmax_out.default(x, 2, True, w, i),
        "torch.ops.hipkern.topk_softmax": lambda: torch.ops.hipkern.topk_softmax.default(x, 2, True),
        "hipkern.topk_softmax(out=...)": lambda: hipkern.topk_softmax(x, 2, out=(w, i)),
        "hipkern.topk_softmax": lambda: hipkern.topk_softmax(x, 2),
        "torch softmax+topk+renorm": lambda: torch_topk_softmax(x, 2),
    }
    table = BenchTable(["Call", "Host_us_per_call", "Wall_us_per_call"],
                       title="# topk_softmax eager overhead (us per call: host, the loop alone; wall, to the sync)")
    for name, fn in cases.items():
        host, wall = per_call(fn, 3000, warmup=100)
        table.add(Call=name, Host_us_per_call=host, Wall_us_per_call=wall)
    table.print()
    table.to_csv(out_dir / "topk_softmax_overhead.csv")
    return table


def main(out_dir: Path, quick: bool = False) -> int:
    iters = 20 if quick else 200
    table = BenchTable(["dtype", "Tokens", "Experts", "TopK", "Naive_Time_us", "Custom_Time_us", "Speedup",
                        "TBps", "Pct_of_copy_BW", "Check"],
                       title="# topk_softmax (Naive: torch softmax fp32 + topk + renormalize)")
    failures = 0
    for dtype in DTYPES:
        for e, k in EXPERTS_TOPK:
            for t in TOKENS:
                torch.manual_seed(t * 1000 + e)
                x = (torch.randn(t, e, device="cuda") * 2).to(dtype)
                ref_w, ref_ids = topk_softmax_ref(x, k, True)
                w, ids = hipkern.topk_softmax(x, k)
                err = checkAllclose(w, ref_w, rtol=1e-5, atol=1e-6,
                                    msg=f"{DTYPE_NAMES[dtype]} T={t} E={e} k={k} ")
                # The ids too, exactly (both rank by the exact logit, ties to the lower expert: the tests' rule)
                if not torch.equal(ids, ref_ids):
                    print(f"{DTYPE_NAMES[dtype]} T={t} E={e} k={k}: ids differ from the reference's", flush=True)
                    err = 1.0
                failures += err != 0
                _, naive_us = run_perftest(torch_topk_softmax, x, k, num_iters=iters)
                _, custom_us = run_perftest(hipkern.topk_softmax, x, k, num_iters=iters)
                nbytes = x.numel() * x.element_size() + t * k * 8
                tbps = nbytes / custom_us / 1e6
                table.add(dtype=DTYPE_NAMES[dtype], Tokens=t, Experts=e, TopK=k, Naive_Time_us=naive_us,
                          Custom_Time_us=custom_us, Speedup=naive_us / custom_us, TBps=tbps,
                          Pct_of_copy_BW=100 * tbps / COPY_BW_TBPS, Check="passed" if err == 0 else "FAILED")
    table.print()
    table.to_csv(out_dir / "topk_softmax.csv")
    eager_overhead(out_dir)
    return failures
