from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

from . import moe, paged_attention, topk_softmax

BENCHES = {"moe": moe.main, "paged_attention": paged_attention.main, "topk_softmax": topk_softmax.main}
EXTRA = {"paged_attention_sweep": paged_attention.sweep}  # not part of "all"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hipkern.bench", description="hipkern benchmarks")
    ap.add_argument("which", nargs="*", default=["all"],
                    help=f"all, or some of {sorted(BENCHES)} (also {sorted(EXTRA)}, not in all)")
    ap.add_argument("--out", default="bench_results", help="directory for the CSV files")
    ap.add_argument("--quick", action="store_true", help="fewer timing iterations (smoke run)")
    ap.add_argument("--cases", default=None,
                    help="moe: comma-separated test numbers, ranges (3-7) or names (ref, mixtral, uniform, skewed)")
    ap.add_argument("--dtype", default=None, choices=sorted(moe.DTYPE_ALIASES), help="moe: one dtype only")
    ap.add_argument("--block-m", type=int, default=None, choices=(8, 16, 32, 64, 128),
                    help="moe: pin fused_moe's block_m (default: its automatic choice; 128: 16-bit types)")
    args = ap.parse_args(argv)
    import torch  # (loaded already: the moe benchmark imports it)

    options = {"cases": args.cases, "dtype": args.dtype, "block_m": args.block_m}
    # "all" is every benchmark of BENCHES; names of EXTRA beside it still run (after them); each name once
    names = list(dict.fromkeys(sorted(BENCHES) + [n for n in args.which if n != "all" and n not in BENCHES]
                               if "all" in args.which else args.which))
    unknown = [n for n in names if n not in BENCHES and n not in EXTRA]
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; choose from {sorted(BENCHES)}, {sorted(EXTRA)} or all")
    given = [f"--{k.replace('_', '-')}" for k, v in options.items() if v is not None]
    if given and "moe" not in names:
        ap.error(f"{', '.join(given)}: options of the moe benchmark, which this run does not include")
    if "moe" in names:  # the selection, checked before any GPU work
        try:
            chosen = moe.select(moe.all_cases(), args.cases, args.dtype, args.quick)
        except ValueError as e:
            ap.error(str(e))
        if args.block_m == 128 and any(c.dtype == torch.float32 for c in chosen):
            ap.error("--block-m 128: fused_moe offers block_m 128 for 16-bit types only, and the selected moe cases "
                     "include float32 (add --dtype bf16, or choose bf16 cases)")
    if not torch.cuda.is_available():
        print("hipkern.bench needs a GPU visible to torch", file=sys.stderr)
        return 2
    from . import device_line

    print(device_line(), flush=True)
    failures = 0
    for n in names:
        fn = {**BENCHES, **EXTRA}[n]
        accepted = inspect.signature(fn).parameters  # per-bench options go to the benches that take them
        failures += fn(Path(args.out), quick=args.quick,
                       **{k: v for k, v in options.items() if k in accepted and v is not None})
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
