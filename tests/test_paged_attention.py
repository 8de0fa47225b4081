"""paged_attention_decode against a float32 per-sequence torch reference, every variant: dtypes, heads, block
sizes, GQA ratios, layouts, edge and mixed lengths, strided inputs, v5 split into a few partitions, long
contexts, caches past 2^31 elements, invalid metadata, pinned partitions on two streams, graphs, determinism
and torch.compile. The other splits, merges and their plans: test_paged_attention_splits.py; argument
checks and the reference: test_paged_attention_args.py."""
import contextlib
import math

import pytest
import torch

import hipkern
from hipkern.reference import paged_attention_ref
from hipkern.testing import checkAllclose, poison, poison_next_alloc
from hipkern.tune.core import Candidate
from hipkern.tune.paged_attention import pinned

from pa_cases import (
    LSE_TOL, VARIANT_NAMES, check_out, edge_lengths, make_case, refused_here, run_and_check, strided_like,
    variants_here)


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
    case = nan_past_each_end(OTHER_BLOCK_LENS, group, head_size, block_size, layout)
    run_and_check(case, layout, variant, msg=f"{variant} bs={block_size} ")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("block_size,head_size", [(1, 128), (8, 256), (32, 64), (64, 128), (128, 256)])
def test_32_head_blocks_at_other_block_sizes_with_nan_past_each_end(layout, block_size, head_size):
    """v16's 32-head blocks (a database choice for some group-64 shapes; the default takes 16 or 64) at block
    sizes beside 16, as above: a group of 64 (two blocks a group) and of 40 (the second block partly
    filled), unsplit and in partitions of 64 tokens."""
    for group in (64, 40):
        case = nan_past_each_end(OTHER_BLOCK_LENS, group, head_size, block_size, layout)
        for extra in ({}, {"partition_size": 64}):
            with pinned(Candidate.of("v16", heads_per_block=32, **extra)):
                run_and_check(case, layout, variant=None, msg=f"group {group} bs={block_size} {extra} ")


OTHER_BLOCK_LENS = [1, 5, 9, 17, 63, 64, 65, 300, 1000, 1025]


def nan_past_each_end(lens, group, head_size, block_size, layout):
    """make_case's inputs with every cache row past each sequence's end (in that sequence's blocks) NaN."""
    q, k, v, bt, cl = make_case(lens, num_kv_heads=2, group=group, head_size=head_size, block_size=block_size,
                                layout=layout, seed=block_size + head_size + group)
    kk, vv = (k, v) if layout == "NHD" else (k.transpose(1, 2), v.transpose(1, 2))  # [block, token, head, D] views
    pos = torch.arange(bt.shape[1] * block_size, device="cuda")
    for s, n in enumerate(lens):
        past = pos[n:]
        blocks, rows = bt[s, past // block_size].long(), past % block_size
        kk[blocks, rows] = float("nan")
        vv[blocks, rows] = float("nan")
    return q, k, v, bt, cl


@pytest.mark.gpu
@pytest.mark.parametrize("layout,bs", [("NHD", 16), ("HND", 32)])
@pytest.mark.parametrize("hkv,group", [(8, 4), (1, 64)], ids=["8kv", "64to1"])
def test_cache_over_65536_blocks_and_2_pow_31_elements_read_at_far_end(layout, bs, hkv, group):
    """A cache past 2^31 elements at block 16 (past 2^32 at block 32: unsigned 32-bit offsets wrap too), over
    65536 blocks, read at its far end: 8 KV heads (70000 blocks) and one KV head of a 64-head group (524428
    blocks), whose blocks are v16's 16-, 32- and 64-head kinds (each pinned, unsplit and split). Every block
    but the 140 read is NaN."""
    d = 256
    nb = 70000 if hkv == 8 else 2**32 // (32 * hkv * d) + 140  # 2^19 + 140: past 2^31 / 2^32 at 16 / 32 tokens
    shape = (nb, bs, hkv, d) if layout == "NHD" else (nb, hkv, bs, d)
    k = torch.full(shape, math.nan, dtype=torch.bfloat16, device="cuda")
    v = torch.full_like(k, math.nan)
    far = torch.arange(nb - 140, nb, device="cuda", dtype=torch.int32)
    k[far.long()] = torch.randn((140, *shape[1:]), device="cuda").to(torch.bfloat16)
    v[far.long()] = torch.randn((140, *shape[1:]), device="cuda").to(torch.bfloat16)
    bt = far.flip(0).view(2, 70).contiguous()
    q = torch.randn(2, hkv * group, d, device="cuda").to(torch.bfloat16)
    cl = torch.tensor([70 * bs, 7 * bs + 5], dtype=torch.int32, device="cuda")
    assert k.numel() > (2**32 if bs == 32 else 2**31)
    case = (q, k, v, bt, cl)
    try:
        for variant in variants_here(d):
            run_and_check(case, layout, variant=variant)
        if not refused_here("v16", d):
            with pinned(Candidate.of("v16", partition_size=65536)):  # one partition: tiles prefetched
                run_and_check(case, layout, variant=None)
            for heads in ((16, 32, 64) if group == 64 else ()):
                for extra in ({}, {"partition_size": 128}):
                    with pinned(Candidate.of("v16", heads_per_block=heads, **extra)):
                        run_and_check(case, layout, variant=None, msg=f"{heads}-head blocks {extra} ")
    finally:  # 17-18 GB at block 32: not left to the next tests, pass or fail
        del k, v, case
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
    tile (a database row may hold it), nor 64 of the simt kernel's: the op rounds it up to whole tiles, so the
    boundaries of each rounded size are in the batch too."""
    from hipkern.ops.paged_attention import KERNELS
    wave = 64 if torch.version.hip else 32
    sizes = {partition_size} | {-(-partition_size // k.tile(wave)) * k.tile(wave) for k in KERNELS.values()}
    lens = [0, 1, *sorted(n + d for n in sizes for d in (-1, 0, 1)), 3 * partition_size + 7, 4096]
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
def test_torch_compile_with_dynamic_shapes():
    """A full graph with symbolic sizes (dynamic=True, as serving engines compile a batch dimension): the sequences,
    the table's width and the pool's blocks change between calls without a recompile's help, and LSE too."""
    def f(q, k, v, bt, cl):
        o, lse = hipkern.paged_attention_decode(q, k, v, bt, cl, return_lse=True)
        return o * 2, lse

    g = torch.compile(f, fullgraph=True, dynamic=True)
    for lens in ([100, 900], [1, 17, 300, 2049, 64], [5000]):
        case = make_case(lens, num_kv_heads=2, group=4, seed=len(lens))
        q = case[0]
        g(*case)  # (compiled at the first size); then the op's outputs from poisoned blocks
        poison_next_alloc(q.device, (q.shape, q.dtype), (q.shape[:2], torch.float32))
        out, lse = g(*case)
        ref, ref_lse = paged_attention_ref(*case)
        assert check_out(out / 2, ref, msg=f"{lens} ") == 0
        assert checkAllclose(lse, ref_lse, msg=f"{lens} lse ", **LSE_TOL) == 0


@pytest.mark.gpu
def test_torch_compile_reduce_overhead():
    """mode="reduce-overhead": inductor records the call in a CUDA graph (its tree of graphs) and replays it with new
    inputs copied into its own buffers."""
    def f(q, k, v, bt, cl):
        return hipkern.paged_attention_decode(q, k, v, bt, cl) + 0

    g = torch.compile(f, mode="reduce-overhead", fullgraph=True)
    q, k, v, bt, cl = make_case([300, 1000, 5], num_kv_heads=2, group=8, extra_blocks=70)
    for step in range(4):  # warm-up, record, then replays
        gen = torch.Generator(device="cuda").manual_seed(step)
        q = torch.randn(q.shape, generator=gen, device="cuda").to(q.dtype)
        cl = torch.randint(1, bt.shape[1] * 16, cl.shape, generator=gen, device="cuda", dtype=torch.int32)
        out = g(q, k, v, bt, cl).clone()  # (a replay's output is the graph's buffer: taken before the next)
        assert check_out(out, paged_attention_ref(q, k, v, bt, cl)[0], msg=f"step {step} ") == 0


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_deterministic(variant):
    q, k, v, bt, cl = make_case([3000, 77, 1500], num_kv_heads=4, group=8)
    first, _ = run_and_check((q, k, v, bt, cl), variant=variant)
    for _ in range(5):  # into poisoned outputs, not a freed buffer holding the last repeat's bits
        out = poison(torch.empty_like(q))
        hipkern.paged_attention_decode(q, k, v, bt, cl, variant=variant, out=out)
        assert torch.equal(out, first)


@pytest.mark.gpu
def test_launch_plans_are_memoised_by_what_they_depend_on(monkeypatch):
    """An eager call derives its launch (the database's variant, heads a block, the plan) once per shape: the
    same call again asks no lookup; a database reset, a pinned candidate (the tuner replaces _lookup) or another
    shape asks again, and each call's output matches the reference."""
    from hipkern import tuning_db
    from hipkern.ops import paged_attention as pa

    asked = []
    real = pa._lookup

    def counting(*args):
        asked.append(args[1].shape[0])
        return real(*args)

    monkeypatch.setattr(pa, "_lookup", counting)
    monkeypatch.setattr(pa, "_PLANS", {})
    for lens in ([300, 17, 64], [300, 17, 64], [5, 9], [300, 17, 64]):
        q, k, v, bt, cl = make_case(lens)
        out = hipkern.paged_attention_decode(q, k, v, bt, cl, out=poison(torch.empty_like(q)))
        assert check_out(out, paged_attention_ref(q, k, v, bt, cl)[0]) == 0
    assert asked == [3, 2]
    tuning_db.reset()
    hipkern.paged_attention_decode(q, k, v, bt, cl)
    assert asked == [3, 2, 3]
    with pinned(Candidate.of("v16", partition_size=64)):  # the tuner's pin: its own lookup, its own plans
        out = hipkern.paged_attention_decode(q, k, v, bt, cl, out=poison(torch.empty_like(q)))
        assert check_out(out, paged_attention_ref(q, k, v, bt, cl)[0]) == 0
        plan = [p for key, (_, _, p) in pa._PLANS.items() if key[11] is pa._lookup]
        assert [(p.num_partitions, p.partition_size) for p in plan] == [(math.ceil(bt.shape[1] * 16 / 64), 64)]
    assert asked == [3, 2, 3]


@pytest.mark.gpu
def test_validation_is_memoised_by_what_it_reads(monkeypatch):
    """An eager call validates an argument set once: the same shapes, strides, dtypes, devices and other arguments
    again skip _validate; anything it reads that differs is validated again, so a bad argument is still refused
    after a good call of the same shapes (a strided context_lens, an out of another dtype, a CPU tensor, a bool
    scale equal to 1)."""
    from hipkern.ops import paged_attention as pa

    seen = []
    real = pa._validate

    def counting(*args):
        seen.append(args[5])  # the scale
        return real(*args)

    monkeypatch.setattr(pa, "_validate", counting)
    monkeypatch.setattr(pa, "_VALID", {})
    q, k, v, bt, cl = make_case([300, 17, 64])
    ref = paged_attention_ref(q, k, v, bt, cl, scale=1.0)[0]
    for _ in range(3):
        out = hipkern.paged_attention_decode(q, k, v, bt, cl, scale=1.0, out=poison(torch.empty_like(q)))
        assert check_out(out, ref) == 0
    assert seen == [1.0]
    hipkern.paged_attention_decode(q, k, v, bt, cl, scale=1)  # another type, and no out: validated again
    assert seen == [1.0, 1]
    strided = torch.stack([cl, cl], dim=1)[:, 0]
    bad = [(dict(context_lens=strided), "context_lens"), (dict(out=torch.empty(q.shape, device=q.device)), "out"),
           (dict(context_lens=cl.cpu()), "context_lens"), (dict(scale=True), "scale")]
    for change, name in bad:
        args = dict(query=q, key_cache=k, value_cache=v, block_tables=bt, context_lens=cl, scale=1.0,
                    out=torch.empty_like(q))
        args.update(change)
        with pytest.raises(ValueError, match=f"^{name} must "):
            hipkern.paged_attention_decode(**args)
    assert len(seen) == 2 + len(bad) and len(pa._VALID) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("variant,head_size", [(None, 128), ("v16", 256), ("v3", 256)])
def test_torch_compile(variant, head_size):
    """A full graph, with the database's choice or a variant asked for (whose check that it runs the head size,
    at 256, asks the arch while dynamo traces)."""
    if variant and refused_here(variant, head_size):
        pytest.skip(f"{variant} refuses head size {head_size} on this GPU")
    q, k, v, bt, cl = make_case([100, 900], num_kv_heads=2, group=4, head_size=head_size)

    def f(q, k, v, bt, cl):
        return hipkern.paged_attention_decode(q, k, v, bt, cl, variant=variant) * 2

    g = torch.compile(f, fullgraph=True)
    g(q, k, v, bt, cl)  # compiled; then the op's output (the graph's first allocation) from a poisoned block
    poison_next_alloc(q.device, (q.shape, q.dtype))
    out = g(q, k, v, bt, cl)
    ref, _ = paged_attention_ref(q, k, v, bt, cl)
    assert check_out(out / 2, ref) == 0
