"""paged_attention_decode where it splits contexts into partitions: the merge kernel, per-sequence splits (v5,
its database rows above its limit), the most sequences a grid takes, group splits over blocks, L2 prefetch
and drop, merges inside thread-block clusters and the block timeline tool, against the float32 reference;
and the variant aliases."""
import math

import pytest
import torch

import hipkern
from hipkern.ops.paged_attention import ALIASES, VARIANTS
from hipkern.reference import paged_attention_ref
from hipkern.testing import checkAllclose, poison, poison_next_alloc
from hipkern.tune.core import Candidate
from hipkern.tune.paged_attention import pinned

from conftest import sm90_build
from pa_cases import LSE_TOL, VARIANT_NAMES, check_out, make_case, run_and_check


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
@pytest.mark.parametrize("variant,partition_size", [("v6", 32), ("v16", 64)])
def test_partitions_past_the_grid_limit_are_enlarged(variant, partition_size):
    """A context of more tiles than the grid's partition dimension holds (MAX_PARTITIONS, 65535: 2.1M tokens
    of v6's 32-token tiles, 4.2M of v16's 64) with partitions of one tile pinned: the plan takes larger
    partitions of whole tiles, within the limit (asserted), and the ~44,000-way split matches the reference.
    The long sequence beside a short and an empty one."""
    from hipkern.ops.paged_attention import KERNELS, MAX_PARTITIONS, make_shape, plan_of
    n = 4_200_000
    var = VARIANTS[variant]
    tile = KERNELS[var.kernel].tile(32)
    assert math.ceil(n / tile) > MAX_PARTITIONS  # one tile a partition would not fit the grid
    case = make_case([n, 5, 0], num_kv_heads=1, group=16, head_size=64, extra_blocks=0, seed=n % 97)
    q, k, v, bt, cl = case
    params = {"partition_size": partition_size}
    shape = make_shape(var, 3, 16, 1, bt.shape[1] * 16, torch.cuda.get_device_properties(0).multi_processor_count,
                       32, params=params)
    plan = plan_of(var, shape, params)
    assert plan.num_partitions <= MAX_PARTITIONS and plan.partition_size > tile
    assert plan.partition_size % tile == 0 and plan.num_partitions * plan.partition_size >= n
    with pinned(Candidate.of(variant, **params)):
        o, lse = run_and_check(case, variant=None, msg=f"{plan.num_partitions} partitions of {plan.partition_size} ")
    assert (o[2] == 0).all() and (lse[2] == -math.inf).all()


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
@pytest.mark.parametrize("variant", ["v16", "v3", "v9", "v6"])
@pytest.mark.parametrize("group,head_size", [(8, 128), (64, 256), (4, 64), (12, 128)])
def test_lengths_at_the_default_plan_s_partition_boundaries(variant, group, head_size):
    """Each variant's own (default) plan for the shape, not a pinned size: lengths one below, at and one above its
    partition size and twice it, beside the longest the table addresses, which fixes the plan (it depends on the
    shapes only: the same for every length list of this batch and table)."""
    from hipkern.ops import paged_attention as pa
    from hipkern.ops._common import module_for

    width, n = 4096, 8  # 16-token blocks; 8 sequences of 2 KV heads: few blocks, so every variant splits
    q = torch.empty(n, 2 * group, head_size, dtype=torch.bfloat16, device="cuda")
    dev = q.get_device()
    if not pa.runs_here(variant, head_size):
        pytest.skip(f"{variant} refuses head size {head_size} on this GPU")
    mod = module_for("paged_attention", dev, dtype="bfloat16", head_size=head_size)
    plan = pa._launch_plan(dev, mod, q, head_size, 16, 2, "NHD", width // 16, variant)[2]
    size = plan.partition_size
    assert plan.num_partitions > 1 and not plan.per_sequence and size < width
    lens = [width, size - 1, size, size + 1, 2 * size - 1, 2 * size, min(width, 2 * size + 1), 1]
    case = make_case(lens, num_kv_heads=2, group=group, head_size=head_size, extra_blocks=0, seed=group + head_size)
    assert case[3].shape[1] * 16 == width
    assert pa._launch_plan(dev, mod, case[0], head_size, 16, 2, "NHD", width // 16, variant)[2] == plan
    run_and_check(case, variant=variant, msg=f"partitions of {size} ")
