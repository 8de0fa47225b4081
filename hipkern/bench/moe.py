"""fused_moe: the reference log's ten shapes (moe_load_imbalance_mi300.log) in fp32 and bf16, with
uniform and skewed routing, plus Mixtral-8x7B in bf16; per case the log's lines plus bandwidth.

Naive: fused_moe_ref in the input dtype, a per-expert torch loop over the experts that received
tokens (gather, two matmuls, act, index_add_), as in the reference log; it finds those experts on
the host, so its time includes that wait and its launches (host-bound). Custom: hipkern.fused_moe
into a preallocated out=, everything the op does (moe_sorting, both grouped GEMMs, the combine).
Graph: the same calls back to back in one CUDA graph (run_graphtest; whole cycles over the routings, at
least 8 calls), as serving engines replay decode steps: no event or launch gap between calls, so it shows
the kernels' own time without their launch latency (the issue's bars are read from Custom).
Check: custom against the float64 reference (act(gate) * up rounded to bf16 for bf16, as the op
does), the tests' tolerances. Speedup: (naive / custom - 1) * 100, as in the log.

Floor: a plain read of the bytes a call moves (each distinct activated expert's w1 + w2 once, plus the hidden
states in and the output out) in the same harness (bench.floor.read_floor_us), the least any kernel that reads
them takes there.

TB/s (TBps, graph_TBps): over the activated experts' weights alone (weight_MB: each distinct activated expert's
w1 + w2, once), as the issue counts them, against the H100's 3.0 TB/s copy bandwidth.

L2: the weights are never copied. When one call's activated weights exceed 2x L2 (about 100 MB on
the H100: every Mixtral / E=8 case, and the E=256 cases from a few tokens on) consecutive calls cannot
find them in L2 anyway. Below that (8 experts of 256 at one token: 88 MB in bf16) the timed calls
cycle over several routings that pick different experts, so that each call reads its experts from
HBM; the hidden states stay hot, as they are in a model.

Routing "uniform": distinct random experts per token, random positive weights normalised per row.
"skewed": every token to the same k experts (a different set for each routing of the cycle).
"""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

import hipkern
from hipkern import jit
from hipkern.ops._common import DTYPE_NAMES
from hipkern.ops.fused_moe import launch_choice
from hipkern.reference import fused_moe_ref
from hipkern.testing import BenchTable, checkAllclose, l2_bytes, poison, run_graphtest, run_perftest

from . import COPY_BW_TBPS, bars
from .floor import read_floor_us

# The tests' tolerances (tests/moe_cases.py); fp32's is the issue's.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-3), torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}
# (tokens, model_dim, inter_dim, E, topk) of the log's Test 01..10
REFERENCE_SHAPES = ([(t, 7168, 256, 256, 8) for t in (1, 2, 4, 8, 16, 32)]
                    + [(t, 8192, i, 8, 2) for i in (6144, 16384) for t in (32, 128)])
MIXTRAL_SHAPES = [(t, 4096, 14336, 8, 2) for t in (1, 8, 64, 512)]
DTYPE_ALIASES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16}
MAX_ROUTINGS = 16
COLUMNS = ["dtype", "tokens", "model_dim", "inter_dim", "E", "topk", "routing", "naive_us", "custom_us",
           "floor_us", "speedup_pct", "weight_MB", "TBps", "pct_of_copy_bw", "graph_us", "graph_TBps", "config",
           "max_err", "check"]
GRAPH_CALLS = 8  # calls per captured graph, at least


@dataclass(frozen=True)
class Case:
    num: int
    dtype: torch.dtype
    tokens: int
    model_dim: int
    inter_dim: int
    experts: int
    topk: int
    routing: str
    group: str  # "ref" (the log's shapes) or "mixtral"

    @property
    def expert_bytes(self) -> int:
        return 3 * self.model_dim * self.inter_dim * torch.empty((), dtype=self.dtype).element_size()

    def header(self) -> str:
        """The reference log's line (ending at topk=), then the routing on a line of its own."""
        return (f"Test {self.num:02d}: dtype={DTYPE_NAMES[self.dtype]}, token={self.tokens}, "
                f"model_dim={self.model_dim}, inter_dim={self.inter_dim}, E={self.experts}, topk={self.topk}\n"
                f"[perf] routing: {self.routing}")


def all_cases() -> list[Case]:
    """Numbered once, so that Test NN names the same case whatever the filter."""
    cases: list[Case] = []
    for dtype in (torch.float32, torch.bfloat16):
        for routing in ("uniform", "skewed"):
            for shape in REFERENCE_SHAPES:
                cases.append(Case(len(cases) + 1, dtype, *shape, routing, "ref"))
    for shape in MIXTRAL_SHAPES:
        cases.append(Case(len(cases) + 1, torch.bfloat16, *shape, "uniform", "mixtral"))
    return cases


def quick_case(c: Case) -> bool:
    if c.group == "mixtral":
        return c.tokens in (1, 64)
    if c.routing == "skewed":
        return c.dtype == torch.bfloat16 and c.tokens == 32 and c.experts == 256
    return c.tokens in (1, 32)


def select(cases: list[Case], spec: str | None, dtype: str | None, quick: bool) -> list[Case]:
    """--cases: comma-separated test numbers, ranges (3-7) or names (ref, mixtral, uniform, skewed),
    any of which selects a case; --dtype then keeps one dtype. --quick alone: a representative subset."""
    if dtype is not None:
        if dtype not in DTYPE_ALIASES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPE_ALIASES)}, got {dtype!r}")
        cases = [c for c in cases if c.dtype == DTYPE_ALIASES[dtype]]
    if not spec:
        return [c for c in cases if quick_case(c)] if quick else cases
    keep, last = set(), len(all_cases())
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        if re.fullmatch(r"\d+(-\d+)?", item):
            lo, _, hi = item.partition("-")
            lo, hi = int(lo), int(hi or lo)
            if not 1 <= lo <= hi <= last:
                raise ValueError(f"--cases: {item!r} is not a test number or a range a-b within 1-{last}")
            keep |= {c.num for c in cases if lo <= c.num <= hi}
        elif item in ("ref", "mixtral"):
            keep |= {c.num for c in cases if c.group == item}
        elif item in ("uniform", "skewed"):
            keep |= {c.num for c in cases if c.routing == item}
        else:
            raise ValueError(f"--cases: {item!r} is not a test number, a range a-b, or one of ref, mixtral, "
                             "uniform, skewed")
    chosen = [c for c in cases if c.num in keep]
    if not chosen:
        raise ValueError(f"--cases {spec}" + (f" with --dtype {dtype}" if dtype else "") + " selects no case")
    return chosen


class WeightCache:
    """The weights of the last (E, D, I, dtype): consecutive cases share them; a new shape frees them
    first (the largest, E=8 x 8192 x 16384 fp32, is 12.9 GB)."""

    def __init__(self):
        self.key, self.weights = None, None

    def get(self, c: Case):
        key = (c.experts, c.model_dim, c.inter_dim, c.dtype)
        if key != self.key:
            self.key, self.weights = None, None
            torch.cuda.empty_cache()
            g = torch.Generator(device="cuda").manual_seed(c.model_dim * 7 + c.inter_dim)
            w1 = torch.empty(c.experts, 2 * c.inter_dim, c.model_dim, dtype=c.dtype, device="cuda")
            w2 = torch.empty(c.experts, c.model_dim, c.inter_dim, dtype=c.dtype, device="cuda")
            for e in range(c.experts):  # per expert: no generator call over 2^31 elements
                w1[e].normal_(0.0, c.model_dim ** -0.5, generator=g)
                w2[e].normal_(0.0, c.inter_dim ** -0.5, generator=g)
            self.key, self.weights = key, (w1, w2)
        return self.weights


def routings(c: Case):
    """(topk_weights, topk_ids) sets for the timed calls to cycle over (see the module doc on L2), and
    the mean activated weight bytes of one call."""
    g = torch.Generator(device="cuda").manual_seed(c.num)
    skew_order = torch.randperm(c.experts, generator=g, device="cuda")

    def one(s):
        if c.routing == "uniform":
            scores = torch.rand(c.tokens, c.experts, generator=g, device="cuda")
            ids = scores.topk(c.topk, dim=1).indices
        else:
            start = s * c.topk % max(1, c.experts - c.topk + 1)
            ids = skew_order[start:start + c.topk].repeat(c.tokens, 1)
        w = torch.rand(c.tokens, c.topk, generator=g, device="cuda") + 0.1
        return w / w.sum(dim=1, keepdim=True), ids.to(torch.int32).contiguous()

    def activated(ids):
        return torch.unique(ids).numel() * c.expert_bytes

    sets = [one(0)]
    first = activated(sets[0][1])
    target = 2 * l2_bytes()
    if 0 < first < target:
        sets += [one(s) for s in range(1, min(MAX_ROUTINGS, math.ceil(target / first) + 1))]
    return sets, sum(activated(ids) for _, ids in sets) / len(sets)


def timed(fn, sets, iters: int, warmup: int) -> float:
    """Median device us of fn(*sets[i % len(sets)]): run_perftest's own argument copies and L2 flush
    are off (rotate_bytes=0); the cycle over `sets` is what keeps each call's weights out of L2."""
    calls = itertools.count()

    def step():
        return fn(*sets[next(calls) % len(sets)])

    _, us = run_perftest(step, num_iters=iters, num_warmup=warmup, rotate_bytes=0)
    return us


def graph_timed(fn, sets, iters: int) -> float:
    """Median device us per call of fn over `sets` replayed as one CUDA graph cycling over them, of the
    fewest whole cycles that make at least GRAPH_CALLS calls, so that replays continue the cycle and a routing
    comes back only after every other one (the Graph column; see the module doc)."""
    calls = itertools.count()

    def step():
        return fn(*sets[next(calls) % len(sets)])

    _, us = run_graphtest(step, num_iters=iters, max_copies=len(sets) * math.ceil(GRAPH_CALLS / len(sets)))
    return us


def launch_config(c: Case, block_m: int | None) -> str:
    """What the op runs for this case: "variant/block_m" (launch_choice, the op's own decision)."""
    variant, bm = launch_choice(torch.cuda.current_device(), c.tokens, c.model_dim, c.inter_dim, c.experts, c.topk,
                                c.dtype, block_m or 0)
    return f"{variant}/{bm}"


def hidden_states(c: Case) -> torch.Tensor:
    """The case's hidden states [tokens, model_dim] (seeded by the case number)."""
    g = torch.Generator(device="cuda").manual_seed(c.num + 1000)
    return torch.randn(c.tokens, c.model_dim, generator=g, device="cuda", dtype=c.dtype)


def check_routings(custom, out: torch.Tensor, sets: list, x, w1, w2) -> tuple:
    """(checkAllclose's worst share, the largest |error|) of custom(w, ids) into a NaN-poisoned `out` against
    the float64 reference, over every routing the case was timed on: a kernel wrong for some experts' ids
    only must fail its row, however fast it was."""
    err, errs, worst = -1.0, [0.0], None
    for w, ids in sets:
        poison(out)
        got = custom(w, ids)
        ref = fused_moe_ref(x, w1, w2, w, ids, compute_dtype=torch.float64,
                            intermediate_dtype=None if x.dtype == torch.float32 else x.dtype)
        share = checkAllclose(got, ref, printLog=False, **TOL[x.dtype])
        if share > err:
            err, worst = share, (got.clone(), ref)
        if ref.numel():
            errs.append(float((got.double() - ref).abs().max()))
        del ref
    if len(sets) > 1:
        print(f"[perf] checked {len(sets)} routings (the line below: the worst)", flush=True)
    checkAllclose(*worst, **TOL[x.dtype])  # the reference log's one line a case
    return err, max(errs, key=lambda v: (v != v, v))  # (a NaN, an unwritten element, shows)


def bench_case(c: Case, table: BenchTable, cache: WeightCache, iters: int, naive_iters: int,
               block_m: int | None = None) -> bool:
    """Print the case's lines, add its row; True when the check failed."""
    print(c.header(), flush=True)
    w1, w2 = cache.get(c)
    sets, weight_bytes = routings(c)
    x = hidden_states(c)
    out = torch.empty_like(x)

    def custom(w, ids):
        return hipkern.fused_moe(x, w1, w2, w, ids, out=out, block_m=block_m)

    def naive(w, ids):
        return fused_moe_ref(x, w1, w2, w, ids, compute_dtype=c.dtype)

    naive_us = timed(naive, sets, naive_iters, 1)
    custom_us = timed(custom, sets, iters, 10)
    graph_us = graph_timed(custom, sets, max(3, iters // 5))
    speedup = (naive_us / custom_us - 1) * 100
    print(f"[perf] naive moe: {naive_us:.2f} us")
    print(f"[perf] custom moe: {custom_us:.2f} us")
    print(f"[perf] speedup {speedup:.2f}%")
    print(f"[perf] custom moe, CUDA-graph replay: {graph_us:.2f} us")

    err, max_err = check_routings(custom, out, sets, x, w1, w2)

    nbytes = weight_bytes + 2 * x.numel() * x.element_size()  # what the call moves: the floor reads all of it
    tbps = weight_bytes / custom_us / 1e6  # the issue's rate: over the activated experts' weights alone
    floor_us = read_floor_us(nbytes, num_iters=iters)
    print(f"[perf] custom moe bandwidth: {tbps:.3f} TB/s over the activated experts' w1+w2, "
          f"{weight_bytes / 1e6:.1f} MB, each once (the hidden states in and out, {(nbytes - weight_bytes) / 1e6:.1f} "
          f"MB, not counted), {100 * tbps / COPY_BW_TBPS:.1f}% of {COPY_BW_TBPS:.1f} TB/s"
          + (f"; timed over {len(sets)} routings" if len(sets) > 1 else ""), flush=True)
    print(f"[perf] read floor: {floor_us:.2f} us (a plain read of those bytes in this harness; custom / floor "
          f"{custom_us / floor_us:.3f})", flush=True)
    table.add(dtype=DTYPE_NAMES[c.dtype], tokens=c.tokens, model_dim=c.model_dim, inter_dim=c.inter_dim,
              E=c.experts, topk=c.topk, routing=c.routing, naive_us=naive_us, custom_us=custom_us,
              floor_us=floor_us, speedup_pct=speedup, weight_MB=weight_bytes / 1e6, TBps=tbps,
              pct_of_copy_bw=100 * tbps / COPY_BW_TBPS, graph_us=graph_us, graph_TBps=weight_bytes / graph_us / 1e6,
              config=launch_config(c, block_m),
              max_err=f"{max_err:.3g}", check="passed" if err == 0 else "FAILED")
    return err != 0


def summary(table: BenchTable, nums: list[int]) -> str:
    head = (f"{'Test':>4} {'dtype':>8} {'T':>4} {'D':>5} {'I':>5} {'E':>3} {'k':>1} {'routing':>7} "
            f"{'naive_us':>10} {'custom_us':>10} {'floor_us':>9} {'speedup%':>9} {'TB/s':>6} {'%copy':>6} "
            f"{'graph_us':>9} {'variant/bm':>11} check")
    lines = [f"# fused_moe summary ({torch.cuda.get_device_name()})", head]
    for n, r in zip(nums, table.rows):
        lines.append(f"{n:>4} {r['dtype']:>8} {r['tokens']:>4} {r['model_dim']:>5} {r['inter_dim']:>5} {r['E']:>3} "
                     f"{r['topk']:>1} {r['routing']:>7} {r['naive_us']:>10.1f} {r['custom_us']:>10.1f} "
                     f"{r['floor_us']:>9.1f} {r['speedup_pct']:>9.1f} {r['TBps']:>6.3f} {r['pct_of_copy_bw']:>6.1f} "
                     f"{r['graph_us']:>9.1f} {r['config']:>11} {r['check']}")
    return "\n".join(lines)


def main(out_dir: Path, quick: bool = False, cases: str | None = None, dtype: str | None = None,
         block_m: int | None = None) -> int:
    chosen = select(all_cases(), cases, dtype, quick)
    iters, naive_iters = (10, 2) if quick else (50, 5)
    table = BenchTable(COLUMNS, title="# fused_moe (Naive: per-expert torch loop in the input dtype)",
                       decimals={"TBps": 3, "graph_TBps": 3})  # (the bars' rates: 2.395 is not 2.40)
    cache = WeightCache()
    failures = 0
    print("Problem: Load imbalance")
    for c in chosen:
        failures += bench_case(c, table, cache, iters, naive_iters, block_m)
    del cache
    torch.cuda.empty_cache()
    path = table.to_csv(out_dir / "moe.csv")
    print(f"\n{summary(table, [c.num for c in chosen])}\n(CSV: {path})", flush=True)
    archs = jit.platform.built_and_device_arch(torch.cuda.current_device())
    report = bars.device_lines(torch.cuda.get_device_name(), *archs) + bars.moe(table.rows)
    print("\n".join(report), flush=True)
    return failures
