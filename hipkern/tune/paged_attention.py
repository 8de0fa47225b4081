"""The tuner's adapter for paged-attention decode (hipkern.ops.paged_attention).

Candidates: every variant of VARIANTS with its default parameters, plus the PARAM_GRID values below;
a variant PARAM_GRID does not name gets its defaults only, so a variant added to VARIANTS is tuned
without touching this file. The heuristic default (HEURISTIC_VARIANT) comes first. Two candidates
with the same launch (kernel, heads per block, Plan) are timed once, under the first name. A split
candidate is dominated, and dropped, when a coarser split of the same kernel already gives the grid
FILL_BLOCKS_PER_SM blocks per SM: more partitions then only add merge traffic. The launch of every
variant's default is always timed (the report compares tuned against each of them).

Inputs: one KV pool per (dtype, block size, KV heads, head size, layout), reused across shapes, of
min(needed, POOL_MAX_BYTES) (at least POOL_MIN_BYTES, far above L2): batch 256 x 65536 tokens would
need 68 GB and more. Block tables are random: distinct blocks when the pool holds enough, else drawn
with repetition (blocks repeat within and across sequences; with an 8 GiB pool and L2 flushed before
each timed call, repeats are re-read from memory like distinct blocks). Every sequence's length is
the context bucket. Bytes: the K and V rows read plus Q and O.
"""
from __future__ import annotations

import contextlib
import math

import torch

from .. import tuning_db
from ..ops import paged_attention as pa
from ..reference import paged_attention_ref
from ..testing import rows_scaled
from .core import Candidate, Pruned, arch_info, dedupe, gpu_info, perftest_us

PARAM_GRID = {
    "v3": {"partition_size": [256, 1024, 2048, 4096, 8192, 16384, 65536]},
    "v9": {"partition_size": [128, 256, 1024, 2048, 4096, 8192]},
    "v16": {"partition_size": [128, 256, 512, 1024, 2048, 4096, 8192, 65536]},
    "v5": {"blocks_per_slot": [2, 3], "partition_size": [64, 256, 512]},
    "v6": {"partition_size": [32, 64, 128, 256, 512, 1024, 2048, 65536]},
}
# Parameter combinations tried as well (GQA groups above 16: the group split over blocks, small splits).
COMBOS = {"v16": [{"heads_per_block": h, "partition_size": p} for h in (16, 32, 64) for p in (64, 128, 256, 512)]}
FILL_BLOCKS_PER_SM = 64
POOL_MAX_BYTES = 8 << 30  # K and V together; also at most a quarter of the GPU's memory
POOL_MIN_BYTES = 1 << 30
CHECK_SEQS = 4  # sequences compared against the reference (first, last, two between)
TOL = {"bfloat16": dict(atol=8e-3, rtol=8e-3), "float16": dict(atol=1e-3, rtol=1e-3)}  # tests/pa_cases.py
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# Timing budget and the estimate's model (H100): each candidate's timed pass aims at TIMING_US of GPU
# time; run_perftest spends about (2 + SLEEP) passes (a dry pass, a stream-holding sleep of about
# twice its length, the timed pass). A call costs at least HOST_US on the host (the op's Python, the
# events, the L2 flush launch) and FLUSH_US on the GPU for the flush.
TIMING_US, MIN_ITERS, MAX_ITERS = 8000.0, 3, 50
HOST_US, FLUSH_US, SLEEP, EST_BYTES_PER_US = 100.0, 40.0, 2.2, 2.5e6
SHAPE_OVERHEAD_S = 0.02


@contextlib.contextmanager
def pinned(cand: Candidate):
    """The op with variant=None runs `cand` (its parameters can only come from a database lookup)."""
    saved = pa._lookup
    pa._lookup = lambda *args, **kwargs: (cand.variant, cand.kwargs)
    try:
        yield
    finally:
        pa._lookup = saved


def _seqs(s) -> int:
    """Sequences a shape is timed with: its batch, but at most the op's 65535 (bucket 65536)."""
    return min(s["batch"], 65535)


def _context(s) -> int:
    """Tokens a shape's sequences are timed with: its context, but at most the whole blocks of the op's
    MAX_TOKENS (bucket 2^30: a block table of 2^30 - 1 tokens, an untuned log's row)."""
    return min(s["context"], pa.MAX_TOKENS // s["block_size"] * s["block_size"])


class PagedAttentionTuner:
    op = "paged_attention"

    def __init__(self):
        self._pool = None  # (group, blocks, k, v): the last KV pool made, reused by its group

    @property
    def schema(self):
        return tuning_db._schemas[self.op]

    def parse_shape(self, raw) -> dict:
        s = {"dtype": str(raw["dtype"]).strip(), "kv_layout": str(raw["kv_layout"]).strip()}
        for k in ("head_size", "block_size", "num_q_heads", "num_kv_heads", "batch", "context"):
            v = str(raw[k]).strip()
            if not v.isdigit() or int(v) < 1:
                raise ValueError(f"{k} must be a positive integer, got {raw[k]!r}")
            s[k] = int(v)
        if s["dtype"] not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {s['dtype']!r}")
        if s["kv_layout"] not in pa.KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {pa.KV_LAYOUTS}, got {s['kv_layout']!r}")
        if s["head_size"] not in pa.HEAD_SIZES:
            raise ValueError(f"head_size must be one of {pa.HEAD_SIZES}, got {s['head_size']}")
        bs = s["block_size"]
        if bs & (bs - 1) or bs > 1024:
            raise ValueError(f"block_size must be a power of two up to 1024, got {bs}")
        if s["num_q_heads"] % s["num_kv_heads"] or s["num_q_heads"] // s["num_kv_heads"] > pa.MAX_GQA:
            raise ValueError(f"num_q_heads ({s['num_q_heads']}) must be num_kv_heads ({s['num_kv_heads']}) times "
                             f"1..{pa.MAX_GQA}")
        if s["context"] < bs:
            raise ValueError(f"context ({s['context']}) must be at least block_size ({bs})")
        if s["context"] > 2**30:  # 2^30: the bucket of the op's longest tables (timed at its MAX_TOKENS)
            raise ValueError(f"context must be at most {2**30}, got {s['context']}")
        if s["batch"] > 65536:  # 65536: the bucket of 32769..65535 sequences (an untuned log's row), timed at 65535
            raise ValueError(f"batch must be at most 65536, got {s['batch']}")
        return s

    def describe(self, s) -> str:
        return (f"{s['dtype']} q{s['num_q_heads']}/kv{s['num_kv_heads']} d{s['head_size']} bs{s['block_size']} "
                f"{s['kv_layout']} b{s['batch']} c{s['context']}")

    def order(self, s) -> tuple:  # pools are per group; largest first, so each group's pool is made once
        return (s["dtype"], s["block_size"], s["num_kv_heads"], s["head_size"], s["kv_layout"],
                -s["batch"] * s["context"], s["num_q_heads"])

    device_info = staticmethod(gpu_info)
    info_for = staticmethod(arch_info)

    def heuristic(self, s, info) -> Candidate:  # the op's default: v3 for head size 256 on CDNA
        return Candidate(pa.heuristic_variant(s["head_size"], info["arch"]))

    def _launches(self, s, info):
        first = self.heuristic(s, info).name
        names = [first] + [v for v in pa.VARIANTS if v != first]
        max_tokens = math.ceil(_context(s) / s["block_size"]) * s["block_size"]
        for v in names:
            var = pa.VARIANTS[v]
            if _seqs(s) > var.max_seqs:  # the op would run v16 under its name
                continue
            if not pa.kernel_runs(var, s["head_size"], info["wave"]):  # the op refuses it (CDNA, head 256)
                continue
            group = s["num_q_heads"] // s["num_kv_heads"]  # the op's plans see its kernel's real occupancy
            grid = PARAM_GRID.get(v, {})
            cands = [Candidate(v)] + [Candidate.of(v, **{p: x}) for p, xs in grid.items() for x in xs]
            cands += [Candidate.of(v, **combo) for combo in COMBOS.get(v, ())]
            for cand in cands:
                params = pa.with_heads(var, cand.kwargs, _seqs(s), s["num_q_heads"], s["num_kv_heads"],
                                       max_tokens, info["cu_count"])
                try:
                    pa.heads_per_block(var, group, params)
                except ValueError:  # a heads-per-block size this group cannot take
                    continue
                resident = (pa.resident_for(s["dtype"], s["head_size"], v, group, torch.cuda.current_device(),
                                            params)
                            if torch.cuda.is_available() else 1)  # a dry run without a GPU plans with 1
                geo = pa.make_shape(var, _seqs(s), s["num_q_heads"], s["num_kv_heads"], max_tokens,
                                    info["cu_count"], info["wave"], resident, params)
                yield cand, (var.kernel, geo.heads_per_block, pa.plan_of(var, geo, params)), geo.blocks

    def candidates(self, s, info) -> Pruned:
        items = list(self._launches(s, info))
        blocks = {launch: n for _, launch, n in items}
        kept, same = dedupe((c, launch) for c, launch, _ in items)
        full, dominated = FILL_BLOCKS_PER_SM * info["cu_count"], {}
        defaults = {c.name for c, _, _ in items if not c.params}
        timed_anyway = defaults | {same[n] for n in defaults if n in same}  # every variant's default launch
        for cand, (kernel, _, plan) in kept:
            if cand.name in timed_anyway:
                continue
            # (a per-sequence plan's num_partitions is a split target, not a partition count: such plans are
            # compared only with one another, by the blocks they launch)
            coarser = [(p.num_partitions, c.name) for c, (k, h, p) in kept if k == kernel and
                       p.per_sequence == plan.per_sequence and p.num_partitions < plan.num_partitions and
                       p.grid_blocks(blocks[(k, h, p)], _seqs(s)) >= full]
            if coarser:
                dominated[cand.name] = min(coarser)[1]
        return Pruned([c for c, _ in kept if c.name not in dominated], same, dominated)

    @staticmethod
    def nbytes(s) -> int:
        el = DTYPES[s["dtype"]].itemsize
        return el * (2 * _seqs(s) * _context(s) * s["num_kv_heads"] * s["head_size"]
                     + 2 * _seqs(s) * s["num_q_heads"] * s["head_size"])

    @staticmethod
    def iterations(kernel_us: float) -> tuple:
        per_call = max(kernel_us + FLUSH_US, HOST_US)
        iters = int(min(MAX_ITERS, max(MIN_ITERS, round(TIMING_US / per_call))))
        return iters, (1 if kernel_us > 1000 else 3)

    def estimate_s(self, s, cands, info) -> float:
        t = self.estimate_kernel_us(s)
        iters, warmup = self.iterations(t)
        per_cand = (1 + warmup) * t + (2 + SLEEP) * iters * max(t + FLUSH_US, HOST_US)
        n_ref = min(CHECK_SEQS, _seqs(s))
        ref_s = n_ref * (0.002 + 12 * _context(s) * s["num_kv_heads"] * s["head_size"] * 4 / 1e12)
        return SHAPE_OVERHEAD_S + ref_s + len(cands) * per_cand / 1e6

    def _kv_pool(self, s, device, need_blocks):
        dtype, bs, hkv, d = DTYPES[s["dtype"]], s["block_size"], s["num_kv_heads"], s["head_size"]
        group = (s["dtype"], bs, hkv, d, s["kv_layout"], device)
        block_bytes = 2 * bs * hkv * d * dtype.itemsize
        cap = min(POOL_MAX_BYTES, torch.cuda.get_device_properties(device).total_memory // 4) // block_bytes
        want = min(cap, max(POOL_MIN_BYTES // block_bytes, need_blocks))
        if self._pool is not None and self._pool[0] == group and self._pool[1] >= want:
            return self._pool[2], self._pool[3]
        self._pool = None
        torch.cuda.empty_cache()
        dims = (want, bs, hkv, d) if s["kv_layout"] == "NHD" else (want, hkv, bs, d)
        g = torch.Generator(device=f"cuda:{device}").manual_seed(1)
        k = torch.randn(dims, generator=g, device=f"cuda:{device}", dtype=dtype)
        v = torch.randn(dims, generator=g, device=f"cuda:{device}", dtype=dtype)
        self._pool = (group, want, k, v)
        return k, v

    def prepare(self, s, info, device) -> "_Bench":
        need = _seqs(s) * math.ceil(_context(s) / s["block_size"])
        k, v = self._kv_pool(s, device, need)
        return _Bench(s, k, v, device, self.nbytes(s), self.estimate_kernel_us(s))

    def estimate_kernel_us(self, s) -> float:
        return max(5.0, self.nbytes(s) / EST_BYTES_PER_US)


class _Bench:
    """One shape's inputs on the GPU, the reference of CHECK_SEQS of its sequences, timing."""

    def __init__(self, s, k, v, device, nbytes, kernel_us):
        dev, pool = f"cuda:{device}", k.shape[0]
        g = torch.Generator(device=dev).manual_seed(s["batch"] * 1_000_003 + s["context"])
        nblk = math.ceil(_context(s) / s["block_size"])
        need = _seqs(s) * nblk
        if need <= pool:
            bt = torch.randperm(pool, generator=g, device=dev)[:need]
        else:  # the pool is capped: blocks repeat
            bt = torch.randint(0, pool, (need,), generator=g, device=dev)
        self.k, self.v, self.layout, self.nbytes = k, v, s["kv_layout"], nbytes
        self.bt = bt.view(_seqs(s), nblk).to(torch.int32)
        self.q = torch.randn((_seqs(s), s["num_q_heads"], s["head_size"]), generator=g, device=dev, dtype=k.dtype)
        self.cl = torch.full((_seqs(s),), _context(s), dtype=torch.int32, device=dev)
        self.out = torch.empty_like(self.q)
        self.tol = TOL[s["dtype"]]
        self.iters, self.warmup = PagedAttentionTuner.iterations(kernel_us)
        # The reference's per-sequence loop over a whole large batch would cost more than timing every
        # candidate: the full batch runs, CHECK_SEQS of its sequences (first, last, between) are compared.
        b = _seqs(s)
        self.idx = torch.tensor(sorted({0, b // 3, 2 * b // 3, b - 1})[:CHECK_SEQS], device=dev)
        self.ref = paged_attention_ref(self.q[self.idx], k, v, self.bt[self.idx], self.cl[self.idx],
                                       kv_layout=self.layout)[0]
        self.use = pinned

    def new_output(self):
        return torch.empty_like(self.q)

    def call(self, out):
        pa.paged_attention_decode(self.q, self.k, self.v, self.bt, self.cl, kv_layout=self.layout, out=out)

    def checked(self, out):
        return rows_scaled(out[self.idx], self.ref)  # atol for the rows' own size (long contexts)

    def time_us(self) -> float:
        k, v, layout = self.k, self.v, self.layout

        # The pool is no argument: with one copy of the small arguments (far below 2x L2), run_perftest
        # flushes L2 before each call, so every call reads its K/V from memory as in a real decode step.
        def call(q, bt, cl, out):
            return pa.paged_attention_decode(q, k, v, bt, cl, kv_layout=layout, out=out)

        return perftest_us(call, self.q, self.bt, self.cl, self.out, iters=self.iters, warmup=self.warmup,
                           max_copies=1)


ADAPTER = PagedAttentionTuner()
