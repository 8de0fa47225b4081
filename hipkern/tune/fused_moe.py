"""The tuner's adapter for fused_moe (hipkern/ops/fused_moe.py): variant and block_m per shape.

Candidates: every block_m the dtype offers (block_ms_for), each as "grouped" and, where it fits
(decode_fits: few routed pairs), as "decode"; "gemv" (and for 16-bit types "gemv_mma") once where it
fits (gemv_fits; block_m 8, which they ignore); the heuristic default (default_block_m with
choose_variant's variant, what the op runs without a row) first. Inputs: one set of expert weights
per (dtype, model_dim, inter_dim, num_experts), reused by that group's token counts (largest
first); uniform routing (distinct random experts per token, as a router gives), random positive
weights normalised per row. The weights are no argument of the timed
call, so run_perftest flushes L2 before each call: every call streams its activated experts from
memory, as in a model. Bytes: the distinct activated experts' w1 + w2, plus hidden in and out.
Checked: every token against the float64 reference, at the tests' tolerances (the first 16 tokens only, before
2026-11-29: most of an expert's row blocks went unchecked, and a candidate wrong past them could be chosen).

Each candidate is also timed with skewed routing (`skewed_us`: every token routed to the first
token's k experts, the issue's "all tokens to the same k experts"). The database then takes, among
the candidates within 4 % of the fastest under uniform routing (core.SECOND_WINDOW), one that is
faster under skewed routing by more than the 2 % margin (core.prefer_default): a block_m that holds an expert's
tokens in one m-block reads its weights once however the routing piles up, at about the uniform
cost (H100: bf16 DeepSeek-like 32 tokens, grouped/32 against grouped/8: 632 against 639 us uniform,
75 against 141 us skewed; csrc_hip/fused_moe/NOTES.md).
"""
from __future__ import annotations

import contextlib

import torch

from .. import tuning_db
from ..ops.fused_moe import (VARIANT, block_ms_for, choose_variant, decode_fits, default_block_m, fused_moe,
                              gemv_fits, gemv_variants)
from ..ops.moe_sorting import MAX_EXPERTS
from ..reference import fused_moe_ref
from ..testing import poison
from .core import Candidate, Pruned, WrongResult, arch_info, gpu_info, output_errors, perftest_us

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOL = {"float32": dict(atol=1e-5, rtol=1e-3), "bfloat16": dict(atol=1e-2, rtol=1e-2),
       "float16": dict(atol=2e-3, rtol=2e-3)}  # tests/moe_cases.py
# Timing budget (as in the paged-attention adapter): a candidate's timed pass aims at TIMING_US.
TIMING_US, MIN_ITERS, MAX_ITERS = 8000.0, 3, 50
HOST_US, FLUSH_US, SLEEP, EST_BYTES_PER_US = 150.0, 40.0, 2.2, 2.0e6
SHAPE_OVERHEAD_S = 0.05


class FusedMoeTuner:
    op = "fused_moe"
    device_info = staticmethod(gpu_info)
    info_for = staticmethod(arch_info)

    def __init__(self):
        self._weights = None  # (group, w1, w2): the last weights made, reused by their group

    @property
    def schema(self):
        return tuning_db._schemas[self.op]

    def parse_shape(self, raw) -> dict:
        s = {"dtype": str(raw["dtype"]).strip()}
        if s["dtype"] not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {s['dtype']!r}")
        for k in ("model_dim", "inter_dim", "num_experts", "topk", "tokens"):
            v = str(raw[k]).strip()
            if not v.isdigit() or int(v) < 1:
                raise ValueError(f"{k} must be a positive integer, got {raw[k]!r}")
            s[k] = int(v)
        vec = 16 // DTYPES[s["dtype"]].itemsize
        if s["model_dim"] % vec or s["inter_dim"] % vec:
            raise ValueError(f"model_dim and inter_dim must be multiples of {vec} for {s['dtype']}")
        if s["num_experts"] > MAX_EXPERTS or s["topk"] > s["num_experts"]:
            raise ValueError(f"num_experts must be at most {MAX_EXPERTS} and topk at most num_experts, "
                             f"got {s['num_experts']} and {s['topk']}")
        return s

    def describe(self, s) -> str:
        return f"{s['dtype']} D{s['model_dim']} I{s['inter_dim']} E{s['num_experts']} top{s['topk']} T{s['tokens']}"

    def order(self, s) -> tuple:  # weights are per group; largest first
        return (s["dtype"], s["model_dim"], s["inter_dim"], s["num_experts"], s["topk"], -s["tokens"])

    def heuristic(self, s, info=None) -> Candidate:  # the same on every GPU
        dtype = DTYPES[s["dtype"]]
        bm = default_block_m(s["tokens"], s["topk"], s["num_experts"], dtype)
        variant = choose_variant(s["tokens"], s["topk"], dtype, bm, s["num_experts"], s["model_dim"], s["inter_dim"])
        return Candidate.of(variant, block_m=8 if variant == "gemv" else bm)

    def candidates(self, s, info) -> Pruned:
        first = self.heuristic(s, info)
        dims = (s["model_dim"], s["inter_dim"])
        rest = [Candidate.of(v, block_m=b) for b in block_ms_for(DTYPES[s["dtype"]])
                for v in (VARIANT, "decode") if v == VARIANT or decode_fits(s["tokens"], s["topk"], b, *dims)]
        if gemv_fits(s["tokens"], s["topk"], s["model_dim"], s["inter_dim"]):
            rest += [Candidate.of(v, block_m=8) for v in gemv_variants(DTYPES[s["dtype"]])]
        return Pruned([first] + [c for c in rest if c != first])

    @staticmethod
    def active_experts(s) -> float:
        """Expected distinct experts under uniform routing (for estimates)."""
        e, picks = s["num_experts"], s["tokens"] * s["topk"]
        return e * (1 - (1 - 1 / e) ** picks)

    def estimate_kernel_us(self, s) -> float:
        el = DTYPES[s["dtype"]].itemsize
        return max(20.0, self.active_experts(s) * 3 * s["model_dim"] * s["inter_dim"] * el / EST_BYTES_PER_US)

    @staticmethod
    def iterations(kernel_us: float) -> tuple:
        per_call = max(kernel_us + FLUSH_US, HOST_US)
        return int(min(MAX_ITERS, max(MIN_ITERS, round(TIMING_US / per_call)))), (1 if kernel_us > 1000 else 3)

    def estimate_s(self, s, cands, info) -> float:
        t = self.estimate_kernel_us(s)
        iters, warmup = self.iterations(t)
        per_cand = 2 * ((1 + warmup) * t + (2 + SLEEP) * iters * max(t + FLUSH_US, HOST_US))  # uniform, skewed
        return SHAPE_OVERHEAD_S + len(cands) * per_cand / 1e6

    def _expert_weights(self, s, device):
        group = (s["dtype"], s["model_dim"], s["inter_dim"], s["num_experts"], device)
        if self._weights is not None and self._weights[0] == group:
            return self._weights[1], self._weights[2]
        self._weights = None
        torch.cuda.empty_cache()
        dtype, e, d, i = DTYPES[s["dtype"]], s["num_experts"], s["model_dim"], s["inter_dim"]
        g = torch.Generator(device=f"cuda:{device}").manual_seed(1)
        w1 = torch.randn((e, 2 * i, d), generator=g, device=f"cuda:{device}", dtype=dtype).mul_(d ** -0.5)
        w2 = torch.randn((e, d, i), generator=g, device=f"cuda:{device}", dtype=dtype).mul_(i ** -0.5)
        self._weights = (group, w1, w2)
        return w1, w2

    def prepare(self, s, info, device) -> "_Bench":
        w1, w2 = self._expert_weights(s, device)
        return _Bench(s, w1, w2, device, self.estimate_kernel_us(s))


class _Bench:
    """One shape's tokens and routing on the GPU, the reference of its first tokens, timing."""

    def __init__(self, s, w1, w2, device, kernel_us):
        dev, dtype = f"cuda:{device}", DTYPES[s["dtype"]]
        t, e, k = s["tokens"], s["num_experts"], s["topk"]
        g = torch.Generator(device=dev).manual_seed(t * 1_000_003 + e)
        self.w1, self.w2 = w1, w2
        self.x = torch.randn((t, s["model_dim"]), generator=g, device=dev, dtype=dtype)
        self.ids = torch.rand((t, e), generator=g, device=dev).topk(k, dim=1).indices.to(torch.int32)
        self.skewed_ids = self.ids[:1].expand(t, k).contiguous()  # every token to token 0's experts
        tw = torch.rand((t, k), generator=g, device=dev) + 0.1
        self.tw = tw / tw.sum(dim=1, keepdim=True)
        self.out = torch.empty_like(self.x)
        active = torch.unique(self.ids).numel()
        self.nbytes = active * 3 * s["model_dim"] * s["inter_dim"] * dtype.itemsize + 2 * self.x.nbytes
        self.tol = TOL[s["dtype"]]
        self.iters, self.warmup = FusedMoeTuner.iterations(kernel_us)
        inter = None if dtype == torch.float32 else dtype  # (512 tokens of 8192 x 16384: ~1 TFLOP of float64)
        self.ref = fused_moe_ref(self.x, w1, w2, self.tw, self.ids, compute_dtype=torch.float64,
                                 intermediate_dtype=inter)
        self.skewed_ref = fused_moe_ref(self.x, w1, w2, self.tw, self.skewed_ids, compute_dtype=torch.float64,
                                        intermediate_dtype=inter)
        self.block_m = self.variant = None

    @contextlib.contextmanager
    def use(self, cand: Candidate):
        self.block_m, self.variant = cand.kwargs["block_m"], cand.variant
        try:
            yield
        finally:
            self.block_m = self.variant = None

    def new_output(self):
        return torch.empty_like(self.x)

    def call(self, out):
        fused_moe(self.x, self.w1, self.w2, self.tw, self.ids, out=out, block_m=self.block_m, variant=self.variant)

    def checked(self, out):
        return out, self.ref

    def time_us(self) -> float:
        return self._time(self.ids)

    def time_measures(self) -> dict:
        """skewed_us: time_us with every token routed to the same k experts (fewer bytes: the same
        timing budget is ample), after one call checked as core.measure checks the uniform one (a
        candidate wrong only under skewed routing is rejected: measure() records the WrongResult)."""
        out = poison(torch.empty_like(self.x))
        fused_moe(self.x, self.w1, self.w2, self.tw, self.skewed_ids, out=out, block_m=self.block_m,
                  variant=self.variant)
        bad, err = output_errors(out, out, self.skewed_ref, self.tol)
        if bad or err > 0:
            raise WrongResult(f"skewed routing: {bad} non-finite output elements (NaN-poisoned output), "
                              f"checkAllclose mismatch on {err:.2%} of the checked elements")
        return {"skewed_us": self._time(self.skewed_ids)}

    def _time(self, ids) -> float:
        w1, w2, bm, var = self.w1, self.w2, self.block_m, self.variant

        def call(x, tw, ids, out):
            return fused_moe(x, w1, w2, tw, ids, out=out, block_m=bm, variant=var)

        return perftest_us(call, self.x, self.tw, ids, self.out, iters=self.iters, warmup=self.warmup, max_copies=1)


ADAPTER = FusedMoeTuner()
