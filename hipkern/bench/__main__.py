from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import paged_attention, topk_softmax

BENCHES = {"paged_attention": paged_attention.main, "topk_softmax": topk_softmax.main}
EXTRA = {"paged_attention_sweep": paged_attention.sweep}  # not part of "all"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hipkern.bench", description="hipkern benchmarks")
    ap.add_argument("which", nargs="*", default=["all"], help=f"all, or some of {sorted(BENCHES)}")
    ap.add_argument("--out", default="bench_results", help="directory for the CSV files")
    ap.add_argument("--quick", action="store_true", help="fewer timing iterations (smoke run)")
    args = ap.parse_args(argv)
    names = sorted(BENCHES) if "all" in args.which else args.which
    unknown = [n for n in names if n not in BENCHES and n not in EXTRA]
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; choose from {sorted(BENCHES)} or all")
    import torch

    if not torch.cuda.is_available():
        print("hipkern.bench needs a GPU visible to torch", file=sys.stderr)
        return 2
    failures = 0
    for n in names:
        failures += {**BENCHES, **EXTRA}[n](Path(args.out), quick=args.quick)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
