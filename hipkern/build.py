"""Prebuild every module: ``python -m hipkern.build [--arch gfx942|sm_90|...] [--jobs N]``.

Uses the same builder as the first call of an op (same cache, same keys), so a prebuilt cache is
what ops load. Prints per kernel and target the registers/VGPRs, shared memory/LDS, spills and local
memory (stack frame / scratch), and exits non-zero if any module fails to build or to load.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait

from . import jit
from .jit.toolchain import local_bytes


def _short(name: str, width: int = 88) -> str:
    name = name.replace("hk::", "").replace("(hk::topk_softmax::Args)", "")
    return name if len(name) <= width else name[: width - 3] + "..."


def select(only) -> list:
    """The module specs `--only` selects: those whose name contains any of the patterns (all without one)."""
    return [s for s in jit.all_specs() if not only or any(o in s.name for o in only)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hipkern.build", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", action="append", help="target arch (repeatable); default: HIPKERN_ARCH, else this GPU's")
    ap.add_argument("--only", action="append",
                    help="build only the modules whose name contains this (repeatable: any of them)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiler processes")
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    ap.add_argument("--prune", action="store_true",
                    help="then remove the selected modules' builds under other keys than the current ones (older "
                         "sources, compilers, flags; also another install's, if it shares the cache)")
    args = ap.parse_args(argv)
    try:
        archs = [jit.platform.check_arch(a) for a in args.arch] if args.arch else [jit.current_arch()]
    except jit.JitError as e:  # no GPU and no --arch, or a misspelt one: one line, not a traceback
        hint = "" if args.arch else " (pass --arch, e.g. --arch gfx942 --arch sm_90)"
        print(f"python -m hipkern.build: error: {e}{hint}", file=sys.stderr)
        return 2
    specs = select(args.only)
    if not specs:
        print(f"no module matches --only {' / '.join(args.only)}", file=sys.stderr)
        return 2
    failures = 0
    for arch in archs:
        t0 = time.perf_counter()
        pool = ThreadPoolExecutor(max(1, args.jobs))
        futures = [(s, pool.submit(jit.build, s, arch, args.force)) for s in specs]
        try:
            wait([f for _, f in futures])
        except KeyboardInterrupt:  # Ctrl-C: no queued module starts (the running compilers got the signal too)
            pool.shutdown(wait=False, cancel_futures=True)
            print("python -m hipkern.build: interrupted; no queued module starts (running compilers stop with "
                  "the signal, or finish first if only this process got it)", file=sys.stderr)
            return 130
        pool.shutdown()
        print(f"== {arch}: {len(specs)} modules ==")
        for spec, fut in futures:
            try:
                res = fut.result()
                jit.builder.load_built(spec, arch, res)  # it must load (dlopen + ABI check)
            except Exception as e:  # report every module, then fail
                failures += 1
                print(f"FAILED {spec.name} [{arch}]: {e}")
                continue
            how = f"built in {res.seconds:.1f}s" if res.built else "cached"
            print(f"{spec.name} [{arch}]: {how} -> {res.path}")
            reg = "VGPRs" if jit.platform_of(arch) == "rocm" else "regs"
            shm = "LDS" if jit.platform_of(arch) == "rocm" else "smem"
            spill = "VGPRspill" if jit.platform_of(arch) == "rocm" else "spills(B)"
            # Local memory: a stack frame (CUDA) or scratch per lane (ROCm) beyond the spills is a register
            # array indexed at run time (or a spill the count above misses).
            stack = "scratch(B)" if jit.platform_of(arch) == "rocm" else "stack(B)"
            print(f"    {reg:>5} {shm + '(B)':>8} {spill:>12} {stack:>10}  kernel")
            for k in res.resources:
                print(f"    {k['regs']:>5} {k['shared_bytes']:>8} {k['spills']:>12} {local_bytes(k):>10}  "
                      f"{_short(k['kernel'])}")
        print(f"== {arch}: done in {time.perf_counter() - t0:.1f}s, {failures} failures so far ==")
        if args.prune:
            gone = jit.builder.prune(specs, arch)
            print(f"== {arch}: pruned {len(gone)} cache entries of older builds ==")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
