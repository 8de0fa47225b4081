"""Randomized correctness sweep ("fuzz") for paged_attention_decode and fused_moe, and the routing ops
topk_softmax, grouped_topk and moe_sorting.

Draws random *combinations* of what tests/test_paged_attention*.py, tests/test_fused_moe*.py and the routing
ops' tests cover on grids; checks each against those tests' references and per-dtype tolerances (checkAllclose,
tol_err_ratio 0; integer outputs exactly), writing into NaN-poisoned out= buffers; the memory torch hands out next
is poisoned before each call too (poison_free_memory), so a workspace read before it is written shows.

  paged_attention: dtype, head size, block size (every power of two 1..1024), KV heads 1..8, GQA group (some
    splitting the kernels' head blocks unevenly), NHD/HND, batch 1..40 (sometimes ~4100-9000 short sequences),
    context lengths mixing 0, 1, block edges, tile/partition edges, random up to 5000, sometimes up to 20000;
    a random non-contiguous block table over a pool a bit larger than needed, sometimes sharing blocks
    between sequences, sometimes with ids the op masks (-1, past the pool, int32's ends), sometimes lengths
    past what the table addresses (clamped), sometimes with every cache row no sequence reads set to NaN;
    sometimes a custom scale (some negative), sometimes return_lse (checked against the reference LSE),
    sometimes out=query; sometimes strided inputs as serving engines pass them (K / V halves of one fused
    tensor, padded head rows, the query a slice of qkv or not 16-byte aligned, the block table the first
    columns of a wider one: pa_cases.strided_like).
    Each case runs variant=None and every registered variant (sometimes an alias) against one reference;
    runs of one launch (None and the variant it picks with its defaults, an alias and its variant) the same bits.
  fused_moe: dtype (bf16/fp16, sometimes fp32), T (0..1024), D, I, E (1..1024), topk (sometimes up to 16), a
    routing pattern (uniform, all tokens on the same k experts, half the experts empty, 80% of pairs on one
    expert), sometimes an expert_map (remote experts, or a permutation of all), variant and block_m where the op
    accepts them, silu/gelu, sometimes out=hidden_states; then the same call again must give the same bits.
  The routing ops (tests/fuzz_routing.py), each: tokens 0, 1, block edges, up to 4096, sometimes up to 20000;
    logits N(0, scale^2) or tie-heavy (a few values with -0.0 and 0.0, multiples of 1/4, rows of one value)
    or with -inf (a finite logit a row); sometimes the inputs and out= 1..3 elements into their buffers (not
    16-byte aligned). Each case calls the op with out= (poisoned, with poisoned guard elements after each
    output that must stay so; float32 with a NaN no GPU computes, so an unwritten element shows where the
    right value is NaN too), then in the functional form into poisoned allocations: the same bits; the inputs
    unchanged.
  topk_softmax: fp32/fp16/bf16, E (the tests' counts or any) 1..512, topk 1..min(16, E), renormalize on/off;
    ids exactly the reference's (the op ranks the logits themselves: equal ones to the lower expert), weights
    within the test's tolerance.
  grouped_topk: fp32/fp16/bf16, (E, groups, kept groups) from the tests' configs or any groups 1..64 of
    1..512/groups experts, topk 1..min(16, kept experts), sigmoid/softmax scoring, top2/max group scoring, no
    bias, a random one or one in multiples of 1/8 (exact ties), renormalize on/off, a routed_scaling_factor
    (1, 2.5, 16, 0.5, 0, -1 or random); the weights are the scores at the ids, the ids the float64
    reference's (exact ties: the lower index on both sides), except in rows with a near-tie, which may take
    any top-k that float32 noise allows (test_grouped_topk's judgement, without its bound on how many such
    rows there are; near-ties: distinct scores within float32 noise, and what the test's inputs lack: an
    exact tie at a cut with such a score beside it, groups tied by equal sums of different pairs).
  moe_sorting: E (edges or any) 1..1024, k 1..16 (sometimes up to 64), pairs at the kernels' bounds (256,
    4096, chunks of 2048), block_m (edges or any) 1..1024, ids distinct per token, uniform with repeats, all
    on one expert, the same k experts, from 3 experts, from half of them or 80 % on one; sometimes an
    expert_map (local ids ascending or permuted, a share of experts remote, or all remote), sometimes
    validate=True; all three outputs exactly the reference's.

Run from the repository root, on a GPU:
    PYTHONPATH=. python3 tests/fuzz.py [--seconds 150] [--seed 0] [--op OP|both|routing|all]
    PYTHONPATH=. python3 tests/fuzz.py --op fused_moe --case-seed K   # rerun one case, verbosely
    PYTHONPATH=. python3 tests/fuzz.py --dry-run 100 [--op all]       # draw + validate only, no GPU
--op both (the default) runs paged_attention and fused_moe; routing runs topk_softmax, grouped_topk and
moe_sorting; all runs the five. Modules are JIT-built on first use, within the time budget: prebuild them
(python3 -m hipkern.build --only paged_attention, then --only fused_moe, --only topk_softmax, --only
grouped_topk, --only moe_sorting) to spend it on cases. Prints one line per failing run
(case seed, mismatch share, parameters) and per unexpected rejection (a ValueError from the op: every drawn
case passes its validation), the first expected ones (a GPU's documented limits, expected_rejection), then a
table; exit status 1 if any run failed or was rejected unexpectedly, or an op ran no case. --seconds is a
target: the case in progress finishes, and each op runs at least one case. With $OUT set, every case is also
written to $OUT/fuzz_cases.jsonl.
"""
import argparse, collections, functools, importlib, json, math, os, random, sys, time  # noqa: E401

import torch

import hipkern
from hipkern.reference import fused_moe_ref, paged_attention_ref
from hipkern import jit
from hipkern.testing import checkAllclose, poison, poison_free_memory, rows_scaled

# The op modules (hipkern.ops' attribute `fused_moe` is the function, not its module).
M, P = (importlib.import_module(f"hipkern.ops.{m}") for m in ("fused_moe", "paged_attention"))
DT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Tolerances: the tests' own (this file's directory is on sys.path when it runs; fused_moe's atol is
# scaled by each token's routing-weight sum where that exceeds 1: see run_moe).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_cases import TOL as MOE_TOL  # noqa: E402
from pa_cases import LSE_TOL, TOL as PA_TOL, strided_like  # noqa: E402
import fuzz_routing as R  # noqa: E402
PA_KV_BYTES, MOE_W_BYTES = 300 << 20, 200 << 20  # per case: the K + V pool; w1 + w2
# all <= P.MAX_GQA; 6, 12, 20, 33: a partial last block of the CUDA-core kernels' 8 heads (and of 16 / 32)
GROUPS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 20, 24, 33, 40, 64)
BAD_IDS = (-1, -2**31, 2**31 - 1)  # block ids the op masks (besides num_blocks.. : the pool's size and past it)
BLOCK_SIZES = (1, 2, 4, 8, 16, 16, 16, 32, 32, 32, 64, 128, 256, 512, 1024)  # the op: powers of two <= 1024
EDGES = (63, 64, 65, 127, 128, 129, 511, 512, 513, 1023, 1024, 1025, 2047, 2048, 2049)  # tiles, partitions
TOKENS = (0, 1, 2, 3, 4, 5, 7, 8, 16, 31, 33, 64, 129, 300, 600, 1024)
EXPERTS = (1, 2, 8, 9, 64, 256, 257, 600, 1024)  # the op: 1..1024
DIMS = (64, 200, 256, 320, 1000, 2880)
ROUTINGS = ("uniform", "same", "half_empty", "skew")
STRIDED = ("fused_kv", "padded_rows", "qkv", "q_unaligned", "wide_table")  # pa_cases.strided_like


# ------------------------------------------------------------------------------ paged attention
def draw_len(rng, bs):
    """0, 1, one or a few blocks +-1, a tile / partition edge, random up to 5000, or up to 20000."""
    r = rng.random()
    if r < 0.15:
        return 0 if r < 0.08 else 1
    if r < 0.35:
        return max(0, bs * rng.choice((1, 1, rng.randint(2, 8))) + rng.choice((-1, 0, 1)))
    return rng.choice(EDGES) if r < 0.45 else rng.randint(2, 5000) if r < 0.95 else rng.randint(5001, 20000)


def draw_pa(rng):
    bs, hkv, d = rng.choice(BLOCK_SIZES), rng.randint(1, 8), rng.choice(P.HEAD_SIZES)
    lens, slack, trimmed = [draw_len(rng, bs) for _ in range(rng.randint(1, 40))], rng.randint(1, 8), False
    if rng.random() < 0.02:  # thousands of short sequences: past v5's 4096, small blocks and heads (the budget)
        bs, hkv = rng.choice(BLOCK_SIZES[:5]), rng.randint(1, 2)
        lens = [rng.randint(0, 2 * bs + 1) for _ in range(rng.randint(P.MAX_PER_SEQUENCE_SEQS - 8, 9000))]
    pool = lambda: sum(-(-n // bs) for n in lens) * 17 // 16 + slack  # blocks: a bit more than needed
    while pool() * bs * 4 * hkv * d > PA_KV_BYTES and (len(lens) > 1 or lens[0] > 2 * bs):  # K + V budget
        trimmed, i = True, max(range(len(lens)), key=lens.__getitem__)
        if lens[i] > 2 * bs:  # halve the longest, else drop a sequence
            lens[i] //= 2
        else:
            lens.pop()
    variants = [None] + [v for v in sorted(P.VARIANTS) if len(lens) <= P.VARIANTS[v].max_seqs]
    variants += [rng.choice(sorted(P.ALIASES))] if rng.random() < 0.1 else []
    extra_cols = rng.choice((0, 0, 1, 3))
    width = max(1, max(-(-n // bs) for n in lens)) + extra_cols
    # lengths past what a table row addresses (the op clamps them): (sequence, length passed)
    over = sorted((i, rng.choice((width * bs + rng.randint(1, 1000), 2**31 - 1)))
                  for i in rng.sample(range(len(lens)), min(len(lens), 3))) if rng.random() < 0.1 else []
    strided = sorted(rng.sample(STRIDED, rng.randint(1, 3))) if rng.random() < 0.3 else []
    scale = round(rng.uniform(0.25, 3.0) / math.sqrt(d) * rng.choice((1, 1, 1, -1)), 5) if rng.random() < 0.4 else None
    return dict(dtype=rng.choice(("bfloat16", "float16")), head_size=d, block_size=bs, num_kv_heads=hkv,
                group=rng.choice(GROUPS if len(lens) <= 40 else GROUPS[:6]),  # (q, out and copies of it: small)
                layout=rng.choice(P.KV_LAYOUTS), num_blocks=pool(),
                extra_cols=extra_cols, share=rng.choice((0.0, 0.0, 0.1, 0.5)),
                bad_ids=rng.choice((0.0,) * 6 + (0.02, 0.2)), over=over,
                nan_pad=rng.random() < 0.5, lse=rng.random() < 0.5, trimmed=trimmed, scale=scale,
                kv_mb=round(pool() * bs * 4 * hkv * d / 2**20, 1), variants=variants, lens=lens, strided=strided,
                in_place=rng.random() < 0.1 and not {"qkv", "q_unaligned"} & set(strided))  # out=query


def pa_table(c, g):
    """int32 [batch, width] on the CPU: each sequence's blocks from one random permutation of the pool
    (distinct, non-contiguous), tail columns any block; a share of entries redrawn (shared blocks); a share
    (bad_ids) ids the op masks (outside [0, num_blocks))."""
    bs, nb = c["block_size"], c["num_blocks"]
    need = [-(-n // bs) for n in c["lens"]]
    bt = torch.randint(0, nb, (len(need), max(1, max(need)) + c["extra_cols"]), generator=g, dtype=torch.int32)
    perm, off = torch.randperm(nb, generator=g).to(torch.int32), 0
    for s, n in enumerate(need):
        bt[s, :n], off = perm[off:off + n], off + n
    if c["share"]:
        mask = torch.rand(bt.shape, generator=g) < c["share"]
        bt[mask] = torch.randint(0, nb, (int(mask.sum()),), generator=g, dtype=torch.int32)
    if c.get("bad_ids"):
        mask = torch.rand(bt.shape, generator=g) < c["bad_ids"]
        bad = torch.tensor(BAD_IDS + (nb, nb + 7), dtype=torch.int32)
        bt[mask] = bad[torch.randint(0, len(bad), (int(mask.sum()),), generator=g)]
    return bt


def passed_lens(c) -> list:
    """The context lengths the op gets: the case's, some past the table (the op clamps them; c["over"])."""
    lens = list(c["lens"])
    for i, n in c.get("over", ()):
        lens[i] = n
    return lens


def dead_rows(c, bt):
    """(blocks, rows) of every cache row that no sequence reads within its length."""
    bs, live = c["block_size"], torch.zeros(c["num_blocks"] * c["block_size"], dtype=torch.bool)
    for s, n in enumerate(passed_lens(c)):  # as the op clamps them
        p = torch.arange(min(n, bt.shape[1] * bs))
        blocks = bt[s, p // bs].long()
        ok = (blocks >= 0) & (blocks < c["num_blocks"])
        live[blocks[ok] * bs + p[ok] % bs] = True
    dead = (~live).nonzero().flatten()
    return dead // bs, dead % bs


SAMPLE_SEQS = 512  # batches larger than this are compared on a sample of their sequences


def sample_seqs(lens, g) -> torch.Tensor:
    """SAMPLE_SEQS sequence indices: the first and last 64, up to 64 empty ones, the rest random."""
    n = len(lens)
    empty = torch.tensor([i for i, x in enumerate(lens) if x == 0][:64], dtype=torch.long)
    ends = torch.cat((torch.arange(64), torch.arange(n - 64, n), empty))
    rest = torch.randperm(n, generator=g)[:SAMPLE_SEQS - ends.numel()]
    return torch.cat((ends, rest)).unique()


def run_pa(c, seed, verbose):
    g, gd = torch.Generator().manual_seed(seed), torch.Generator(device="cuda").manual_seed(seed)
    dtype, nb, bs, hkv, d = DT[c["dtype"]], c["num_blocks"], c["block_size"], c["num_kv_heads"], c["head_size"]
    k, v = (torch.randn((nb, bs, hkv, d) if c["layout"] == "NHD" else (nb, hkv, bs, d), generator=gd,
                        device="cuda", dtype=dtype) for _ in range(2))
    q = torch.randn(len(c["lens"]), hkv * c["group"], d, generator=gd, device="cuda", dtype=dtype)
    bt = pa_table(c, g)
    if c["nan_pad"]:  # a kernel that lets a row it must not read into a sum gives NaN
        blocks, rows = (t.cuda() for t in dead_rows(c, bt))
        for t in (k, v):
            (t if c["layout"] == "NHD" else t.transpose(1, 2))[blocks, rows] = math.nan
    bt, cl = bt.cuda(), torch.tensor(passed_lens(c), dtype=torch.int32, device="cuda")
    # Thousands of sequences: the reference (a loop over them) of a sample (both ends, empty ones, random); every
    # row of the output is checked for NaN (unwritten) instead
    idx = sample_seqs(c["lens"], g) if len(c["lens"]) > SAMPLE_SEQS else torch.arange(len(c["lens"]))
    idx = idx.cuda()
    ref, ref_lse = paged_attention_ref(q[idx], k, v, bt[idx], cl[idx], scale=c["scale"], kv_layout=c["layout"])
    if c.get("strided"):  # the same values through other strides (the reference read the contiguous ones)
        q, k, v, bt, cl = strided_like((q, k, v, bt, cl), c["strided"])
    zero, results, bits = cl[idx] == 0, [], {}
    for variant in c["variants"]:
        query = q.clone() if c.get("in_place") else q  # out=query: the op overwrites it
        out = query if c.get("in_place") else poison(torch.empty_like(q))

        def check(got):
            o, lse = got if c["lse"] else (got, None)
            if o is not out:
                return 1.0, "the result is not out="
            bits[variant] = o.clone()
            msgs = ["NaN in the output (an unwritten element?)"] if o.isnan().any() else []
            o = o[idx]
            share = checkAllclose(*rows_scaled(o, ref), msg=f"{variant} out ", printLog=verbose, **PA_TOL[dtype])
            if lse is not None:
                msgs += ["NaN in the LSE (an unwritten element?)"] if lse.isnan().any() else []
                lse = lse[idx]
                share = max(share, checkAllclose(lse, ref_lse, msg=f"{variant} lse ", printLog=verbose, **LSE_TOL))
                msgs += ["lse of an empty context is not -inf"] if (lse[zero] != -math.inf).any() else []
            msgs += ["output of an empty context is not exactly 0"] if (o[zero] != 0).any() else []
            if verbose and share:
                err = (o.double() - ref.double()).abs().nan_to_num(math.inf).amax(dim=(1, 2))
                worst = err.argsort(descending=True)[:8].tolist()
                print("    worst sequences (index, length, max abs err):",
                      [(int(idx[i]), c["lens"][int(idx[i])], round(float(err[i]), 5)) for i in worst])
            return share, "; ".join(msgs)

        # the op's workspaces (partials) and own LSE tensor: not the last variant's correct ones, handed back
        poison_free_memory(q.device)
        results.append(dict(variant=variant, **attempt(lambda: hipkern.paged_attention_decode(
            query, k, v, bt, cl, scale=c["scale"], kv_layout=c["layout"], out=out, return_lse=c["lse"],
            variant=variant), check)))
    return results + same_launch_same_bits(bits, P.choose_variant(q, k, bt, c["layout"]))


def same_launch_same_bits(bits, chosen) -> list:
    """Runs of one launch must give the same bits (no unordered float atomics): variant=None and the variant the
    database or heuristic picks (when it picks that variant's defaults), an alias and its variant."""
    runs = collections.defaultdict(list)
    for variant in bits:
        launch = (chosen[0] if not chosen[1] else None) if variant is None else P.ALIASES.get(variant, variant)
        if launch:
            runs[launch].append(variant)
    same = lambda a, b: R.same_bits(bits[a], bits[b])
    return [dict(variant=f"{names[0]}={other}", status="passed" if same(names[0], other) else "failed",
                 msg="" if same(names[0], other) else "one launch, other bits")
            for names in runs.values() for other in names[1:]]


def validate_pa(c, seed):
    """The op's argument checks on meta tensors of the case's shapes (per variant), and the block table."""
    bt = pa_table(c, torch.Generator().manual_seed(seed))
    dead_rows(c, bt)
    bs, nb, hkv, d, b = c["block_size"], c["num_blocks"], c["num_kv_heads"], c["head_size"], len(c["lens"])
    assert (c["bad_ids"] or 0 <= int(bt.min()) and int(bt.max()) < nb) and bt.shape[1] * bs >= max(c["lens"])
    assert all(n > bt.shape[1] * bs for _, n in c["over"])
    meta = lambda shape, dt=DT[c["dtype"]]: torch.empty(shape, dtype=dt, device="meta")
    cache, q = (nb, bs, hkv, d) if c["layout"] == "NHD" else (nb, hkv, bs, d), meta((b, hkv * c["group"], d))
    return [verdict(P._validate, q, meta(cache), meta(cache), meta(tuple(bt.shape), torch.int32),
                    meta((b,), torch.int32), c["scale"], c["layout"], meta(q.shape), c["lse"],
                    P.ALIASES.get(v, v)) for v in c["variants"]]


# ------------------------------------------------------------------------------------ fused MoE
def draw_moe(rng):
    dtype = rng.choice(("bfloat16", "bfloat16", "float16", "float16", "float32"))
    size = DT[dtype].itemsize
    t, e = rng.choice(TOKENS), rng.choice(EXPERTS)
    k, remote = rng.randint(1, min(9 if rng.random() < 0.8 else 16, e)), rng.random() < 0.3
    # expert_map: n_local of the E global experts on this GPU (0: all remote; w1 / w2 then hold one, unused)
    n_local = (0 if (r := rng.random()) < 0.1 else e if r < 0.2 else rng.randint(1, max(1, e - 1))) if remote else e
    dim = lambda: rng.choice(DIMS) if rng.random() < 0.7 else 16 // size * rng.randint(1, 3072 * size // 16)
    for _ in range(100):  # multiples of 16 bytes; w1 + w2 within the budget (large E: small D x I)
        d, i = dim(), dim()
        if max(1, n_local) * 3 * d * i * size <= MOE_W_BYTES:
            break
    else:
        d, i = 64, 64
    gemv = list(M.gemv_variants(DT[dtype]))
    variant = rng.choice([None, M.VARIANT] + ["decode"] * (t * k <= M.DECODE_MAX_PAIRS)
                         + gemv * M.gemv_fits(t, k, d, i))
    bms = [b for b in M.block_ms_for(DT[dtype]) if variant != "decode" or b <= M.DECODE_MAX_BLOCK_M]
    return dict(dtype=dtype, tokens=t, model_dim=d, inter_dim=i, experts=e, topk=k, routing=rng.choice(ROUTINGS),
                remote=remote, n_local=n_local, variant=variant, block_m=rng.choice([None] + bms),
                activation=rng.choice(sorted(M.ACTIVATIONS)),  # topk_weights normalised, else times a factor
                weight_scale=None if rng.random() < 0.8 else round(rng.uniform(0.5, 3.0), 3),
                w_mb=round(max(1, n_local) * 3 * d * i * size / 2**20, 1), in_place=rng.random() < 0.1)


def moe_routing(c, g):
    """On the CPU: topk_weights float32 [T, k], topk_ids int32 [T, k] over the E experts, expert_map or None
    (n_local of the experts local, in a random order; all of them: a permutation, no -1)."""
    t, e, k = c["tokens"], c["experts"], c["topk"]
    w = torch.rand(t, k, generator=g) + 0.1  # as the tests' routing_weights
    w = w / w.sum(dim=1, keepdim=True) if c["weight_scale"] is None else w * c["weight_scale"]
    pool = torch.randperm(e, generator=g)
    if c["routing"] == "skew":  # 80% of the pairs on one expert (so ids repeat within rows)
        ids = torch.randint(0, e, (t, k), generator=g)
        ids[torch.rand(t, k, generator=g) < 0.8] = int(pool[0])
    elif c["routing"] == "same":
        ids = pool[:k].repeat(t, 1)
    else:  # distinct experts per token, from all of them or from half
        pool = pool[:max(k, (e + 1) // 2)] if c["routing"] == "half_empty" else pool
        ids = pool[torch.rand(t, len(pool), generator=g).topk(k, dim=1).indices]
    emap = None
    if c["remote"]:  # local experts in a random order, the rest -1 (remote)
        local = torch.randperm(e, generator=g)[:c["n_local"]]
        emap = torch.full((e,), -1, dtype=torch.int32)
        emap[local] = torch.arange(local.numel(), dtype=torch.int32)
    return w, ids.to(torch.int32).contiguous(), emap


def run_moe(c, seed, verbose):
    dtype, t, d, i, el = DT[c["dtype"]], c["tokens"], c["model_dim"], c["inter_dim"], max(1, c["n_local"])
    gd = torch.Generator(device="cuda").manual_seed(seed)
    w1 = torch.randn(el, 2 * i, d, generator=gd, device="cuda", dtype=dtype).mul_(d ** -0.5)
    w2 = torch.randn(el, d, i, generator=gd, device="cuda", dtype=dtype).mul_(i ** -0.5)
    x = torch.randn(t, d, generator=gd, device="cuda", dtype=dtype)
    w, ids, emap = (None if a is None else a.cuda() for a in moe_routing(c, torch.Generator().manual_seed(seed)))
    ref = fused_moe_ref(x, w1, w2, w, ids, c["activation"], emap, torch.float64,
                        None if dtype == torch.float32 else dtype)
    no_pair = (emap[ids.long()] < 0).all(dim=1) if emap is not None else torch.zeros(t, dtype=torch.bool).cuda()
    kw = dict(activation=c["activation"], expert_map=emap, block_m=c["block_m"], variant=c["variant"])
    # out=hidden_states (in place: the op overwrites a copy of x), else a poisoned out=
    fresh = lambda: x.clone() if c.get("in_place") else x
    out_for = lambda xs: xs if c.get("in_place") else poison(torch.empty_like(x))
    xs = fresh()
    out = out_for(xs)

    def check(res):
        if res is not out:
            return 1.0, "the result is not out="
        # The tests' atol is for O(1) outputs (routing weights summing to 1); a token's outputs and their
        # rounding errors grow with its weights' sum, so atol is scaled by it: |res - ref| <= atol * s + rtol * |ref|.
        s = w.abs().sum(dim=1, keepdim=True).clamp_min(1).double()
        share, msgs = checkAllclose(res.double() / s, ref / s, msg=f"{c['variant']} ", printLog=verbose,
                                    **MOE_TOL[dtype]), []
        msgs += ["a token whose pairs are all remote has a nonzero row"] if (res[no_pair] != 0).any() else []
        xs2 = fresh()
        again_out = out_for(xs2)
        poison_free_memory(x.device)  # the workspaces: not the first call's values, handed back
        again = hipkern.fused_moe(xs2, w1, w2, w, ids, out=again_out, **kw)
        msgs += [] if R.same_bits(again, res) else ["the same call again gives other bits (not deterministic)"]
        if verbose and share:
            err = (res.double() - ref).abs().nan_to_num(math.inf).amax(dim=1)
            print("    worst tokens (index, max abs err, ids):",
                  [(s, round(float(err[s]), 6), ids[s].tolist()) for s in err.argsort(descending=True)[:6].tolist()])
        return share, "; ".join(msgs)

    poison_free_memory(x.device)  # the op's workspaces (intermediate, partial sums, sorting)
    return [dict(variant=c["variant"], **attempt(lambda: hipkern.fused_moe(xs, w1, w2, w, ids, out=out, **kw), check))]


def validate_moe(c, seed):
    w, ids, emap = moe_routing(c, torch.Generator().manual_seed(seed))
    assert ids.shape == (c["tokens"], c["topk"]) and (not ids.numel() or 0 <= int(ids.min()) and
                                                       int(ids.max()) < c["experts"])
    meta = lambda *shape, dt=DT[c["dtype"]]: torch.empty(shape, dtype=dt, device="meta")
    t, d, i, el, k = c["tokens"], c["model_dim"], c["inter_dim"], max(1, c["n_local"]), c["topk"]
    return [verdict(M._validate, meta(t, d), meta(el, 2 * i, d), meta(el, d, i), meta(t, k, dt=torch.float32),
                    meta(t, k, dt=torch.int32), c["activation"], None if emap is None else emap.to("meta"),
                    c["block_m"], meta(t, d), c["variant"])]


# -------------------------------------------------------------------------------------- driver
def expected_rejection(op, c, variant, msg):
    """Whether a launch-time refusal is a GPU's documented limit, not a wrong refusal of a valid case: CDNA's
    matrix-core paged-attention kernels (v16, v5 and their names) at head size 256 (their tiles do not fit
    64 KB of LDS), on a GPU of 64-lane waves only."""
    return (op == "paged_attention" and c["head_size"] == 256 and "do not fit 64 KB of LDS" in msg
            and jit.wave_size_of(jit.current_arch()) == 64 and variant is not None
            and not P.runs_here(variant, 256))


def attempt(call, check):
    """Run the op (a ValueError: a rejection), then `check` its result -> (mismatch share, problems)."""
    try:
        got = call()
    except ValueError as e:
        return dict(status="rejected", msg=str(e))
    except Exception as e:  # noqa: BLE001 - any other error is a failure
        return dict(status="failed", msg=f"{type(e).__name__}: {e}")
    try:
        share, msg = check(got)
    except Exception as e:  # noqa: BLE001 - asynchronous kernel errors surface here
        return dict(status="failed", msg=f"{type(e).__name__} while checking: {e}")
    return dict(status="passed" if share == 0 and not msg else "failed", share=share, msg=msg)


def verdict(validate, *args):
    """'ok' when only the last check ('must be on a GPU': meta tensors) is left."""
    try:
        validate(*args)
    except ValueError as e:
        return "ok" if "must be on a GPU" in str(e) else f"rejected: {e}"
    return "accepted a meta tensor?!"


# op -> (draw, run, validate); the routing ops' from tests/fuzz_routing.py, given this file's attempt and verdict.
OPS = {"paged_attention": (draw_pa, run_pa, validate_pa), "fused_moe": (draw_moe, run_moe, validate_moe),
       **{op: (draw, functools.partial(run, attempt=attempt), functools.partial(validate, verdict=verdict))
          for op, (draw, run, validate) in R.ROUTING.items()}}
OP_GROUPS = {"both": ["paged_attention", "fused_moe"], "routing": list(R.ROUTING), "all": list(OPS)}


def one_case(op, seed, verbose=False):
    c, t0 = OPS[op][0](random.Random(seed)), time.perf_counter()
    try:
        results = OPS[op][1](c, seed, verbose)
    except Exception as e:  # noqa: BLE001 - building the inputs or the reference
        results = [dict(variant=None, status="failed", msg=f"harness {type(e).__name__}: {e}")]
    return c, results, time.perf_counter() - t0


def context_lost():
    try:
        return torch.cuda.synchronize()  # None: still usable
    except Exception as e:  # noqa: BLE001 - a sticky error (illegal address, ...): every later case would fail
        print(f"the CUDA context is lost ({type(e).__name__}: {e}); stopping", flush=True)
        return True


def fuzz(args, ops):
    jsonl = open(os.path.join(os.environ["OUT"], "fuzz_cases.jsonl"), "a") if os.environ.get("OUT") else None
    print(f"fuzz: {torch.cuda.get_device_name()}, seed {args.seed}, {args.seconds:g}s over {ops}", flush=True)
    stats, deadline, shown, lost = {}, time.perf_counter() + args.seconds, 0, False
    for n, op in enumerate(ops):  # op n gets its share of what is left; at least one case each
        t_op = time.perf_counter()
        end = t_op + max(0.0, deadline - t_op) / (len(ops) - n)
        master, st = random.Random(f"{op}:{args.seed}"), collections.Counter()
        while (time.perf_counter() < end or not st["cases"]) and not lost:
            seed = master.randrange(2**31)
            c, results, dt = one_case(op, seed)
            st["cases"] += 1
            for r in results:
                st["runs"] += 1
                st[r["status"]] += 1
                unexpected = r["status"] == "rejected" and not expected_rejection(op, c, r["variant"], r["msg"])
                st["unexpected rejections"] += unexpected
                if r["status"] == "failed" or unexpected:
                    print(f"{'FAIL' if r['status'] == 'failed' else 'UNEXPECTED REJECTION'} {op} --case-seed {seed} "
                          f"variant={r['variant']} share={r.get('share')} {r['msg'] or 'mismatch'} "
                          f"params={json.dumps(c, separators=(',', ':'))}", flush=True)
                elif r["status"] == "rejected" and shown < 20:
                    shown += 1
                    print(f"REJECTED {op} --case-seed {seed} variant={r['variant']}: {r['msg']}", flush=True)
            if jsonl:
                print(json.dumps(dict(op=op, case_seed=seed, seconds=round(dt, 3), params=c, results=results)),
                      file=jsonl, flush=True)
            lost = any(r["status"] == "failed" for r in results) and context_lost()
        stats[op] = (st, time.perf_counter() - t_op)
    print(f"\n{'op':<16}{'cases':>7}{'runs':>7}{'passed':>8}{'failed':>8}{'rejected':>10}{'unexpected':>12}"
          f"{'seconds':>9}")
    for op, (st, secs) in stats.items():
        print(f"{op:<16}{st['cases']:>7}{st['runs']:>7}{st['passed']:>8}{st['failed']:>8}{st['rejected']:>10}"
              f"{st['unexpected rejections']:>12}{secs:>9.1f}")
    # The drawer draws only cases the op's validation accepts (--dry-run checks that), so a ValueError at run
    # time (a check on the launch path: alignment, overlap, int32 limits) refused a valid case: a failure too,
    # unless it is a documented limit of this GPU (expected_rejection).
    return 1 if lost or any(st["failed"] or st["unexpected rejections"] or not st["cases"]
                            for st, _ in stats.values()) else 0


def rerun(args, ops):
    if len(ops) != 1:
        sys.exit(f"--case-seed needs one op: --op {' | '.join(OPS)}")
    c, results, dt = one_case(ops[0], args.case_seed, verbose=True)
    print(f"{ops[0]} case {args.case_seed} ({dt:.2f}s): {json.dumps(c)}")
    for r in results:
        print(f"  variant={r['variant']}: {r['status']} share={r.get('share')} {r.get('msg', '')}")
    return 1 if any(r["status"] == "failed" or (r["status"] == "rejected" and not expected_rejection(
        ops[0], c, r["variant"], r["msg"])) for r in results) else 0


def features(op, c):
    """What --dry-run counts per case."""
    if op in R.ROUTING:
        return R.features(c)
    bucket = lambda n, edges: next((f"<={e}" for e in edges if n <= e), f">{edges[-1]}")
    if op == "paged_attention":
        keys = "dtype head_size block_size num_kv_heads group layout share bad_ids nan_pad lse trimmed in_place".split()
        return dict({k: c[k] for k in keys}, batch=bucket(len(c["lens"]), (1, 8, 40, 4096)), over=len(c["over"]),
                    negative_scale=(c["scale"] or 0) < 0, strided=",".join(c["strided"]),
                    longest=bucket(max(c["lens"]), (64, 1024, 5000, 20000)), has_empty=0 in c["lens"],
                    scale=c["scale"] is not None, alias=len(c["variants"]) > 1 + len(P.VARIANTS))
    keys = "dtype tokens experts topk routing remote variant block_m activation in_place".split()
    return dict({k: c[k] for k in keys}, all_remote=c["n_local"] == 0, map_all_local=c["remote"] and
                c["n_local"] == c["experts"], normalised=c["weight_scale"] is None,
                D=bucket(c["model_dim"], (64, 256, 1024, 3072)), I=bucket(c["inter_dim"], (64, 256, 1024, 3072)),
                D_x64=c["model_dim"] % 64 == 0, I_x64=c["inter_dim"] % 64 == 0)


def dry_run(args, ops):
    """Draw the first N cases of each op (those a run with this --seed starts with), print them, run
    the op's argument checks on meta tensors of their shapes, and count what was drawn."""
    bad = 0
    for op in ops:
        master, verdicts, seen, big = random.Random(f"{op}:{args.seed}"), collections.Counter(), {}, 0.0
        for _ in range(args.dry_run):
            seed = master.randrange(2**31)
            c = OPS[op][0](random.Random(seed))
            v = OPS[op][2](c, seed)
            verdicts.update(v)
            big = max(big, c.get("kv_mb", c.get("w_mb", c.get("mb", 0))))
            for key, value in features(op, c).items():
                seen.setdefault(key, collections.Counter())[value] += 1
            print(f"{op} case_seed={seed} {json.dumps(c, separators=(',', ':'))} -> {sorted(set(v))}")
        bad += sum(n for k, n in verdicts.items() if k != "ok")
        print(f"\n== {op}: {args.dry_run} cases; argument checks: {dict(verdicts)}; largest case {big} MB")
        for key, cnt in seen.items():
            print(f"   {key}: {dict(sorted(cnt.items(), key=lambda kv: str(kv[0])))}")
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=150.0, help="time budget, split evenly between the ops")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--op", choices=(*OPS, *OP_GROUPS), default="both",
                    help="one op, or both (paged_attention, fused_moe), routing (the three routing ops) or all")
    ap.add_argument("--case-seed", type=int, help="rerun this one case of --op, verbosely")
    ap.add_argument("--dry-run", type=int, metavar="N", help="draw N cases per op, print and validate them; no GPU")
    args = ap.parse_args()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    ops = OP_GROUPS.get(args.op, [args.op])
    if args.dry_run:
        return dry_run(args, ops)
    if not torch.cuda.is_available():
        sys.exit("fuzz: no GPU here (--dry-run draws and validates cases without one)")
    return rerun(args, ops) if args.case_seed is not None else fuzz(args, ops)


if __name__ == "__main__":
    sys.exit(main())
