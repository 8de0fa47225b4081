"""paged_attention_decode against a float32 per-sequence torch reference, every variant."""
import contextlib
import math

import pytest
import torch

import hipkern
from hipkern.ops.paged_attention import ALIASES, VARIANTS, choose_variant, runs_here
from hipkern.reference import paged_attention_ref
from hipkern.testing import checkAllclose, poison, poison_next_alloc, rows_scaled
from hipkern.tune.core import Candidate
from hipkern.tune.paged_attention import pinned

from conftest import sm90_build

# Output: fp32 accumulation rounded once to the output dtype (half an ulp: 2^-9 bf16, 2^-12 fp16), and
# softmax weights rounded to the dtype for the PV product on matrix cores. atol is scaled by each row's
# largest |reference| where that is under 1 (check_out, hipkern.testing.rows_scaled): random outputs
# shrink like 1/sqrt(length), ~0.004 at 131072 tokens, where a fixed 8e-3 would pass wrong blocks.
TOL = {torch.bfloat16: dict(atol=8e-3, rtol=8e-3), torch.float16: dict(atol=1e-3, rtol=1e-3)}
# LSE: scores in fp32 from exact products, exp2 / log2 to ~2^-22; 2e-4 leaves room for the largest
# scores the tests make (~35), where fp32 sums of 128-256 products err by a few 1e-6 relative.
LSE_TOL = dict(atol=2e-4, rtol=2e-5)
VARIANT_NAMES = sorted(VARIANTS)


def make_case(lens, num_kv_heads=2, group=4, head_size=128, block_size=16, dtype=torch.bfloat16, layout="NHD",
              extra_blocks=3, shared=False, seed=0, num_blocks=None):
    """Random q/K/V, a random (non-contiguous) block table covering `lens`, context_lens."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    lens = list(lens)
    max_blocks = max(1, max(math.ceil(n / block_size) for n in lens)) + extra_blocks
    need = len(lens) * max_blocks
    num_blocks = num_blocks or (need // 2 + 1 if shared else need + 7)
    shape = ((num_blocks, block_size, num_kv_heads, head_size) if layout == "NHD"
             else (num_blocks, num_kv_heads, block_size, head_size))
    k = torch.randn(shape, generator=g, device="cuda").to(dtype)
    v = torch.randn(shape, generator=g, device="cuda").to(dtype)
    q = torch.randn(len(lens), num_kv_heads * group, head_size, generator=g, device="cuda").to(dtype)
    if shared:  # blocks drawn with replacement: sequences share blocks
        bt = torch.randint(0, num_blocks, (len(lens), max_blocks), generator=g, device="cuda", dtype=torch.int32)
    else:
        bt = torch.randperm(num_blocks, generator=g, device="cuda")[:need].view(len(lens), max_blocks).to(torch.int32)
    cl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return q, k, v, bt, cl


def check_out(o, ref, msg=""):
    """checkAllclose of an output with TOL's atol scaled by each row's (sequence, head) largest |ref|,
    when that is under 1. The reference is finite (it masks invalid metadata), so a NaN anywhere in `o`
    (its poison, or a NaN cache row let into a sum) fails."""
    assert torch.isfinite(ref).all(), "the reference is not finite"
    return checkAllclose(*rows_scaled(o, ref), msg=msg, **TOL[o.dtype])


def refused_here(variant, head_size):
    """Whether the op refuses `variant` at this head size on this GPU (runs_here: v16 / v5 at head size 256
    on CDNA, whose LDS their tiles do not fit)."""
    return not runs_here(variant, head_size)


def variants_here(head_size):
    return [v for v in VARIANT_NAMES if not refused_here(v, head_size)]


def run_and_check(case, layout="NHD", variant=None, scale=None, msg=""):
    """The op (variant, or the database's / a pinned choice) into poisoned outputs against the reference;
    where this GPU refuses the variant at this head size, the refusal is checked and the test skipped."""
    q, k, v, bt, cl = case
    chosen = variant or choose_variant(q, k, bt, layout)[0]
    if refused_here(chosen, q.shape[-1]):
        with pytest.raises(ValueError, match="supports head sizes 64 and 128 on this GPU"):
            hipkern.paged_attention_decode(q, k, v, bt, cl, kv_layout=layout, variant=variant, scale=scale)
        pytest.skip(f"{chosen} refuses head size {q.shape[-1]} on this GPU (checked)")
    out = poison(torch.empty_like(q))
    poison_next_alloc(q.device, (q.shape[:2], torch.float32))  # the op's own LSE tensor: unwritten shows
    o, lse = hipkern.paged_attention_decode(q, k, v, bt, cl, kv_layout=layout, out=out, return_lse=True,
                                            variant=variant, scale=scale)
    assert o is out
    ref, ref_lse = paged_attention_ref(q, k, v, bt, cl, scale=scale, kv_layout=layout)
    assert check_out(o, ref, msg=f"{msg}out ") == 0
    assert checkAllclose(lse, ref_lse, msg=f"{msg}lse ", **LSE_TOL) == 0
    return o, lse


def edge_lengths(block_size, partition=512):
    """Block, tile (64: the mma kernel's) and partition (512, 1024) boundaries +-1, and 2048."""
    return sorted({1, block_size - 1, block_size, block_size + 1, 63, 65, partition - 1, partition, partition + 1,
                   2 * partition - 1, 2 * partition + 1, 2048} - {0})


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANT_NAMES)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("group", [1, 4, 8, 64])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference(dtype, head_size, block_size, group, layout, variant):
    case = make_case(edge_lengths(block_size), num_kv_heads=2 if group < 64 else 1, group=group,
                     head_size=head_size, block_size=block_size, dtype=dtype, layout=layout,
                     seed=head_size + block_size + group)
    run_and_check(case, layout, variant)


def strided_like(case, kinds):
    """The same values as `case` in the strided forms serving engines pass: K and V as the two halves of one
    fused [blocks, 2, ...] tensor ("fused_kv"), head rows padded by 8 elements ("padded_rows"), the query
    heads a slice of a [seqs, q + 2 kv heads, D] qkv tensor ("qkv"), a query whose rows are not 16-byte
    aligned (head stride D + 1, one element in: "q_unaligned"), the block table the first columns of a wider
    one ("wide_table"). Cache and query memory outside the views is NaN, so a read of it shows; the table's extra
    columns name block 0 (a wrong row stride shifts the rows read, and the output shows it)."""
    q, k, v, bt, cl = case
    d = q.shape[-1]
    if "fused_kv" in kinds:
        kv = torch.full((k.shape[0], 2) + tuple(k.shape[1:]), math.nan, dtype=k.dtype, device=k.device)
        kv[:, 0], kv[:, 1] = k, v
        k, v = kv[:, 0], kv[:, 1]
    if "padded_rows" in kinds:
        pads = [torch.full(tuple(c.shape[:-1]) + (d + 8,), math.nan, dtype=c.dtype, device=c.device) for c in (k, v)]
        for p_, c in zip(pads, (k, v)):
            p_[..., :d] = c
        k, v = (p_[..., :d] for p_ in pads)
    if "qkv" in kinds:
        hq = q.shape[1]
        qkv = torch.full((q.shape[0], hq + 2 * (hq // 4 or 1), d), math.nan, dtype=q.dtype, device=q.device)
        qkv[:, :hq] = q
        q = qkv[:, :hq]
    if "q_unaligned" in kinds:
        n = q.shape[0] * q.shape[1] * (d + 1) + 1
        flat = torch.full((n,), math.nan, dtype=q.dtype, device=q.device)
        qu = flat[1:].as_strided(q.shape, (q.shape[1] * (d + 1), d + 1, 1))
        qu.copy_(q)
        q = qu
    if "wide_table" in kinds:
        wide = torch.zeros(bt.shape[0], bt.shape[1] + 5, dtype=bt.dtype, device=bt.device)
        wide[:, : bt.shape[1]] = bt
        bt = wide[:, : bt.shape[1]]
    return q, k, v, bt, cl


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANT_NAMES)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("group,head_size", [(8, 128), (64, 256), (4, 64)])
@pytest.mark.parametrize("kinds", [("fused_kv", "qkv", "wide_table"), ("padded_rows", "q_unaligned"),
                                   ("fused_kv", "padded_rows", "qkv", "wide_table")])
def test_strided_inputs_as_serving_engines_pass_them(kinds, group, head_size, layout, variant):
    """Every variant reads K/V, the query and the block table through their strides (the kernels take them:
    block / token / head strides, the query's sequence and head strides, the table's row stride), split and
    unsplit (mixed lengths up to 1100 tokens)."""
    case = make_case([1, 17, 600, 1100], num_kv_heads=2 if group < 64 else 1, group=group, head_size=head_size,
                     layout=layout, seed=group + head_size)
    strided = strided_like(case, kinds)
    assert not strided[1].is_contiguous() or "q_unaligned" in kinds
    run_and_check(strided, layout, variant)


@pytest.mark.gpu
@pytest.mark.parametrize("heads_per_block", [32, 64])
@pytest.mark.parametrize("head_size", [128, 256])
def test_an_unaligned_query_into_the_wide_matrix_core_blocks(heads_per_block, head_size):
    """The 32- and 64-head blocks (wgmma on sm_90) copy a query whose rows are not 16-byte aligned element by
    element into their swizzled layout; the planner picks them only for many sequences, so they are pinned."""
    case = strided_like(make_case([1, 700, 2048], num_kv_heads=1, group=64, head_size=head_size, seed=heads_per_block),
                        ("q_unaligned",))
    assert case[0].data_ptr() % 16
    with pinned(Candidate.of("v16", heads_per_block=heads_per_block)):
        run_and_check(case, variant=None)


@pytest.mark.gpu
def test_per_sequence_split_of_few_partitions():
    """v5 over many KV heads (64 x 2 sequences of one-per-SM head-256 blocks) splits each sequence into at most a
    few partitions, which its merge kernel sums with one group of threads a head."""
    case = make_case([2048, 1500], num_kv_heads=64, group=1, head_size=256, seed=5)
    run_and_check(case, variant="v5")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANT_NAMES)
@pytest.mark.parametrize("group,head_size", [(8, 128), (64, 256)])
def test_internal_buffers_are_written_before_they_are_read(variant, group, head_size):
    """The op's own buffers (the LSE, and a split's partial outputs, (m, l) states and per-sequence plan) come
    from torch's caching allocator uninitialised: the memory it will hand out is NaN-filled first, so any
    element read before it is written reaches the output or the LSE. Split and unsplit sequences, one empty."""
    from hipkern.testing import poison_free_memory

    q, k, v, bt, cl = make_case([0, 1, 700, 3000, 5000], num_kv_heads=2 if group < 64 else 1, group=group,
                                head_size=head_size, seed=7)
    if refused_here(variant, head_size):
        pytest.skip(f"{variant} refuses head size {head_size} on this GPU (test_matches_reference checks it)")
    hipkern.paged_attention_decode(q, k, v, bt, cl, variant=variant)  # module loaded outside
    out = poison(torch.empty_like(q))
    poison_free_memory(q.device)
    o, lse = hipkern.paged_attention_decode(q, k, v, bt, cl, variant=variant, out=out, return_lse=True)
    ref, ref_lse = paged_attention_ref(q, k, v, bt, cl)
    assert check_out(o, ref, msg=f"{variant} out ") == 0
    assert checkAllclose(lse, ref_lse, msg=f"{variant} lse ", **LSE_TOL) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANT_NAMES)
@pytest.mark.parametrize("group", [1, 2, 3, 6, 8, 12])
def test_odd_gqa_ratios_and_scale(variant, group):
    case = make_case([1, 100, 700], num_kv_heads=3, group=group, seed=group)
    run_and_check(case, variant=variant, scale=0.3)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_mixed_lengths_with_zeros_and_shared_blocks(variant):
    lens = torch.randint(0, 4097, (32,), generator=torch.Generator().manual_seed(1)).tolist()
    lens[3] = 0
    lens[17] = 0
    case = make_case(lens, num_kv_heads=8, group=4, shared=True)
    o, lse = run_and_check(case, variant=variant)
    assert (o[3] == 0).all() and (lse[3] == -math.inf).all()


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANT_NAMES)
@pytest.mark.parametrize("n", [32768, 131072])
@pytest.mark.parametrize("group,head_size,block_size,dtype,layout", [
    (8, 128, 16, torch.bfloat16, "NHD"),
    (64, 256, 32, torch.float16, "HND"),   # the 64-head matrix-core blocks
    (4, 64, 16, torch.bfloat16, "HND"),
    (1, 256, 32, torch.bfloat16, "NHD")])
def test_long_contexts(variant, n, group, head_size, block_size, dtype, layout):
    case = make_case([n, n // 2 + 3], num_kv_heads=2 if group < 64 else 1, group=group, head_size=head_size,
                     block_size=block_size, dtype=dtype, layout=layout, seed=group + head_size)
    run_and_check(case, layout, variant=variant)


def ramp_keys(case, lo, hi, block_size=16):
    """Each sequence's key rows scaled from lo at its first token to hi at its last (NHD caches, no shared
    blocks), so its scores' spread, and their running max, change steadily along the context."""
    q, k, v, bt, cl = case
    for s, n in enumerate(cl.tolist()):
        t = torch.arange(n, device="cuda")
        f = lo + (hi - lo) * t.float() / max(1, n - 1)
        blk, slot = bt[s, t // block_size].long(), t % block_size
        k[blk, slot] = (k[blk, slot].float() * f[:, None, None]).to(k.dtype)
    return case


@pytest.mark.gpu
@pytest.mark.parametrize("lo,hi", [(0.5, 16.0), (16.0, 0.5)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pin", [("v16", 16, 128), ("v16", 16, 256), ("v16", 32, 256), ("v16", 64, 256),
                                 ("v16", 64, 128), ("v6", 16, 128), ("v6", 16, 256), ("v3", 0, 128),
                                 ("v5", 0, 128), ("v9", 0, 256)])
def test_rising_and_falling_score_ranges(pin, dtype, lo, hi):
    """Keys scaled along each context (ramp_keys) so that the running max of the scores climbs by ~1-2
    log2 units a 64-token tile, ~50 in all (or falls from there): a kernel that rescales its output only
    once the max has risen by more than kRescaleSlack (online_softmax.h) must take both paths, a stale max
    for several tiles (P up to 2^8) and then a rescale, in every block kind (16-, 32- and 64-head v16
    blocks, head size 128 and 256: token slices, the column split and wgmma; v6; the CUDA-core kernels).
    Each runs its default plan (many partitions, the merge kernel), partitions of 512, of 1024 (5 at most:
    merged in clusters on sm_90) and of 8192 (unsplit: one block over all 65 tiles, its stale max
    normalised by finish()). v3 and v5 take these as their smallest partitions."""
    variant, heads, head_size = pin
    group = heads if heads > 16 else 8
    lens = [1, 64, 65, 700, 2048, 4100]
    case = ramp_keys(make_case(lens, num_kv_heads=1 if group > 16 else 2, group=group, head_size=head_size,
                               dtype=dtype, seed=head_size + heads), lo, hi)
    pinned_heads = {"heads_per_block": heads} if heads else {}
    for extra in ({}, {"partition_size": 512}, {"partition_size": 1024}, {"partition_size": 8192}):
        with pinned(Candidate.of(variant, **pinned_heads, **extra)):
            run_and_check(case, variant=None, msg=f"{pin} {extra} ")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANT_NAMES)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("block_size,head_size,group", [(1, 128, 8), (2, 64, 8), (4, 256, 8), (8, 128, 8),
                                                        (8, 256, 8), (64, 128, 8), (128, 64, 8), (1024, 256, 8),
                                                        (1, 128, 64), (4, 256, 64), (8, 64, 64), (16, 256, 64),
                                                        (64, 128, 64)])
def test_other_block_sizes_with_nan_past_each_end(variant, layout, block_size, head_size, group):
    """Block sizes beside 16 / 32 (the kernels copy K/V a cache block at a time where they can: groups
    of 16 tokens, 8 in the 64-head blocks of group 64), with every cache row past a sequence's end in
    its blocks set to NaN: a kernel that lets one into a sum fails. Lengths at the block, 8- and
    16-token, 64-token tile and partition edges."""
    lens = [1, 5, 9, 17, 63, 64, 65, 300, 1000, 1025]
    q, k, v, bt, cl = make_case(lens, num_kv_heads=2, group=group, head_size=head_size, block_size=block_size,
                                layout=layout, seed=block_size + head_size + group)
    kk, vv = (k, v) if layout == "NHD" else (k.transpose(1, 2), v.transpose(1, 2))  # [block, token, head, D] views
    pos = torch.arange(bt.shape[1] * block_size, device="cuda")
    for s, n in enumerate(lens):
        past = pos[n:]
        blocks, rows = bt[s, past // block_size].long(), past % block_size
        kk[blocks, rows] = float("nan")
        vv[blocks, rows] = float("nan")
    run_and_check((q, k, v, bt, cl), layout, variant, msg=f"{variant} bs={block_size} ")


@pytest.mark.gpu
@pytest.mark.parametrize("layout,bs", [("NHD", 16), ("HND", 32)])
def test_cache_over_65536_blocks_and_2_pow_31_elements_read_at_far_end(layout, bs):
    """70000 blocks: 2.29e9 elements a cache at block 16, 4.59e9 (past 2^32: unsigned 32-bit offsets
    wrap too) at block 32. Every block but the 140 read is NaN."""
    nb, hkv, d = 70000, 8, 256
    shape = (nb, bs, hkv, d) if layout == "NHD" else (nb, hkv, bs, d)
    k = torch.full(shape, math.nan, dtype=torch.bfloat16, device="cuda")
    v = torch.full_like(k, math.nan)
    far = torch.arange(nb - 140, nb, device="cuda", dtype=torch.int32)
    k[far.long()] = torch.randn((140, *shape[1:]), device="cuda").to(torch.bfloat16)
    v[far.long()] = torch.randn((140, *shape[1:]), device="cuda").to(torch.bfloat16)
    bt = far.flip(0).view(2, 70).contiguous()
    q = torch.randn(2, hkv * 4, d, device="cuda").to(torch.bfloat16)
    cl = torch.tensor([70 * bs, 7 * bs + 5], dtype=torch.int32, device="cuda")
    assert k.numel() > (2**32 if bs == 32 else 2**31)
    try:
        for variant in variants_here(d):
            run_and_check((q, k, v, bt, cl), layout, variant=variant)
        if not refused_here("v16", d):
            with pinned(Candidate.of("v16", partition_size=65536)):  # one partition: tiles prefetched
                run_and_check((q, k, v, bt, cl), layout, variant=None)
    finally:  # 18 GB at block 32: not left to the next tests, pass or fail
        del k, v
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("n", [40, 1500])
def test_invalid_metadata_never_reads_out_of_bounds(n):
    """Invalid block ids (negative, past the cache) and a context length past the block-table row, with
    NaN in every block the table does not name; at 1500 tokens also through v16's unsplit 16-head
    blocks, which ask L2 for each tile's rows ahead of their copies."""
    q, k, v, bt, cl = make_case([n, n], num_kv_heads=1, group=4)
    bt[0, 1] = -5
    bt[0, n // 32] = -7
    bt[1, 0] = k.shape[0] + 1000
    bt[1, n // 20] = k.shape[0]
    cl[1] = 10**6  # beyond what the block-table row addresses: clamped
    unused = sorted(set(range(k.shape[0])) - set(bt.flatten().tolist()))
    if 0 not in unused:  # block 0 (where a masked token's row would point if offsets were clamped) too
        bt[bt == 0] = unused.pop()
        unused.append(0)
    k[unused], v[unused] = float("nan"), float("nan")  # a masked token must not read (or weigh) these
    ref, ref_lse = paged_attention_ref(q, k, v, bt, cl)  # it masks the bad ids as the op documents

    def check(variant, msg):
        out = poison(torch.empty_like(q))
        poison_next_alloc(q.device, (q.shape[:2], torch.float32))
        o, lse = hipkern.paged_attention_decode(q, k, v, bt, cl, variant=variant, out=out, return_lse=True)
        assert check_out(o, ref, msg=f"{msg} out ") == 0
        assert checkAllclose(lse, ref_lse, msg=f"{msg} lse ", **LSE_TOL) == 0

    for variant in VARIANT_NAMES:
        check(variant, variant)
    with pinned(Candidate.of("v16", heads_per_block=16, partition_size=65536)):
        check(None, "v16 unsplit 16-head")


def _masked_loop(q, k, v, bt, cl, scale=None):
    """The op's documented handling of bad metadata (NHD), in float32, token by token (independent of the
    reference): a length clamped to [0, what the block-table row addresses]; a token whose block id is
    outside [0, num_blocks) is left out (masked), the sequence's other tokens attended as usual."""
    nb, bs, hkv, d = k.shape
    group = q.shape[1] // hkv
    scale = d ** -0.5 if scale is None else scale
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
    for s in range(q.shape[0]):
        n = max(0, min(int(cl[s]), bt.shape[1] * bs))
        t = torch.arange(n, device=q.device)
        blk = bt[s, t // bs].long()
        keep = (blk >= 0) & (blk < nb)
        t, blk = t[keep], blk[keep]
        if t.numel() == 0:
            continue
        kk, vv = k[blk, t % bs].float(), v[blk, t % bs].float()  # [tokens, hkv, d]
        scores = torch.einsum("hgd,nhd->hgn", q[s].float().view(hkv, group, d), kk) * scale
        lse[s] = torch.logsumexp(scores, dim=-1).reshape(-1)
        out[s] = torch.einsum("hgn,nhd->hgd", torch.softmax(scores, dim=-1), vv).reshape(-1, d)
    return out, lse


GRAPH_CASES = [(v, None) for v in VARIANT_NAMES] + [  # (variant, pinned v16 plan) on group 64, head 256:
    ("v16", dict(heads_per_block=64, partition_size=512)),   # 2-4 partitions: merged in clusters on sm_90
    ("v16", dict(heads_per_block=64, partition_size=64)),    # up to 32 partitions: the merge kernel
    ("v16", dict(heads_per_block=16, partition_size=65536))]  # unsplit 16-head blocks, tiles prefetched


@pytest.mark.gpu
@pytest.mark.parametrize("variant,pin", GRAPH_CASES)
def test_cuda_graph_replay_with_new_lengths_and_tables(variant, pin):
    """Captured once (the LSE tensor allocated inside the capture), replayed with new query, K/V, block
    tables and context lengths; output and LSE checked after each replay."""
    group, kv_heads, head_size = (8, 2, 128) if pin is None else (64, 1, 256)
    if refused_here(variant, head_size):
        pytest.skip(f"{variant} refuses head size {head_size} on this GPU")
    q, k, v, bt, cl = make_case([300, 1000, 5], num_kv_heads=kv_heads, group=group, head_size=head_size,
                                extra_blocks=70)
    out = torch.empty_like(q)
    with pinned(Candidate.of("v16", **pin)) if pin else contextlib.nullcontext():
        run = variant if pin is None else None
        hipkern.paged_attention_decode(q, k, v, bt, cl, out=out, variant=run)  # warm-up outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _, lse = hipkern.paged_attention_decode(q, k, v, bt, cl, out=out, variant=run, return_lse=True)
    g = torch.Generator(device="cuda").manual_seed(5)
    for lens in ([1, 2000, 1100], [0, 17, 1500], [1100, 1, 513]):
        q.copy_(torch.randn(q.shape, generator=g, device="cuda"))
        k.copy_(torch.randn(k.shape, generator=g, device="cuda")), v.copy_(torch.randn(v.shape, generator=g, device="cuda"))
        bt.copy_(torch.randperm(k.shape[0], generator=g, device="cuda")[: bt.numel()].view(bt.shape))
        cl.copy_(torch.tensor(lens, dtype=torch.int32))
        poison(out), poison(lse)
        graph.replay()
        ref, ref_lse = paged_attention_ref(q, k, v, bt, cl)
        assert check_out(out, ref, msg=f"{lens} ") == 0
        assert checkAllclose(lse, ref_lse, msg=f"{lens} lse ", **LSE_TOL) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("partition_size", [64, 100, 128, 512])
def test_pinned_partition_sizes_on_two_streams(partition_size):
    """Partition boundaries +-1, up to 64 partitions and an empty context in one batch, each variant
    pinned to a partition size, on the default and a side stream. 100 is no multiple of any kernel's
    tile (a database row may hold it): the op rounds it up to whole tiles."""
    lens = [0, 1, partition_size - 1, partition_size, partition_size + 1, 3 * partition_size + 7, 4096]
    case = make_case(lens, num_kv_heads=2, group=8, seed=partition_size)
    side = torch.cuda.Stream()
    for variant in VARIANT_NAMES:  # v5: its smallest partition
        with pinned(Candidate.of(variant, partition_size=partition_size)):
            for _ in range(2):
                o, lse = run_and_check(case, variant=None, msg=f"{variant} ")
                assert (o[0] == 0).all() and (lse[0] == -math.inf).all()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                run_and_check(case, variant=None, msg=f"{variant} side stream ")
            torch.cuda.current_stream().wait_stream(side)


@pytest.mark.gpu
@pytest.mark.parametrize("variant,partition_size", [("v16", 128), ("v3", 256), ("v5", 64), ("v9", 128)])
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_merge_of_many_partitions_odd_head_count(variant, partition_size, head_size):
    """Splits of more than 4 partitions (up to 33), whose merge kernel spreads each head's partials over
    groups of threads that meet in shared memory (2 heads a block at head size 64, where an odd head count
    leaves the last block's second head empty; at most 4 partitions take the one-group kernel): mixed
    lengths with an empty context and partition boundaries, 9 query heads on 3 KV heads."""
    lens = [0, 1, partition_size - 1, partition_size + 1, 5 * partition_size, 7 * partition_size + 3,
            33 * partition_size - 5]
    case = make_case(lens, num_kv_heads=3, group=3, head_size=head_size, seed=head_size + partition_size)
    with pinned(Candidate.of(variant, partition_size=partition_size)):
        o, lse = run_and_check(case, variant=None, msg=f"{variant} ")
    assert (o[0] == 0).all() and (lse[0] == -math.inf).all()


@pytest.mark.gpu
@pytest.mark.parametrize("variant,partition_size,num_seqs,head_size,dtype", [
    ("v16", 512, 32, 256, torch.bfloat16), ("v16", 512, 40, 128, torch.float16), ("v16", 128, 8, 256, torch.bfloat16),
    ("v3", 512, 24, 256, torch.bfloat16), ("v5", 256, 64, 256, torch.bfloat16)])
def test_partials_dropped_from_l2_once_merged(variant, partition_size, num_seqs, head_size, dtype):
    """Splits whose partial outputs are >= 4 MB (64 heads of 256: 64 KB a partition; kDropPartialsBytes in
    common.h), so that the merge kernel drops their L2 lines once it has read them (discard_l2): one and
    two groups of threads a head (4 / 16 partitions of a 2048-token table), the uniform and the per-sequence
    split, head sizes 256 and 128. (v16's 32 x 4 blocks do not fit one round as clusters on the H100: the
    benchmark's plan; 16 partitions are more than a cluster; v3 never runs clusters.) A line dropped before
    every lane that reads it has used it would give garbage. Two calls on new queries (the first's workspace
    reused by the second), each against the reference, and a third bitwise equal to the second."""
    g = torch.Generator().manual_seed(partition_size + num_seqs)
    lens = [1, partition_size, 2048] + torch.randint(1, 2049, (num_seqs - 3,), generator=g).tolist()
    q, k, v, bt, cl = make_case(lens, num_kv_heads=1, group=64, head_size=head_size, dtype=dtype, extra_blocks=0,
                                seed=num_seqs)  # (the table: exactly 2048 tokens)
    with pinned(Candidate.of(variant, partition_size=partition_size)):
        run_and_check((q, k, v, bt, cl), variant=None, msg=f"{variant} ")
        q2 = torch.randn(q.shape, generator=g).to(q)
        o2, lse2 = run_and_check((q2, k, v, bt, cl), variant=None, msg=f"{variant} second ")
        o3, lse3 = hipkern.paged_attention_decode(q2, k, v, bt, cl, return_lse=True)
    assert torch.equal(o2, o3) and torch.equal(lse2, lse3)


@pytest.mark.gpu
@pytest.mark.parametrize("blocks_per_slot", [1, 2, 3, 64])
@pytest.mark.parametrize("group", [4, 64])
def test_per_sequence_split_one_long_among_short(blocks_per_slot, group):
    """v5: one long sequence among many short and empty ones, at each split target (64: far more
    partitions than tiles, so every partition is one tile), on poisoned outputs."""
    lens = [1, 17, 0, 65, 70000, 3, 64, 0, 129, 2000] * 3
    case = make_case(lens, num_kv_heads=2 if group < 64 else 1, group=group, head_size=64, seed=blocks_per_slot)
    with pinned(Candidate.of("v5", blocks_per_slot=blocks_per_slot)):
        o, lse = run_and_check(case, variant=None)
    assert (o[2] == 0).all() and (lse[7] == -math.inf).all()


@pytest.mark.gpu
def test_per_sequence_split_at_its_sequence_limit():
    from hipkern.ops.paged_attention import MAX_PER_SEQUENCE_SEQS

    lens = torch.randint(0, 300, (MAX_PER_SEQUENCE_SEQS,), generator=torch.Generator().manual_seed(3)).tolist()
    lens[-1] = 5000
    case = make_case(lens, num_kv_heads=1, group=8, head_size=64, extra_blocks=0)
    run_and_check(case, variant="v5")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_the_most_sequences_accepted(variant):
    """65535 sequences (the grid dimension they index) of 0..40 tokens; v5 refuses more than its 4096.
    A sample of rows (both ends, the empty ones, random) is compared with the reference."""
    from hipkern.ops.paged_attention import MAX_PER_SEQUENCE_SEQS
    lens = torch.randint(0, 41, (65535,), generator=torch.Generator().manual_seed(9))
    lens[-1] = 40
    case = make_case(lens.tolist(), num_kv_heads=2, group=4, head_size=64, extra_blocks=0)
    q, k, v, bt, cl = case
    out = poison(torch.empty_like(q))
    if VARIANTS[variant].max_seqs < 65535:
        assert VARIANTS[variant].max_seqs == MAX_PER_SEQUENCE_SEQS
        with pytest.raises(ValueError, match="at most 4096 sequences"):
            hipkern.paged_attention_decode(q, k, v, bt, cl, out=out, variant=variant)
        return
    poison_next_alloc(q.device, (q.shape[:2], torch.float32))
    o, lse = hipkern.paged_attention_decode(q, k, v, bt, cl, out=out, variant=variant, return_lse=True)
    zeros = (lens == 0).nonzero().flatten()[:50]
    rows = torch.cat([torch.arange(64), torch.arange(65535 - 64, 65535), zeros,
                      torch.randperm(65535, generator=torch.Generator().manual_seed(1))[:512]]).unique().cuda()
    ref, ref_lse = paged_attention_ref(q[rows], k, v, bt[rows], cl[rows])
    assert check_out(o[rows], ref) == 0
    assert checkAllclose(lse[rows], ref_lse, **LSE_TOL) == 0
    assert not o.isnan().any() and not lse.isnan().any()


@pytest.mark.gpu
def test_per_sequence_variant_from_the_database_above_its_limit_runs_v16():
    from hipkern.ops.paged_attention import MAX_PER_SEQUENCE_SEQS
    case = make_case([5, 40] * (MAX_PER_SEQUENCE_SEQS // 2 + 1), num_kv_heads=1, group=4, head_size=64, extra_blocks=0)
    with pinned(Candidate.of("v5")):
        run_and_check(case, variant=None)


@pytest.mark.gpu
@pytest.mark.parametrize("heads_per_block", [16, 32, 64])
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_group_split_over_blocks(heads_per_block, head_size):
    """A GQA group of 64 (and an odd one of 40) taken by 16-, 32- or 64-head blocks (64: one block per
    group, on wgmma where the build has it), split and unsplit."""
    for group in (64, 40):
        case = make_case([1, 63, 64, 65, 700], num_kv_heads=2, group=group, head_size=head_size, seed=group)
        for extra in ({}, {"partition_size": 64}, {"partition_size": 512}):
            with pinned(Candidate.of("v16", heads_per_block=heads_per_block, **extra)):
                run_and_check(case, variant=None, msg=f"group {group} {extra} ")


@pytest.mark.gpu
@pytest.mark.parametrize("heads_per_block", [16, 32])
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_long_partitions_prefetched_into_l2(heads_per_block, head_size):
    """Partitions of 16 tiles and more, where v16's 16- and 32-head blocks ask L2 for each tile's rows a
    tile ahead of their copies (builds that copy with cp.async, not tensor-map boxes): lengths around
    that threshold (959 / 1023 tokens: 15 / 16 tiles), a partition boundary and an empty context,
    unsplit and split."""
    lens = [0, 1, 959, 1023, 1024, 1025, 2047, 4103]
    case = make_case(lens, num_kv_heads=2, group=heads_per_block, head_size=head_size,
                     seed=head_size + heads_per_block)
    for partition_size in (1024, 65536):
        with pinned(Candidate.of("v16", heads_per_block=heads_per_block, partition_size=partition_size)):
            o, lse = run_and_check(case, variant=None, msg=f"partitions of {partition_size} ")
        assert (o[0] == 0).all() and (lse[0] == -math.inf).all()


@pytest.mark.gpu
@pytest.mark.parametrize("variant,heads_per_block", [("v16", 16), ("v16", 32), ("v16", 64), ("v6", 16)])
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_split_merged_in_clusters(variant, heads_per_block, head_size):
    """Uniform splits of 2..8 partitions of 64 tokens, merged inside thread-block clusters where the GPU
    has them (sm_90: asserted), else by the merge kernel: full, partly empty (skipped blocks in a
    cluster), single-partition (unmerged) and empty contexts in one batch, every block kind; 16- and
    32-head blocks on a group that also leaves a partly filled block (8 heads)."""
    from hipkern.ops._common import module_for
    from hipkern.ops.paged_attention import merges_in_clusters
    group, kv_heads = {16: 24, 32: 40, 64: 64}[heads_per_block], 1
    mod = module_for("paged_attention", torch.cuda.current_device(), dtype="bfloat16", head_size=head_size)
    clusters = sm90_build()
    pin = {"heads_per_block": heads_per_block} if variant == "v16" else {}
    used = []
    for parts in range(2, 9):
        n = 64 * parts
        lens = [n, 1, 63, 64, 65, 0, n - 1, n - 63, n // 2 + 1]
        case = make_case(lens, num_kv_heads=kv_heads, group=group, head_size=head_size, extra_blocks=0,
                         seed=parts + head_size)
        assert case[3].shape[1] * 16 == n  # the block table addresses exactly `parts` partitions
        blocks = len(lens) * kv_heads * -(-group // heads_per_block) * parts
        kernel = "mma_small" if variant == "v6" else "mma"
        used.append(merges_in_clusters(mod, kernel, heads_per_block, parts, blocks, case[0].get_device()))
        with pinned(Candidate.of(variant, partition_size=64, **pin)):
            o, lse = run_and_check(case, variant=None, msg=f"{parts} partitions (clusters: {used[-1]}) ")
        assert (o[5] == 0).all() and (lse[5] == -math.inf).all()
    assert used[0] == clusters and (clusters or not any(used))  # 2 partitions always fit clusters on sm_90


@pytest.mark.gpu
@pytest.mark.parametrize("heads_per_block,head_size", [(16, 256), (16, 128), (64, 256)])
def test_trace_records_every_point_in_order(heads_per_block, head_size):
    """hipkern.bench.pa_trace (the HK_PA_TRACE build) on a split merged in clusters (sm_90) or by the merge
    kernel: every block records every point of its path, and the points' medians come in order."""
    if torch.version.cuda is None:
        pytest.skip("the traced build is NVIDIA only")
    from hipkern.bench import pa_trace

    with pinned(Candidate.of("v16", partition_size=64, heads_per_block=heads_per_block)):
        t = pa_trace.run(2, 256, 64, 1 if heads_per_block == 64 else 4, head_size, calls=3)
    clusters = sm90_build()
    want = [p for p in pa_trace.POINTS if clusters or p != "cluster barrier passed"]
    assert list(t) == want
    medians = [t[p][2] for p in want]
    assert t["start"][0] == 0 and all(a <= b for a, b in zip(medians, medians[1:])), t
    assert 0 < medians[-1] < 1000, t


@pytest.mark.gpu
@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_aliases_run_their_variant(alias):
    case = make_case([1, 64, 1000], num_kv_heads=2, group=8)
    o, _ = run_and_check(case, variant=alias)
    assert torch.equal(o, hipkern.paged_attention_decode(*case, variant=ALIASES[alias]))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_deterministic(variant):
    q, k, v, bt, cl = make_case([3000, 77, 1500], num_kv_heads=4, group=8)
    first = hipkern.paged_attention_decode(q, k, v, bt, cl, variant=variant)
    for _ in range(5):
        assert torch.equal(hipkern.paged_attention_decode(q, k, v, bt, cl, variant=variant), first)


@pytest.mark.gpu
def test_torch_compile():
    q, k, v, bt, cl = make_case([100, 900], num_kv_heads=2, group=4)

    def f(q, k, v, bt, cl):
        return hipkern.paged_attention_decode(q, k, v, bt, cl) * 2

    out = torch.compile(f, fullgraph=True)(q, k, v, bt, cl)
    ref, _ = paged_attention_ref(q, k, v, bt, cl)
    assert check_out(out / 2, ref) == 0


# ------------------------------------------------------------------------ validation (any device)
def _cpu_case(layout="NHD", **kw):
    s, hq, hkv, d, bs, nb = 2, 8, 2, 128, 16, 10
    shape = (nb, bs, hkv, d) if layout == "NHD" else (nb, hkv, bs, d)
    c = dict(query=torch.randn(s, hq, d, dtype=torch.bfloat16), key_cache=torch.randn(shape, dtype=torch.bfloat16),
             value_cache=torch.randn(shape, dtype=torch.bfloat16), block_tables=torch.zeros(s, 4, dtype=torch.int32),
             context_lens=torch.ones(s, dtype=torch.int32))
    c.update(kw)
    return c


def _call(c, **kw):
    args = [c.pop(n) for n in ("query", "key_cache", "value_cache", "block_tables", "context_lens")]
    return hipkern.paged_attention_decode(*args, **c, **kw)


@pytest.mark.parametrize("change,kw,match", [
    (dict(query=torch.randn(2, 8, 128)), {}, "query must be one of float16, bfloat16, got float32"),
    (dict(query=torch.randn(2, 8, 96, dtype=torch.bfloat16)), {}, "query head size must be one of"),
    (dict(query=torch.randn(2, 8, dtype=torch.bfloat16)), {}, "query must have 3 dimensions"),
    (dict(query=torch.randn(2, 128, 8, dtype=torch.bfloat16).transpose(1, 2)), {}, "query must have a contiguous last"),
    (dict(key_cache=torch.randn(10, 16, 2, 128, dtype=torch.bfloat16).transpose(2, 3).contiguous().transpose(2, 3),
          value_cache=torch.randn(10, 16, 2, 128, dtype=torch.bfloat16)), {}, "key_cache must have a contiguous last"),
    (dict(key_cache=torch.randn(10, 16, 2, 64, dtype=torch.bfloat16),
          value_cache=torch.randn(10, 16, 2, 64, dtype=torch.bfloat16)), {}, "key_cache head size 64 .* differs"),
    (dict(query=torch.randn(65536, 8, 128, dtype=torch.bfloat16), block_tables=torch.zeros(65536, 4, dtype=torch.int32),
          context_lens=torch.ones(65536, dtype=torch.int32)), {}, "query must hold 1..65535 sequences"),
    (dict(key_cache=torch.randn(10, 16, 2, 128, dtype=torch.float16)), {}, "key_cache must be one of bfloat16"),
    (dict(value_cache=torch.randn(10, 16, 2, 64, dtype=torch.bfloat16)), {}, "value_cache must have the shape"),
    (dict(key_cache=torch.randn(10, 16, 2, 132, dtype=torch.bfloat16)[..., :128],
          value_cache=torch.randn(10, 16, 2, 132, dtype=torch.bfloat16)[..., :128]), {}, "key_cache/value_cache rows must be 16-byte aligned"),
    (dict(key_cache=torch.randn(10, 16, 3, 128, dtype=torch.bfloat16),
          value_cache=torch.randn(10, 16, 3, 128, dtype=torch.bfloat16)), {}, r"multiple of key_cache's KV heads"),
    (dict(key_cache=torch.randn(10, 12, 2, 128, dtype=torch.bfloat16),
          value_cache=torch.randn(10, 12, 2, 128, dtype=torch.bfloat16)), {}, "key_cache block size must be a power of two"),
    (dict(query=torch.randn(2, 9, 128, dtype=torch.bfloat16)), {}, "multiple of key_cache.s KV heads"),
    (dict(block_tables=torch.zeros(2, 4, dtype=torch.int64)), {}, "block_tables must be one of int32"),
    (dict(block_tables=torch.zeros(3, 4, dtype=torch.int32)), {}, r"block_tables must be \[num_seqs=2"),
    (dict(context_lens=torch.ones(3, dtype=torch.int32)), {}, r"context_lens must have shape \(2,\)"),
    (dict(context_lens=torch.ones(2, dtype=torch.int64)), {}, "context_lens must be one of int32"),
    ({}, dict(kv_layout="NDH"), "kv_layout must be one of"),
    ({}, dict(variant="v99"), "variant must be None or one of"),
    ({}, dict(variant="v8"), r"variant must be None or one of \['v16', 'v3', 'v5', 'v6', 'v9', 'v4', 'v7'\]"),
    (dict(query=torch.randn(4097, 8, 128, dtype=torch.bfloat16), block_tables=torch.zeros(4097, 4, dtype=torch.int32),
          context_lens=torch.ones(4097, dtype=torch.int32)), dict(variant="v5"), "v5 supports at most 4096 sequences"),
    ({}, dict(scale=float("nan")), r"scale must be a float with scale \* log2\(e\) finite in float32"),
    ({}, dict(scale=1e39), "scale must be a float with"),  # finite in float64, inf in the kernels
    ({}, dict(scale=10**400), "scale must be a float with"),
    ({}, dict(scale=3e38), "scale must be a float with"),  # finite in float32, but not times log2(e)
    ({}, dict(variant=["v3"]), "variant must be None or a str, got list"),
    (dict(query=torch.randn(2, 0, 128, dtype=torch.bfloat16)), {}, "query must have at least one head"),
    ({}, dict(return_lse=1), "return_lse must be a bool"),
    ({}, dict(out=torch.empty(2, 8, 64, dtype=torch.bfloat16)), r"out must have shape \(2, 8, 128\)"),
    ({}, {}, "query must be on a GPU"),
])
def test_bad_arguments_raise_value_error(change, kw, match):
    with pytest.raises(ValueError, match=match) as err:
        _call(_cpu_case(**change), **kw)
    if "GPU" not in match:  # the bad argument's own check fired, not the last one (CPU tensors' device check)
        assert "must be on a GPU" not in str(err.value), str(err.value)


def test_the_registered_op_s_fake_validates_too():
    """torch.ops.hipkern.paged_attention_decode traced (fake tensors, as torch.compile does) checks its
    arguments as the Python function does, and its lse, instead of tracing a call that fails later."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 8, 128, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(10, 16, 2, 128, dtype=torch.bfloat16, device="cuda")
        bt, cl = torch.empty(2, 4, dtype=torch.int32, device="cuda"), torch.empty(2, dtype=torch.int32, device="cuda")
        out, lse = torch.empty_like(q), torch.empty(2, 8, device="cuda")
        torch.ops.hipkern.paged_attention_decode(q, k, k, bt, cl, 0.1, "NHD", "v4", out, lse)
        with pytest.raises(ValueError, match=r"context_lens must have shape \(2,\)"):
            torch.ops.hipkern.paged_attention_decode(q, k, k, bt, torch.empty(1, dtype=torch.int32, device="cuda"),
                                                     0.1, "NHD", "", out, lse)
        with pytest.raises(ValueError, match=r"lse must have shape \(2, 8\)"):
            torch.ops.hipkern.paged_attention_decode(q, k, k, bt, cl, 0.1, "NHD", "", out,
                                                     torch.empty(1, 8, device="cuda"))
        with pytest.raises(ValueError, match="scale must be a float with"):
            torch.ops.hipkern.paged_attention_decode(q, k, k, bt, cl, 3e38, "NHD", "", out, lse)


def test_empty_cache_and_oversized_tables_rejected():
    c = _cpu_case(key_cache=torch.randn(0, 16, 2, 128, dtype=torch.bfloat16),
                  value_cache=torch.randn(0, 16, 2, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="key_cache must hold at least one block"):
        _call(c)
    wide = torch.empty(2, 2**26, dtype=torch.int32)  # never touched; 2^26 blocks x 16 tokens = 2^30 > 2^30 - 1
    with pytest.raises(ValueError, match=r"block_tables addresses 1073741824 tokens per sequence"):
        _call(_cpu_case(block_tables=wide))


def test_split_stays_within_the_grid():
    from hipkern.ops.paged_attention import MAX_PARTITIONS, Shape, _split

    for max_tokens, size in ((2**30 - 1, 512), (10**8, 1), (4096, 512), (100, 512)):
        shape = Shape(1, 1, 1, max_tokens, 132, 128, 1)
        plan = _split(shape, size)
        assert 1 <= plan.num_partitions <= MAX_PARTITIONS
        assert plan.num_partitions * plan.partition_size >= max_tokens
        assert plan.num_partitions == 1 or (plan.num_partitions - 1) * plan.partition_size < max_tokens
        assert plan.num_partitions == 1 or plan.partition_size % shape.tile == 0  # whole tiles
    assert _split(Shape(1, 1, 1, 4096, 132, 64, 1), 100) == _split(Shape(1, 1, 1, 4096, 132, 64, 1), 128)


def test_split_keeps_hip_grids_under_2_pow_32_threads():
    """On 64-lane waves (HIP, which runs a grid of 2^32 threads or more wrongly and whose launcher refuses
    one) a split's partitions grow until its decode grid has at most HIP_MAX_GRID_BLOCKS blocks: e.g. v3 at
    4096 sequences x 32 KV heads of a 2^17-token block table, 256 partitions of 512 tokens (2^25 blocks)."""
    from hipkern.ops.paged_attention import HIP_MAX_GRID_BLOCKS, MAX_PARTITIONS, VARIANTS, _split, make_shape

    for name, seqs, kv_heads, tokens in (("v3", 4096, 32, 2**17), ("v9", 4096, 8, 2**20), ("v9", 65535, 64, 2**17),
                                         ("v16", 4096, 32, 2**20)):
        var = VARIANTS[name]
        for wave in (32, 64):
            shape = make_shape(var, seqs, kv_heads * 8, kv_heads, tokens, 304, wave)
            assert shape.max_grid_blocks == (HIP_MAX_GRID_BLOCKS if wave == 64 else 0)
            for size in (64, 512, None):
                plan = _split(shape, size) if size else var.plan(shape)
                assert plan.num_partitions * plan.partition_size >= tokens
                assert plan.num_partitions == 1 or plan.partition_size % shape.tile == 0
                assert plan.num_partitions <= MAX_PARTITIONS
                if wave == 64 and shape.blocks <= HIP_MAX_GRID_BLOCKS:
                    assert shape.blocks * plan.num_partitions <= HIP_MAX_GRID_BLOCKS, (name, seqs, size, plan)
    # v5's per-sequence split: its num_seqs + split_target items of per-item blocks stay under the cap too
    for seqs, kv_heads, bps in ((4096, 64, 1), (4096, 128, 4096), (1, 1, 64)):  # (the second: capped)
        shape = make_shape(VARIANTS["v5"], seqs, kv_heads * 64, kv_heads, 2**17, 304, 64, resident=4)
        plan = VARIANTS["v5"].plan(shape, blocks_per_slot=bps)
        per_item = shape.blocks // seqs
        assert plan.per_sequence and 1 <= plan.num_partitions <= 65535 - seqs
        assert per_item * (seqs + plan.num_partitions) <= HIP_MAX_GRID_BLOCKS, (seqs, kv_heads, bps, plan)
    # a grid past the cap even unsplit (65535 x 65 KV heads) runs one pass (the launcher then judges it)
    shape = make_shape(VARIANTS["v9"], 65535, 65 * 4, 65, 2**17, 304, 64)
    assert shape.blocks > HIP_MAX_GRID_BLOCKS and _split(shape, 512).num_partitions == 1
    # 32-lane waves keep the partitions asked for
    shape = make_shape(VARIANTS["v9"], 4096, 256, 32, 2**20, 132, 32)
    assert _split(shape, 512).num_partitions == 2**11


def test_balanced_plan_splits_only_grids_short_of_the_memory_rate():
    from hipkern.ops.paged_attention import SATURATE_BLOCKS, Shape, _plan_balanced

    # (sequences, KV heads) x 2048 tokens of 16-head blocks, two an SM (head 128 on the H100): 128 blocks
    # already stream at the memory's rate, so a split would add only its merge (measured 2.5-3.5 % slower
    # at 16 x 2048 x 8 KV heads); 64 blocks do not, and are split (8 x 2048: 30.0 us in 2 partitions against
    # 34.7 unsplit).
    def plan(seqs, kv_heads, tokens=2048):
        return _plan_balanced(Shape(seqs, kv_heads, 8, tokens, 132, 64, 16, resident=2))

    assert 64 < SATURATE_BLOCKS < 128
    assert plan(16, 8).num_partitions == 1 and plan(16, 8, 65536).num_partitions == 1
    assert plan(8, 8).num_partitions > 1
    assert plan(32, 8).num_partitions == 1  # 256 blocks: one pass, as before
    assert plan(1, 8).num_partitions > 1  # 8 blocks: split for the SMs, as before
    # 288 blocks: a second wave of 24 would stream alone, far under the memory's rate: split, as before
    assert plan(36, 8).num_partitions > 1


def test_gqa_above_64_rejected():
    c = _cpu_case(query=torch.randn(2, 130, 128, dtype=torch.bfloat16),
                  key_cache=torch.randn(10, 16, 1, 128, dtype=torch.bfloat16),
                  value_cache=torch.randn(10, 16, 1, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="GQA ratio query heads / KV heads must be at most 64, got 130"):
        _call(c)


def test_reference_masks_bad_metadata_as_the_op_documents():
    """paged_attention_ref (the GPU tests' reference) on invalid block ids and lengths past the row or
    below 0, against a token-by-token loop."""
    g = torch.Generator().manual_seed(3)
    for bs in (1, 4, 16):
        k, v = torch.randn(20, bs, 2, 64, generator=g), torch.randn(20, bs, 2, 64, generator=g)
        q = torch.randn(3, 8, 64, generator=g)
        bt = torch.randint(-3, 23, (3, 6), generator=g, dtype=torch.int32)
        cl = torch.tensor([-5, 3 * bs + 1, 10**6], dtype=torch.int32)
        ref, ref_lse = paged_attention_ref(q, k, v, bt, cl)
        want, want_lse = _masked_loop(q, k, v, bt, cl)
        assert torch.allclose(ref, want, atol=1e-6, rtol=1e-5) and torch.allclose(ref_lse, want_lse, atol=1e-6)
        assert (ref[0] == 0).all() and (ref_lse[0] == -math.inf).all()


def test_reference_handles_both_layouts():
    c = _cpu_case()
    k_hnd, v_hnd = c["key_cache"].transpose(1, 2).contiguous(), c["value_cache"].transpose(1, 2).contiguous()
    c["block_tables"] = torch.tensor([[3, 1, 0, 2], [5, 6, 7, 8]], dtype=torch.int32)
    c["context_lens"] = torch.tensor([40, 0], dtype=torch.int32)
    a = paged_attention_ref(c["query"], c["key_cache"], c["value_cache"], c["block_tables"], c["context_lens"])
    b = paged_attention_ref(c["query"], k_hnd, v_hnd, c["block_tables"], c["context_lens"], kv_layout="HND")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert (a[0][1] == 0).all() and (a[1][1] == -math.inf).all()


def test_out_overlapping_an_input_is_rejected_at_launch():
    """Blocks write their heads' output rows while other blocks still read query rows (and the cache):
    out may be query itself (in place), but share no other memory with an input. Checked at launch
    (addresses), so on a GPU; the check itself is exercised here on CPU tensors."""
    from hipkern.ops._common import check_no_overlap

    buf = torch.randn(4, 8, 128)
    q = buf[:2]
    check_no_overlap("out", q, "query", query=q)  # in place: allowed
    check_no_overlap("out", buf[2:], "query", query=q)  # disjoint
    with pytest.raises(ValueError, match=r"out must not overlap query in memory \(only exactly the same"):
        check_no_overlap("out", buf[1:3], "query", query=q)
    with pytest.raises(ValueError, match="out must not overlap key_cache in memory"):
        check_no_overlap("out", buf[:2], "query", query=torch.randn(2, 8, 128), key_cache=buf)
    strided = torch.randn(2, 16, 128)[:, :8]  # query's heads interleaved with other memory
    with pytest.raises(ValueError, match="out must not overlap query"):
        check_no_overlap("out", strided.as_strided((2, 8, 128), (1024, 128, 1), 1024), "query", query=strided)
    check_no_overlap("out", torch.empty(0, 8, 128), "query", query=q)  # nothing written
    one = torch.randn(1, 8, 128)  # one sequence: its stride is any (here 4096 against out's 1024), same memory
    check_no_overlap("out", one.as_strided((1, 8, 128), (1024, 128, 1)), "query",
                     query=one.as_strided((1, 8, 128), (4096, 128, 1)))
    with pytest.raises(ValueError, match="only exactly the same"):  # same start, another layout
        check_no_overlap("out", buf[:2].as_strided((2, 4, 128), (512, 128, 1)), "query",
                         query=buf[:2].as_strided((2, 4, 128), (1024, 128, 1)))


@pytest.mark.gpu
def test_out_overlapping_query_is_rejected_and_out_is_query_works():
    torch.manual_seed(5)
    s, hq, hkv, d, bs = 3, 8, 2, 128, 16
    k = torch.randn(8, bs, hkv, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    bt = torch.arange(6, dtype=torch.int32, device="cuda").view(3, 2)
    cl = torch.tensor([5, 32, 17], dtype=torch.int32, device="cuda")
    buf = torch.randn(s + 1, hq, d, dtype=torch.bfloat16, device="cuda")
    q = buf[:s]
    want = paged_attention_ref(q, k, v, bt, cl)[0]
    with pytest.raises(ValueError, match="out must not overlap query"):
        hipkern.paged_attention_decode(q, k, v, bt, cl, out=buf[1:])
    with pytest.raises(ValueError, match="out must not overlap key_cache"):
        hipkern.paged_attention_decode(q, k, v, bt, cl, out=k.view(-1)[: q.numel()].view(q.shape))
    res = hipkern.paged_attention_decode(q, k, v, bt, cl, out=q)  # in place
    assert res is q
    assert check_out(res, want) == 0


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_reference_against_sdpa_on_gathered_kv(layout):
    """paged_attention_ref (the tests' and the benchmark's reference) against torch's own attention on
    each sequence's gathered K/V, KV heads repeated over their query group (a GQA mapping or a scale
    convention shared by the kernels and the reference would show here), on the CPU (float64 inputs; the
    reference's scores and softmax are float32)."""
    torch.manual_seed(3)
    s, hkv, group, d, bs, nb = 3, 2, 4, 64, 16, 12
    lens = [37, 1, 64]
    q = torch.randn(s, hkv * group, d, dtype=torch.float64)
    k = torch.randn(nb, bs, hkv, d, dtype=torch.float64)
    v = torch.randn(nb, bs, hkv, d, dtype=torch.float64)
    bt = torch.randperm(nb)[: s * 4].view(s, 4).to(torch.int32)
    cl = torch.tensor(lens, dtype=torch.int32)
    kc, vc = (k, v) if layout == "NHD" else (k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous())
    out, lse = paged_attention_ref(q, kc, vc, bt, cl, scale=0.3, kv_layout=layout, compute_dtype=torch.float64)
    for i, n in enumerate(lens):
        kk = k[bt[i].long()].reshape(-1, hkv, d)[:n].transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, n, d]
        vv = v[bt[i].long()].reshape(-1, hkv, d)[:n].transpose(0, 1).repeat_interleave(group, dim=0)
        want = torch.nn.functional.scaled_dot_product_attention(q[i][:, None], kk, vv, scale=0.3)[:, 0]
        torch.testing.assert_close(out[i], want, rtol=1e-4, atol=1e-5)  # the reference's softmax is float32
        scores = (q[i][:, None] * kk).sum(-1) * 0.3  # [Hq, n]
        torch.testing.assert_close(lse[i].double(), scores.exp().sum(-1).log(), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_direct_op_calls_are_validated_before_any_launch():
    """torch.ops.hipkern.paged_attention_decode called directly gets the Python function's checks (a block
    table with fewer rows than sequences had been read past its end), and its lse's shape is checked."""
    q, k, v, bt, cl = make_case([40, 70])
    scale = q.shape[-1] ** -0.5
    out = poison(torch.empty_like(q))
    no_lse = torch.empty((0,), dtype=torch.float32, device="cuda")
    with pytest.raises(ValueError, match="block_tables must be"):
        torch.ops.hipkern.paged_attention_decode(q, k, v, bt[:1], cl, scale, "NHD", "", out, no_lse)
    with pytest.raises(ValueError, match=r"lse must have shape \(2, 8\)"):
        torch.ops.hipkern.paged_attention_decode(q, k, v, bt, cl, scale, "NHD", "",
                                                 out, torch.empty((1, 8), dtype=torch.float32, device="cuda"))
    with pytest.raises(ValueError, match="variant must be None or one of"):
        torch.ops.hipkern.paged_attention_decode(q, k, v, bt, cl, scale, "NHD", "v99", out, no_lse)
    torch.cuda.synchronize()
    assert bool(out.isnan().all())
    torch.ops.hipkern.paged_attention_decode(q, k, v, bt, cl, scale, "NHD", "v4", out, no_lse)  # an alias runs
    ref, _ = paged_attention_ref(q, k, v, bt, cl, scale=scale, kv_layout="NHD")
    assert check_out(out, ref, msg="direct call ") == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dim", ["block", "head", "token"])
def test_any_stride_of_a_one_element_dimension(dim):
    """torch allows any stride on a dimension of one element (here 2^40 elements, which the tensor maps
    refuse): it is read as 0, so every variant runs such a cache (the tensor-map ones had raised)."""
    nb, bs, hkv = {"block": (1, 16, 2), "head": (4, 16, 1), "token": (40, 1, 2)}[dim]
    d, group = 128, 4
    base = torch.randn(2, nb * bs * hkv * d, device="cuda").to(torch.bfloat16)
    strides = [bs * hkv * d, hkv * d, d, 1]
    strides[{"block": 0, "token": 1, "head": 2}[dim]] = 2**40
    k = torch.as_strided(base[0], (nb, bs, hkv, d), strides)
    v = torch.as_strided(base[1], (nb, bs, hkv, d), strides)
    n = min(nb * bs, 37)
    bt = torch.arange(nb, dtype=torch.int32, device="cuda").flip(0).view(1, nb).repeat(2, 1).contiguous()
    cl = torch.tensor([n, max(1, n // 2)], dtype=torch.int32, device="cuda")
    q = torch.randn(2, hkv * group, d, device="cuda").to(torch.bfloat16)
    for variant in VARIANT_NAMES:
        run_and_check((q, k, v, bt, cl), variant=variant, msg=f"{variant} {dim} ")


@pytest.mark.gpu
def test_a_one_column_block_table_with_any_column_stride():
    """A [num_seqs, 1] table whose column stride is not 1 (a transposed [1, num_seqs] tensor): torch allows
    any stride on a one-element dimension and the kernels never use it."""
    q, k, v, bt, cl = make_case([16, 5, 1, 0], num_kv_heads=2, group=4, extra_blocks=0)
    assert bt.shape[1] == 1
    bt_t = bt.view(1, -1).clone().t()
    assert bt_t.stride() == (1, 4) and torch.equal(bt_t, bt)
    for variant in VARIANT_NAMES:
        run_and_check((q, k, v, bt_t, cl), variant=variant, msg=f"{variant} ")


@pytest.mark.gpu
def test_a_direct_call_s_lse_must_not_overlap():
    q, k, v, bt, cl = make_case([40, 70])
    out = poison(torch.empty_like(q))
    buf = torch.empty(q.numel() * 2, dtype=torch.float32, device="cuda")
    for lse, name in ((out.view(-1).view(torch.float32)[: 16].view(2, 8), "out"),
                      (q.view(-1).view(torch.float32)[: 16].view(2, 8), "query")):
        with pytest.raises(ValueError, match=f"lse must not overlap {name}"):
            torch.ops.hipkern.paged_attention_decode(q, k, v, bt, cl, 0.1, "NHD", "", out, lse)
    torch.ops.hipkern.paged_attention_decode(q, k, v, bt, cl, 0.1, "NHD", "", out, buf[:16].view(2, 8))
