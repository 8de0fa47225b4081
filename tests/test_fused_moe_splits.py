"""fused_moe's grouped chain where its plans split K (partials summed in memory or in cluster pairs), its
down tiles, its tensor-map weight copies and its GEMMs routing in their own blocks, each against the
float64 reference and bitwise repeatable."""
import ctypes
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import hipkern
from hipkern.ops.fused_moe import DECODE_MAX_BLOCK_M, block_ms_for
from hipkern.testing import checkAllclose

from conftest import sm90_build
from moe_cases import (
    BLOCK_MS, DTYPES, ODD, SMALL, TOL, again, force_moe_sorting, graph_replay_with_new_routing, half_remote,
    make_case, make_tokens, make_weights, reference, route_pairs_here, routing_weights, run_and_check)


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["routed", "sorted"])
@pytest.mark.parametrize("block_m", [8, 32, 64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_k_over_few_large_items(dtype, block_m, routing, monkeypatch):
    """Every token on the same 2 experts with a long reduction: too few items for the grid, so the
    GEMMs split K over blocks (many parts) and the last part to arrive sums the parts. Repeated calls
    with new routing check that the arrival counters are left at zero; repeats of one call, that the
    split sum is deterministic. Both ways the GEMMs get their m-blocks (routing in their blocks, or
    after moe_sorting: forced)."""
    kw = {"block_m": block_m}
    if routing == "sorted":
        force_moe_sorting(monkeypatch)
        kw["variant"] = "grouped"  # the chain that sorts
    t, d, i, e, k = 40, 4096, 256, 16, 2
    x, w1, w2, w, _ = make_case(t, d, i, e, k, dtype, seed=7)
    for rep in range(3):
        ids = torch.tensor([[rep, rep + 5]], dtype=torch.int32, device="cuda").repeat(t, 1)
        res = run_and_check(x, w1, w2, w, ids, msg=f"split rep {rep} ", **kw)
        assert torch.equal(res, again(x, w1, w2, w, ids, **kw))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["grouped", "decode", "grouped-sorted"])
@pytest.mark.parametrize("block_m", BLOCK_MS)
@pytest.mark.parametrize("d,i", [(128, 2176), (8704, 16)], ids=["down", "gated"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_k_with_a_short_last_part(dtype, d, i, block_m, variant, monkeypatch):
    """A long reduction over few items, so the plan splits K 16 ways into parts whose last one is
    short: the down GEMM's 17 k-stages of 128 (I = 2176, D = 128: 2 n-tiles per m-block) become 9
    parts of 2 (34 stages of 64 at block_m 128: 12 parts of 3); the gated GEMM's reduction over D =
    8704 (17 stages of 512, 34 of 256, 68 of 128, 136 of 64 by tile) likewise, with I = 16. A stage past
    the end loads nothing, but its item's epilogue runs on its pipeline slot and reads the slot's pair
    of each token row, which must be this item's (a slot left from another item, or never written,
    sends the sums to the wrong rows or out of bounds). At block_m 64 / 128 (sm_90a) the products of
    a part's last computing stage are still running when the stages past the end begin. grouped-sorted:
    the grouped chain's GEMMs on moe_sorting's m-blocks (forced), not routing in their blocks."""
    if block_m not in block_ms_for(dtype) or variant == "decode" and block_m > DECODE_MAX_BLOCK_M:
        pytest.skip(f"block_m {block_m} is not offered for {dtype} / the {variant} variant")
    if variant == "grouped-sorted":
        force_moe_sorting(monkeypatch)
        variant = "grouped"
    t, e, k = 3, 4, 2
    x, w1, w2, w, ids = make_case(t, d, i, e, k, dtype, seed=17)
    for rep in range(2):
        res = run_and_check(x, w1, w2, w, ids, block_m=block_m, variant=variant, msg=f"short last part {rep} ")
        assert torch.equal(res, again(x, w1, w2, w, ids, block_m=block_m, variant=variant))
        ids = ids.roll(1, dims=1).contiguous()


def gemm_layouts(dtype, block_m, routed):
    """The grouped variant's (gated, down, short down) GEMMs on this GPU, launched routing in their blocks
    (routed) or after moe_sorting: (grid, output columns per item, whether a K split of 2 sums in cluster
    pairs) each (hk_fused_moe_gemms)."""
    from hipkern.ops._common import module_for
    dev = torch.cuda.current_device()
    mod = module_for("fused_moe", dev, dtype=str(dtype)[6:], block_m=block_m)
    out = (ctypes.c_int32 * 9)()
    mod.check(mod.hk_fused_moe_gemms(dev, int(routed), ctypes.addressof(out)), "fused_moe gemms")
    return [tuple(out[3 * j:3 * j + 3]) for j in range(3)]


def plan_split(base, grid):
    """gemm.h plan()'s K split for `base` items on `grid` blocks (K long enough for any split)."""
    best, best_rounds = 1, -(-base // grid)
    for s in range(2, 17):
        rounds = -(-base * s // grid)
        if rounds * best < best_rounds * s:
            best, best_rounds = s, rounds
    return best


@pytest.mark.gpu
@pytest.mark.parametrize("routed", [True, False], ids=["routed", "sorted"])
@pytest.mark.parametrize("block_m", BLOCK_MS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_k_in_two_parts(dtype, block_m, routed, monkeypatch):
    """Plans aimed at a K split of exactly 2, first of the gated GEMM, then of the down GEMM (2 m-blocks
    of n-tiles a quarter of the grid each), where sm_90a builds launch the grid in clusters of 2 and
    each part writes half the outputs (columns; every other token row where they are float32's split
    rows at block_m 64) from both parts' partial tiles in distributed shared memory:
    full and partial m-blocks (every token on the same 2 experts), a partial last n-tile, against the
    reference and bitwise repeatable. On sm_90 a GEMM of 2 or more blocks an SM must use the pairs. Both
    ways the GEMMs get their m-blocks: routing in their blocks (these calls' <= 256 pairs, where the
    module routes) and after moe_sorting (forced)."""
    if block_m not in block_ms_for(dtype):
        pytest.skip(f"block_m {block_m} is not offered for {dtype}")
    if routed and route_pairs_here(dtype, block_m) < 2 * block_m:
        pytest.skip(f"the {dtype} block_m {block_m} GEMMs do not route in their blocks here")
    if not routed:
        force_moe_sorting(monkeypatch)
    _split_in_two(dtype, block_m, routed, pairs_expected=sm90_build())


def _split_in_two(dtype, block_m, routed, pairs_expected):
    """test_split_k_in_two_parts' calls (also run in a process of its own with HIPKERN_NO_CLUSTERS, below)."""
    tokens = (block_m, max(1, block_m // 2 - 1))
    (g1, c1, p1), (g2, c2, p2), _ = gemm_layouts(dtype, block_m, routed)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if pairs_expected:
        assert p1 or g1 < 2 * sms, f"gated GEMM: {g1} blocks, no cluster pairs"
        assert p2 or g2 < 2 * sms, f"down GEMM: {g2} blocks, no cluster pairs"
    n1, n2 = g1 // 4, g2 // 4  # n-tiles a (full) m-block
    i_gated = n1 * c1 - (8 if c1 > 8 else 0)  # the last n-tile partial where the tile allows
    d_down = n2 * c2 - 8
    assert plan_split(2 * n1, g1) == 2 and plan_split(2 * n2, g2) == 2
    for d, i in ((1000, i_gated), (d_down, 520)):
        w1, w2 = make_weights(4, d, i, dtype, seed=d)
        for t in tokens:
            x, w = make_tokens(t, d, dtype, t), routing_weights(t, 2, t)
            ids = torch.tensor([[1, 3]], dtype=torch.int32, device="cuda").repeat(t, 1)
            res = run_and_check(x, w1, w2, w, ids, block_m=block_m, variant="grouped", msg=f"split 2, pairs {p1}/{p2} ")
            assert torch.equal(res, again(x, w1, w2, w, ids, block_m=block_m, variant="grouped"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,block_m", [(torch.bfloat16, 32), (torch.bfloat16, 128), (torch.float32, 64)])
def test_split_in_two_without_clusters(dtype, block_m):
    """HIPKERN_NO_CLUSTERS (read once a process: a process of its own): the same K splits of 2 sum their parts
    through the partials in memory instead of cluster pairs, against the reference."""
    code = ("import sys, torch; sys.path.insert(0, %r); import test_fused_moe_splits as t; "
            "t._split_in_two(torch.%s, %d, True, pairs_expected=False); print('ok')"
            % (str(pathlib.Path(__file__).parent), str(dtype)[6:], block_m))
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, HIPKERN_NO_CLUSTERS="1"),
                          capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("d,i", [(128, 248), (200, 256), (200, 264)], ids=["short-split", "short", "long"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_down_tiles_either_side_of_the_short_reduction(dtype, d, i, block_m):
    """Where inter_dim <= 256 the grouped variant's down GEMM runs its short-reduction tile (fused_moe.hip,
    kShortK: 128 rows, k-stages of 64), above it the other one: both sides of the threshold, a partial
    n-tile (D = 200), a last k-stage partly past the reduction (I = 248), and few items (D = 128: one
    n-tile of the short tile), so that K splits. Uniform and skewed routing (every token on the same two
    experts: full m-blocks of token rows)."""
    e, k = 8, 2
    for t, seed in ((3, 0), (37, 1)):
        x, w1, w2, w, ids = make_case(t, d, i, e, k, dtype, seed=seed)
        run_and_check(x, w1, w2, w, ids, block_m=block_m, variant="grouped", msg="uniform ")
        same = torch.tensor([[6, 1]], dtype=torch.int32, device="cuda").repeat(t, 1)
        run_and_check(x, w1, w2, w, same, block_m=block_m, variant="grouped", msg="skewed ")


TMA_CASES = [  # (t, d, i, e, k, block_m, skewed, half remote): tiles whose down weights are tensor-map boxes
    (37, 200, 72, 8, 2, 16, False, True), (37, 200, 256, 8, 2, 32, True, False), (129, 200, 72, 16, 2, 128, False, True),
    (5, 128, 248, 8, 2, 16, True, False), (40, 328, 200, 8, 2, 128, True, False),
]


def _tma_case(n):
    """TMA_CASES[n]'s inputs (seeded by n): x, w1, w2, weights, ids, expert_map, block_m."""
    t, d, i, e, k, bm, skewed, remote = TMA_CASES[n]
    x, w1, w2, w, ids = make_case(t, d, i, e, k, torch.bfloat16, seed=n)
    emap = None
    if skewed:
        ids = torch.arange(k, dtype=torch.int32, device="cuda").repeat(t, 1)
    if remote:
        emap, w1, w2, _ = half_remote(e, w1, w2, seed=n)
    return x, w1, w2, w, ids, emap, bm


def _tma_case_outputs():
    outs = []
    for n in range(len(TMA_CASES)):
        x, w1, w2, w, ids, emap, bm = _tma_case(n)
        outs.append(hipkern.fused_moe(x, w1, w2, w, ids, expert_map=emap, block_m=bm, variant="grouped").cpu())
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("i", [136, 192])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_short_down_tiles_whose_last_k_part_is_short(dtype, i, block_m):
    """The short down tile (three 64-wide stages of I at most 256) split over K where I is not a multiple of
    the split (136, 192: 3 stages in 2 parts), its weights by tensor map: the stages past I's end are neither
    loaded nor waited for. 7 tokens on 7 experts, one pair each."""
    x, w1, w2, w, _ = make_case(7, 2048, i, 8, 1, dtype, seed=i)
    ids = torch.arange(7, dtype=torch.int32, device="cuda")[:, None]
    run_and_check(x, w1, w2, w, ids, block_m=block_m, variant="grouped")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [32, 64])
@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_long_down_tiles_over_many_items(dtype, block_m, t):
    """I past the short tile (1536) with enough items that the down GEMM runs them whole (the database's
    plan for the Mixtral-like shapes at 32 tokens, at a smaller D), and the gated GEMM's weights asked of L2."""
    x, w1, w2, w, ids = make_case(t, 4096, 1536, 8, 2, dtype, seed=t)
    run_and_check(x, w1, w2, w, ids, block_m=block_m, variant="grouped")


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [16, 32, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_graph_replay_of_the_chain_routed_in_its_blocks(dtype, block_m):
    """Up to 256 pairs the grouped GEMMs route in their blocks (no moe_sorting): captured in a CUDA graph and
    replayed with new routing (128 pairs; graph_replay_with_new_routing)."""
    graph_replay_with_new_routing(dtype, 16, 64, 8, seed=block_m, block_m=block_m, variant="grouped")


@pytest.mark.gpu
@pytest.mark.parametrize("block_m,dtype", [(128, torch.bfloat16), (64, torch.float32)])
def test_many_m_blocks_of_one_expert_routed_in_the_blocks(block_m, dtype):
    """200 pairs all on one expert at the largest block_m (two m-blocks of it in the blocks' own table)."""
    t = 200
    x, w1, w2, w, _ = make_case(t, **SMALL, e=16, k=1, dtype=dtype, seed=block_m)
    ids = torch.full((t, 1), 11, dtype=torch.int32, device="cuda")
    run_and_check(x, w1, w2, w, ids, block_m=block_m, variant="grouped")


@pytest.mark.gpu
def test_weights_by_tensor_map_match_the_thread_copies(tmp_path):
    """On sm_90 the 64-column weight stages (the down GEMM's short-reduction tile at block_m 16 / 32, both
    GEMMs at block_m 128: the gated one's 8 gate and 8 up rows per 16-row tile through a rank-5 map) are
    tensor-map boxes copied by one thread (gemm.h, hipkern/tma.h), zeros outside w1 / w2 standing for the
    threads' zero-filled copies: rows past I or D, columns past D or I, remote experts. Bitwise the same
    outputs as the threads' copies (HIPKERN_NO_TMA=1, a process of its own), and right against the reference."""
    code = ("import sys, torch; sys.path.insert(0, %r); import test_fused_moe_splits as t; "
            "torch.save(t._tma_case_outputs(), %r)" % (str(pathlib.Path(__file__).parent), str(tmp_path / "copies.pt")))
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, HIPKERN_NO_TMA="1"), capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    copies = torch.load(tmp_path / "copies.pt")
    for n, (box, copy) in enumerate(zip(_tma_case_outputs(), copies)):
        assert torch.equal(box, copy), f"tensor-map and thread copies differ for {TMA_CASES[n]}"
        x, w1, w2, w, ids, emap, bm = _tma_case(n)
        run_and_check(x, w1, w2, w, ids, expert_map=emap, block_m=bm, variant="grouped", msg=f"tma case {n} ")


ROUTE_CASES = [  # (t, k, e, routing): the grouped chain on either side of its in-block routing limit
    (1, 1, 8, "uniform"),         # one pair
    (32, 8, 256, "uniform"),      # 256 pairs: the most routed in the blocks
    (32, 8, 256, "same"),         # every token on the same 8 experts: full m-blocks
    (33, 1, 8, "same"),           # 33 pairs on one expert: an m-block boundary at block_m 8, 16 and 32
    (255, 1, 1024, "uniform"),    # the most experts moe_sorting takes, few pairs each
    (36, 7, 257, "remote"),       # 252 pairs, half the experts remote, a token all remote
    (37, 7, 257, "remote"),       # 259 pairs: moe_sorting
    (257, 1, 8, "uniform"),       # 257 pairs: moe_sorting
]


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", BLOCK_MS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_routing_in_blocks_matches_moe_sorting(dtype, block_m, monkeypatch):
    """Up to hk_fused_moe_route_pairs() routed pairs the grouped chain's GEMMs group the pairs by expert
    in their own blocks (route.h), above it they read moe_sorting's outputs. Either way the m-blocks are
    the same, so each output must be bitwise what the chain gives through moe_sorting (forced here), as
    well as right against the reference: both sides of the limit, one pair, full and partial m-blocks,
    1024 experts, remote experts, and dropped ids (outside [0, E): against the reference too)."""
    if block_m not in block_ms_for(dtype):
        pytest.skip(f"block_m {block_m} is not offered for {dtype}")
    limit = route_pairs_here(dtype, block_m)
    assert limit in (0, 256)
    for t, k, e, routing in ROUTE_CASES:
        x, w1, w2, w, ids = make_case(t, **ODD, e=e, k=k, dtype=dtype, seed=t * k + e)
        emap = None
        if routing == "same":
            ids = (torch.arange(k, dtype=torch.int32, device="cuda") * 3 % e).repeat(t, 1)
        elif routing == "remote":
            emap, w1, w2, remote = half_remote(e, w1, w2, seed=t)
            ids[0] = remote[:k].to(torch.int32)
        res = run_and_check(x, w1, w2, w, ids, expert_map=emap, block_m=block_m, variant="grouped",
                            msg=f"{routing} (limit {limit}) ")
        dropped = ids.clone()
        dropped[-1, 0], dropped[0, -1] = -1, e  # outside [0, E): dropped, never read through
        with_dropped = again(x, w1, w2, w, dropped, expert_map=emap, block_m=block_m, variant="grouped")
        assert checkAllclose(with_dropped, reference(x, w1, w2, w, dropped, expert_map=emap),
                             msg="dropped ids ", **TOL[dtype]) == 0
        with monkeypatch.context() as m:
            force_moe_sorting(m)
            assert torch.equal(res, again(x, w1, w2, w, ids, expert_map=emap, block_m=block_m,
                                          variant="grouped")), f"{t} x {k} over {e}, {routing}"
            assert torch.equal(with_dropped, again(x, w1, w2, w, dropped, expert_map=emap, block_m=block_m,
                                                   variant="grouped"))
