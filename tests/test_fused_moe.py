"""fused_moe against a float64 per-expert torch loop (fused_moe_ref), over expert counts, top-k, token
counts, sizes that are not multiples of the tiles, every block_m, both activations, skewed and
expert-parallel routing; graphs, determinism and torch.compile; argument checks on any device."""
import ctypes
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import hipkern
from hipkern.ops.fused_moe import BLOCK_MS as OP_BLOCK_MS, DECODE_MAX_BLOCK_M, block_ms_for
from hipkern.reference import fused_moe_ref
from hipkern.testing import checkAllclose, poison, poison_free_memory, poison_next_alloc

from conftest import sm90_build

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Outputs are O(1) (x ~ N(0,1), w1 ~ N(0,1)/sqrt(D), w2 ~ N(0,1)/sqrt(I)); the reference is float64 on the
# very same (already rounded) inputs, with act(gate) * up rounded to the input dtype as the kernel does.
TOL = {
    # Mandated by the issue. fp32 accumulation over D then I terms against float64: at D=4096, I=14336 the
    # error is a few 1e-6, so atol 1e-5 is the bound that matters for outputs near zero.
    torch.float32: dict(atol=1e-5, rtol=1e-3),
    # The output is rounded once to bf16 (relative error <= 2^-8 = 3.9e-3); per-slot rounding before the
    # top-k sum (vLLM's layout) or a flipped rounding of the intermediate stays well inside 1e-2.
    torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
    # fp16 rounds at 2^-11 = 4.9e-4: 2e-3 leaves 4x that for the output and the intermediate rounding.
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}
BLOCK_MS = [8, 16, 32, 64, 128]  # the API's 8..64 for every dtype; 128 where the op offers it (16-bit types)
SMALL = dict(d=256, i=128)
ODD = dict(d=200, i=72)  # multiples of 8, not of 16/32/64/128
ARG_NAMES = ("hidden_states", "w1", "w2", "topk_weights", "topk_ids")


def _gen(seed, device="cuda"):
    return torch.Generator(device=device).manual_seed(seed)


def make_weights(e, d, i, dtype, seed=0, device="cuda"):
    """w1 [E, 2I, D] ~ N(0,1)/sqrt(D), w2 [E, D, I] ~ N(0,1)/sqrt(I): gate, up and output are O(1)."""
    g = _gen(seed, device)
    w1 = torch.randn(e, 2 * i, d, generator=g, device=device, dtype=dtype).mul_(d ** -0.5)
    w2 = torch.randn(e, d, i, generator=g, device=device, dtype=dtype).mul_(i ** -0.5)
    return w1, w2


def make_tokens(t, d, dtype, seed=0, device="cuda"):
    return torch.randn(t, d, generator=_gen(seed + 1, device), device=device, dtype=dtype)


def routing_weights(t, k, seed=0, normalise=True, device="cuda"):
    w = torch.rand(t, k, generator=_gen(seed + 2, device), device=device) + 0.1
    return w / w.sum(dim=1, keepdim=True) if normalise else w


def uniform_ids(t, k, e, seed=0, device="cuda"):
    """Distinct experts per token (as a router gives), random over tokens."""
    return torch.rand(t, e, generator=_gen(seed + 3, device), device=device).topk(k, dim=1).indices.to(torch.int32)


def make_case(t, d, i, e, k, dtype, seed=0):
    w1, w2 = make_weights(e, d, i, dtype, seed)
    return make_tokens(t, d, dtype, seed), w1, w2, routing_weights(t, k, seed), uniform_ids(t, k, e, seed)


def half_remote(e_global, w1, w2, seed=0):
    """A random half of the experts local (local indices in a random order), the rest remote (-1).
    Returns (expert_map, the local experts' w1 and w2, the global ids of the remote experts)."""
    perm = torch.randperm(e_global, generator=_gen(seed + 4), device="cuda")
    local = perm[: e_global // 2]
    emap = torch.full((e_global,), -1, dtype=torch.int32, device="cuda")
    emap[local] = torch.arange(local.numel(), dtype=torch.int32, device="cuda")
    return emap, w1[local].contiguous(), w2[local].contiguous(), perm[e_global // 2:]


def reference(x, w1, w2, w, ids, activation="silu", expert_map=None):
    inter = None if x.dtype == torch.float32 else x.dtype
    return fused_moe_ref(x, w1, w2, w, ids, activation, expert_map, torch.float64, inter)


def run_and_check(x, w1, w2, w, ids, activation="silu", expert_map=None, block_m=None, msg="", variant=None):
    """fused_moe into a NaN-poisoned out=, against the reference; the functional call (out=None) must
    give the same bits. Returns the output."""
    out = poison(torch.empty_like(x))
    res = hipkern.fused_moe(x, w1, w2, w, ids, activation=activation, expert_map=expert_map, out=out,
                            block_m=block_m, variant=variant)
    assert res is out
    ref = reference(x, w1, w2, w, ids, activation, expert_map)
    assert torch.isfinite(ref).all(), "the reference is not finite"
    tag = f"{msg}{str(x.dtype)[6:]} T={x.shape[0]} D={x.shape[1]} I={w2.shape[2]} E={w1.shape[0]} " \
          f"k={ids.shape[1]} {activation} block_m={block_m} variant={variant} "
    assert checkAllclose(res, ref, msg=tag, **TOL[x.dtype]) == 0
    poison_next_alloc(x.device, (x.shape, x.dtype))  # not a freed buffer holding a previous call's right bits
    functional = hipkern.fused_moe(x, w1, w2, w, ids, activation=activation, expert_map=expert_map,
                                   block_m=block_m, variant=variant)
    assert functional.shape == x.shape and functional.dtype == x.dtype and functional.device == x.device
    assert torch.equal(functional, res), "out= and the functional call differ"
    return res


def again(x, *args, **kw):
    """fused_moe once more into a NaN-poisoned out= (a repeat that leaves an element unwritten fails the
    bitwise comparison it feeds, instead of finding a previous call's bits in a recycled buffer)."""
    return hipkern.fused_moe(x, *args, out=poison(torch.empty_like(x)), **kw)


# ------------------------------------------------------------------------------------ GPU: results
@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 2, 8, 9])
@pytest.mark.parametrize("e", [8, 64, 256, 257])
@pytest.mark.parametrize("dtype", DTYPES)
def test_expert_counts_and_topk(dtype, e, k):
    if k > e:
        pytest.skip("distinct experts per token need k <= E (duplicates: test_duplicate_ids_in_a_row_are_summed)")
    run_and_check(*make_case(129, **SMALL, e=e, k=k, dtype=dtype, seed=e * 10 + k))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 3, 32, 129, 2048])
@pytest.mark.parametrize("d,i,e,k", [(256, 128, 256, 8), (200, 72, 64, 2), (200, 72, 257, 9)],
                         ids=["256x128-E256-top8", "200x72-E64-top2", "200x72-E257-top9"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_token_counts(dtype, d, i, e, k, t):
    run_and_check(*make_case(t, d, i, e, k, dtype, seed=t))


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", BLOCK_MS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_block_m(dtype, block_m):
    e = 64
    w1, w2 = make_weights(e, **ODD, dtype=dtype, seed=block_m)
    if block_m > 64 and (dtype == torch.float32 or block_m not in OP_BLOCK_MS):
        x, w, ids = make_tokens(3, ODD["d"], dtype), routing_weights(3, 2), uniform_ids(3, 2, e)
        with pytest.raises(ValueError, match="block_m"):
            hipkern.fused_moe(x, w1, w2, w, ids, block_m=block_m)
        return
    for t, k in ((1, 8), (33, 8), (2048, 8)):
        x, w, ids = make_tokens(t, ODD["d"], dtype, t), routing_weights(t, k, t), uniform_ids(t, k, e, t)
        run_and_check(x, w1, w2, w, ids, block_m=block_m)
    t = 300  # one expert's run spans many blocks, with a partial last one
    x = make_tokens(t, ODD["d"], dtype)
    run_and_check(x, w1, w2, routing_weights(t, 1, normalise=False),
                  torch.full((t, 1), 5, dtype=torch.int32, device="cuda"), block_m=block_m)
    emap, w1l, w2l, _ = half_remote(e, w1, w2, seed=block_m)
    run_and_check(x, w1l, w2l, routing_weights(t, 8), uniform_ids(t, 8, e), expert_map=emap, block_m=block_m)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [SMALL, ODD], ids=["256x128", "200x72"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu(dtype, shape):
    for t, e, k in ((1, 64, 8), (129, 257, 9), (2048, 8, 2)):
        run_and_check(*make_case(t, **shape, e=e, k=k, dtype=dtype, seed=t), activation="gelu")


def gemv_variants(dtype) -> tuple:
    """The gemv variants a dtype runs (gemv_mma: matrix cores, 16-bit types)."""
    return ("gemv",) if dtype == torch.float32 else ("gemv", "gemv_mma")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_mma_groups_pairs_by_local_expert(dtype):
    """gemv_mma computes the pairs of one local expert in one block: two global ids that expert_map
    sends to the same local expert form one group (7 pairs, two of them of one token: a partial second
    pass on NVIDIA, four passes on CDNA), beside groups of 1 and 2 pairs and remote pairs, under silu
    and gelu."""
    e_local, d, i = 4, 200, 72
    w1, w2 = make_weights(e_local, d, i, dtype, seed=7)
    emap = torch.tensor([-1, 2, -1, 0, 2, 1, 3, -1], dtype=torch.int32, device="cuda")  # 1 and 4 -> local 2
    ids = torch.tensor([[1, 4, 3], [4, 0, 1], [1, 5, 6], [4, 5, 3], [7, 4, 2]], dtype=torch.int32, device="cuda")
    x, w = make_tokens(5, d, dtype, 5), routing_weights(5, 3, 5)
    for activation in ("silu", "gelu"):
        res = run_and_check(x, w1, w2, w, ids, activation=activation, expert_map=emap, variant="gemv_mma")
        gemv = hipkern.fused_moe(x, w1, w2, w, ids, activation=activation, expert_map=emap, variant="gemv")
        assert checkAllclose(res, gemv, msg=f"gemv_mma vs gemv, {activation} ", **TOL[dtype]) == 0


LARGE = [pytest.param(7168, 256, 256, 8, id="7168x256-E256-top8"),
         pytest.param(4096, 14336, 8, 2, id="4096x14336-E8-top2"),
         pytest.param(2880, 2880, 32, 4, id="2880x2880-E32-top4")]


@pytest.mark.gpu
@pytest.mark.parametrize("d,i,e,k", LARGE)
@pytest.mark.parametrize("dtype", DTYPES)
def test_large_shapes(dtype, d, i, e, k):
    """The issue's sizes (not multiples of every tile) at few and many tokens (the large block_m tiles,
    tensor-map copies and long-K splits), uniform and skewed: every token on the same k experts, and
    every token's first choice on the last expert."""
    w1, w2 = make_weights(e, d, i, dtype, seed=d)
    cases = [(t, "uniform") for t in (1, 32, 129, 512)] + [(t, r) for t in (129, 512) for r in ("same", "one")]
    for t, routing in cases:
        x, w, ids = make_tokens(t, d, dtype, t), routing_weights(t, k, t), uniform_ids(t, k, e, t)
        if routing == "same":
            ids = torch.randperm(e, generator=_gen(t), device="cuda")[:k].to(torch.int32).repeat(t, 1)
        elif routing == "one":
            ids = torch.cat([torch.full((t, 1), e - 1, dtype=torch.int32, device="cuda"),
                             uniform_ids(t, k - 1, e - 1, t)], dim=1)
        res = run_and_check(x, w1, w2, w, ids, msg=f"{routing} ")
        assert torch.equal(again(x, w1, w2, w, ids), res), "not deterministic"


@pytest.mark.gpu
def test_weights_over_2_pow_31_elements_read_at_the_far_end():
    """w1 and w2 of more than 2^32 elements each (27 GB in bf16): the last experts' rows lie beyond
    int32 and uint32 element offsets. Only the routed experts hold numbers; the rest is NaN and must stay
    unread."""
    e, d, i, dtype = 128, 4096, 8704, torch.bfloat16
    w1 = torch.full((e, 2 * i, d), math.nan, dtype=dtype, device="cuda")
    w2 = torch.full((e, d, i), math.nan, dtype=dtype, device="cuda")
    assert w1.numel() > 2**32 and w2.numel() > 2**32
    g = _gen(0)
    for x in (0, 1, e - 2, e - 1):
        w1[x].normal_(0.0, d ** -0.5, generator=g)
        w2[x].normal_(0.0, i ** -0.5, generator=g)
    ids = torch.tensor([[e - 1, e - 2], [e - 1, 0], [1, e - 1], [e - 2, 1], [0, e - 1]], dtype=torch.int32,
                       device="cuda")
    emap = torch.full((2 * e,), -1, dtype=torch.int32, device="cuda")
    emap[2 * e - 1], emap[3] = e - 1, e - 2  # global 2E-1 -> the last local expert
    mapped = torch.tensor([[2 * e - 1, 3], [3, 5], [2 * e - 1, 0], [9, 11], [3, 2 * e - 1]], dtype=torch.int32,
                          device="cuda")
    try:
        for variant in (None,) + gemv_variants(dtype):
            run_and_check(make_tokens(5, d, dtype), w1, w2, routing_weights(5, 2), ids, variant=variant)
            run_and_check(make_tokens(5, d, dtype), w1, w2, routing_weights(5, 2), mapped, expert_map=emap,
                          variant=variant)
    finally:  # 27 GB: not left to the next tests, pass or fail
        del w1, w2
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_skewed_routing(dtype):
    e = 64
    w1, w2 = make_weights(e, **SMALL, dtype=dtype)
    for t in (1, 129, 2048):
        x = make_tokens(t, SMALL["d"], dtype, t)
        # Every token to one expert (k = 1), weights not normalised (a routed scaling factor).
        one = torch.full((t, 1), 17, dtype=torch.int32, device="cuda")
        run_and_check(x, w1, w2, routing_weights(t, 1, t, normalise=False) * 2.5, one)
        # Every token to the same k experts (highest index included).
        same = torch.tensor([63, 0, 5, 17, 18, 40, 2, 33], dtype=torch.int32, device="cuda").repeat(t, 1)
        run_and_check(x, w1, w2, routing_weights(t, 8, t), same)


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


def route_pairs_here(dtype, block_m):
    """hk_fused_moe_route_pairs of the (dtype, block_m) module on this GPU: up to how many routed pairs the
    grouped chain's GEMMs route in their blocks (0: never, moe_sorting first)."""
    from hipkern.ops._common import module_for
    dev = torch.cuda.current_device()
    return module_for("fused_moe", dev, dtype=str(dtype)[6:], block_m=block_m).hk_fused_moe_route_pairs(dev)


def force_moe_sorting(monkeypatch):
    """The grouped chain's GEMMs then take moe_sorting's m-blocks (their sorted-rows instances) at any pair
    count, where they would route in their blocks (up to hk_fused_moe_route_pairs pairs)."""
    monkeypatch.setattr(sys.modules["hipkern.ops.fused_moe"], "_block_route_pairs", lambda mod, dev: 0)


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
    code = ("import sys, torch; sys.path.insert(0, %r); import test_fused_moe as t; "
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
    code = ("import sys, torch; sys.path.insert(0, %r); import test_fused_moe as t; "
            "torch.save(t._tma_case_outputs(), %r)" % (str(pathlib.Path(__file__).parent), str(tmp_path / "copies.pt")))
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, HIPKERN_NO_TMA="1"), capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    copies = torch.load(tmp_path / "copies.pt")
    for n, (box, copy) in enumerate(zip(_tma_case_outputs(), copies)):
        assert torch.equal(box, copy), f"tensor-map and thread copies differ for {TMA_CASES[n]}"
        x, w1, w2, w, ids, emap, bm = _tma_case(n)
        run_and_check(x, w1, w2, w, ids, expert_map=emap, block_m=bm, variant="grouped", msg=f"tma case {n} ")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_without_tokens_are_never_read(dtype):
    for t, e, k in ((129, 257, 8), (1, 64, 8), (2048, 64, 2)):
        w1, w2 = make_weights(e, **SMALL, dtype=dtype, seed=t)
        used = torch.randperm(e, generator=_gen(t), device="cuda")[:16]
        used[0] = e - 1
        ids = used[torch.rand(t, 16, generator=_gen(t), device="cuda").topk(k, dim=1).indices].to(torch.int32)
        idle = torch.ones(e, dtype=torch.bool, device="cuda")
        idle[ids.view(-1).long()] = False
        w1[idle], w2[idle] = math.nan, math.nan  # a kernel touching an idle expert would spread NaN
        run_and_check(make_tokens(t, SMALL["d"], dtype, t), w1, w2, routing_weights(t, k, t), ids)


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e", [(1, 8, 256), (129, 8, 256), (2048, 8, 64), (300, 2, 9), (129, 9, 257),
                                   (2048, 2, 8)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_expert_map_with_half_the_experts_remote(dtype, t, k, e):
    x, w1, w2, w, ids = make_case(t, **SMALL, e=e, k=k, dtype=dtype, seed=t + e)
    emap, w1l, w2l, remote = half_remote(e, w1, w2, seed=t)
    if t > 1:
        ids[0] = remote[:k].to(torch.int32)  # a token whose every pair is remote: its row must be exactly 0
    assert w1l.shape[0] == e // 2 < e
    res = run_and_check(x, w1l, w2l, w, ids, expert_map=emap)
    if t > 1:
        assert (res[0] == 0).all()


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
    op = sys.modules["hipkern.ops.fused_moe"]  # the module (hipkern.ops.fused_moe is also the function's name)
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


@pytest.mark.gpu
@pytest.mark.parametrize("variant,t", [("grouped", 32), ("grouped", 40), ("decode", 4)])
def test_expert_map_into_more_than_32767_local_experts(variant, t):
    """expert_map's values index w1, whose expert count E_local is not bounded by E: local experts past
    2^15 through the in-block routing table (grouped up to 256 pairs, decode), and through moe_sorting
    (grouped, 320 pairs)."""
    e_local, e, k, dtype = 40000, 16, 8, torch.bfloat16
    w1, w2 = make_weights(e_local, 16, 8, dtype, seed=3)
    emap = torch.full((e,), -1, dtype=torch.int32, device="cuda")
    emap[: e // 2] = torch.arange(e_local - e // 2, e_local, dtype=torch.int32, device="cuda")  # the last ones
    emap[e // 2] = 5
    x, w = make_tokens(t, 16, dtype, seed=t), routing_weights(t, k, seed=t)
    ids = uniform_ids(t, k, e, seed=t)
    run_and_check(x, w1, w2, w, ids, expert_map=emap, block_m=8, variant=variant)


# (variant, tokens) that take every path of the op at k = 4: gemv, gemv_mma, decode, and grouped routed in its
# GEMM blocks (<= 256 pairs) and through moe_sorting
EVERY_PATH = [("gemv", 2), ("gemv_mma", 3), ("decode", 4), ("grouped", 40), ("grouped", 300)]


def nan_padded(w1, w2, extra):
    """Views of w1 and w2 at the start of buffers with `extra` more experts of NaN: a read past the
    experts spreads NaN into the output."""
    e, two_i, d = w1.shape
    buf1 = torch.full((e + extra, two_i, d), math.nan, dtype=w1.dtype, device=w1.device)
    buf2 = torch.full((e + extra, *w2.shape[1:]), math.nan, dtype=w2.dtype, device=w2.device)
    buf1[:e], buf2[:e] = w1, w2
    return buf1[:e], buf2[:e]


@pytest.mark.gpu
@pytest.mark.parametrize("variant,t", EVERY_PATH)
def test_expert_map_past_the_local_experts_never_reads_past_w1_w2(variant, t):
    """expert_map values at or past w1's expert count (only validate=True rejects them) drop their pairs,
    as remote ones do, on every path; no kernel reads past w1 or w2: both are views at the start of
    NaN-filled buffers with room for the mapped experts, so a read past them would spread NaN. A token
    whose every pair maps past w1 gets an exact zero row."""
    e, e_local, k, dtype, d, i = 16, 8, 4, torch.bfloat16, ODD["d"], ODD["i"]
    w1, w2 = make_weights(e_local, d, i, dtype, seed=t)
    w1v, w2v = nan_padded(w1, w2, 4)
    emap = torch.full((e,), -1, dtype=torch.int32, device="cuda")
    emap[:e_local] = torch.randperm(e_local, generator=_gen(t), device="cuda").to(torch.int32)
    emap[e_local:e_local + 4] = torch.tensor([e_local, e_local + 1, e_local + 3, 2**31 - 1], dtype=torch.int32)
    x, w = make_tokens(t, d, dtype, seed=t), routing_weights(t, k, seed=t)
    ids = uniform_ids(t, k, e, seed=t)
    ids[0] = torch.arange(e_local, e_local + k, dtype=torch.int32, device="cuda")  # every pair mapped past w1
    w[0, 0], w[0, 1] = math.inf, math.nan  # a dropped pair's weight is never used (weight x 0 would be NaN)
    ref_map = torch.where(emap >= e_local, -1, emap)  # what the kernels must do with them: drop the pair
    out = poison(torch.empty_like(x))
    # the grouped chain's y rows from NaN-filled memory: a dropped pair's row is never written, so a combine
    # that summed it would read NaN (the old combine did). y comes after the op's workspace and sorting
    # outputs, so all the allocator's free memory is poisoned, not one block of y's size.
    poison_free_memory(x.device)
    hipkern.fused_moe(x, w1v, w2v, w, ids, expert_map=emap, variant=variant, out=out)
    ref = reference(x, w1, w2, w, ids, expert_map=ref_map)
    assert checkAllclose(out, ref, msg=f"{variant} T={t} ", **TOL[dtype]) == 0
    assert (out[0] == 0).all()
    with pytest.raises(ValueError, match="expert_map values"):
        hipkern.fused_moe(x, w1v, w2v, w, ids, expert_map=emap, variant=variant, validate=True)


@pytest.mark.gpu
@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("variant,t", EVERY_PATH)
def test_ids_outside_the_experts_are_dropped_as_the_reference_drops_them(variant, t, mapped):
    """Without validate=True an id outside [0, E) is documented as undefined; every path drops its pair,
    as fused_moe_ref does, and never reads through it: w1 / w2 are views at the start of NaN-filled
    buffers, so a read past the experts would spread NaN. Ids at both ends of int32, just outside E, a
    token whose every id is outside, with and without an expert_map."""
    e, k, dtype, d, i = 16, 4, torch.bfloat16, ODD["d"], ODD["i"]
    w1, w2 = make_weights(e, d, i, dtype, seed=t)
    w1v, w2v = nan_padded(w1, w2, 2)
    emap = None
    if mapped:  # a permutation of all local experts: ids outside [0, E) must not index the map either
        emap = torch.randperm(e, generator=_gen(t + 1), device="cuda").to(torch.int32)
    x, w = make_tokens(t, d, dtype, seed=t), routing_weights(t, k, seed=t)
    ids = uniform_ids(t, k, e, seed=t)
    ids[0] = torch.tensor([-1, e, -2**31, 2**31 - 1], dtype=torch.int32)
    ids[-1, 1] = e + 1
    if t > 2:
        ids[1, 3] = -5
    w = torch.where((ids >= 0) & (ids < e), w, math.inf)  # a dropped pair's weight is never used
    out = poison(torch.empty_like(x))
    hipkern.fused_moe(x, w1v, w2v, w, ids, expert_map=emap, variant=variant, out=out)
    ref = reference(x, w1, w2, w, ids, expert_map=emap)
    assert checkAllclose(out, ref, msg=f"{variant} T={t} map={mapped} ", **TOL[dtype]) == 0
    assert (out[0] == 0).all()
    inside = torch.where((ids >= 0) & (ids < e), ids, 0)  # the same call with the outside pairs' weight 0
    kept_w = torch.where((ids >= 0) & (ids < e), w, 0)
    assert checkAllclose(out, reference(x, w1, w2, kept_w, inside, expert_map=emap), **TOL[dtype]) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("variant,t", EVERY_PATH)
def test_out_in_place_or_apart_from_the_inputs(variant, t):
    """out may be hidden_states itself (every variant reads all of it before writing out); an out that
    shares memory with any other input, or only part of hidden_states, is refused before the launch (its
    blocks would write what others still read)."""
    e, k, dtype, d, i = 16, 4, torch.bfloat16, ODD["d"], ODD["i"]
    x, w1, w2, w, ids = make_case(t, d, i, e, k, dtype, seed=t)
    emap = torch.randperm(e, generator=_gen(t), device="cuda").to(torch.int32)
    ref = reference(x, w1, w2, w, ids, expert_map=emap)
    inplace = x.clone()
    assert hipkern.fused_moe(inplace, w1, w2, w, ids, expert_map=emap, variant=variant, out=inplace) is inplace
    assert checkAllclose(inplace, ref, msg=f"{variant} in place ", **TOL[dtype]) == 0
    big = torch.randn(2 * t + 1, d, device="cuda").to(dtype)
    xs = big[:t]
    with pytest.raises(ValueError, match="out must not overlap hidden_states"):
        hipkern.fused_moe(xs, w1, w2, w, ids, expert_map=emap, variant=variant, out=big[1:t + 1])
    with pytest.raises(ValueError, match="out must not overlap w2"):
        hipkern.fused_moe(x, w1, w2, w, ids, expert_map=emap, variant=variant, out=w2.view(-1)[: t * d].view(t, d))
    raw = torch.zeros(t * d * 2 + 64, dtype=torch.uint8, device="cuda")  # out's bytes, ids and map inside them
    ids_in = raw[:ids.numel() * 4].view(torch.int32).view(ids.shape)
    ids_in.copy_(ids)
    emap_in = raw[256:256 + e * 4].view(torch.int32)
    emap_in.copy_(emap)
    out = raw[: t * d * 2].view(dtype).view(t, d)
    for args, kw, name in (((ids_in,), {"expert_map": emap}, "topk_ids"), ((ids,), {"expert_map": emap_in}, "expert_map")):
        with pytest.raises(ValueError, match=f"out must not overlap {name}"):
            hipkern.fused_moe(x, w1, w2, w, *args, variant=variant, out=out, **kw)


@pytest.mark.gpu
def test_more_work_items_than_int32_indexing_is_a_value_error():
    """The grouped GEMMs count work items (m-blocks x column tiles) in int32; past that the call is refused
    before any launch (2^27 pairs at block_m 64 over an inter_dim of 4096: 2^21 m-blocks x 512 tiles of 8)."""
    t, k = 2**24, 8
    x = torch.zeros(t, 8, dtype=torch.bfloat16, device="cuda")
    w1 = torch.zeros(1, 8192, 8, dtype=torch.bfloat16, device="cuda")
    w2 = torch.zeros(1, 8, 4096, dtype=torch.bfloat16, device="cuda")
    w, ids = torch.zeros(t, k, device="cuda"), torch.zeros(t, k, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="split the tokens over calls"):
        hipkern.fused_moe(x, w1, w2, w, ids, block_m=64, variant="grouped")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_experts_remote_gives_zeros(dtype):
    x, w1, w2, w, ids = make_case(33, **SMALL, e=16, k=4, dtype=dtype)
    emap = torch.full((16,), -1, dtype=torch.int32, device="cuda")
    res = run_and_check(x, w1[:3], w2[:3], w, ids, expert_map=emap)
    assert (res == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_duplicate_ids_in_a_row_are_summed(dtype):
    t, e, k = 129, 8, 9
    w1, w2 = make_weights(e, **SMALL, dtype=dtype)
    x, w = make_tokens(t, SMALL["d"], dtype), routing_weights(t, k)
    ids = torch.randint(0, e, (t, k), generator=_gen(7), device="cuda", dtype=torch.int32)  # 9 of 8: repeats
    ids[0] = 3  # one expert nine times
    ids[1] = torch.tensor([5, 5, 1, 1, 5, 0, 0, 7, 5], dtype=torch.int32)
    res = run_and_check(x, w1, w2, w, ids)
    single = reference(x[:1], w1, w2, torch.ones(1, 1, device="cuda"), ids[:1, :1])  # expert 3 once, weight 1
    want = (w[0].sum().double() * single[0].double())  # the same expert nine times = its sum of weights
    assert checkAllclose(res[0], want.to(dtype), **TOL[dtype]) == 0
    emap, w1l, w2l, _ = half_remote(e, w1, w2)
    run_and_check(x, w1l, w2l, w, ids, expert_map=emap)


def check_few_pairs(dtype, variant, block_m=None):
    """`variant` and the grouped chain on the same inputs, up to 32 pairs: one token at top-8, pairs
    piled onto one expert, every token on the same experts, repeated ids, remote and all-remote
    experts, one pair."""
    e = 64
    w1, w2 = make_weights(e, **ODD, dtype=dtype, seed=block_m or 0)
    emap, w1l, w2l, remote = half_remote(e, w1, w2, seed=block_m or 0)
    cases = [
        (1, uniform_ids(1, 8, e, 1), None),
        (4, uniform_ids(4, 8, e, 2), None),
        (32, torch.full((32, 1), 63, dtype=torch.int32, device="cuda"), None),  # one expert, 32 rows
        (16, torch.tensor([[3, 3]], dtype=torch.int32, device="cuda").repeat(16, 1), None),
        (4, uniform_ids(1, 8, e, 4).repeat(4, 1), None),  # every token on the same 8 experts
        (5, uniform_ids(1, 6, e, 6).repeat(5, 1), None),  # the same at top-6
        (3, torch.randint(0, e, (3, 9), generator=_gen(5), device="cuda", dtype=torch.int32), None),
        (1, torch.tensor([[0]], dtype=torch.int32, device="cuda"), None),
        (4, uniform_ids(4, 8, e, 3), emap),
        (2, remote[:16].view(2, 8).to(torch.int32), emap),  # every pair remote: zeros
    ]
    for t, ids, m in cases:
        x, w = make_tokens(t, ODD["d"], dtype, t), routing_weights(t, ids.shape[1], t)
        a, b = (w1, w2) if m is None else (w1l, w2l)
        got = run_and_check(x, a, b, w, ids, expert_map=m, block_m=block_m, variant=variant)
        grouped = run_and_check(x, a, b, w, ids, expert_map=m, block_m=block_m, variant="grouped")
        assert checkAllclose(got, grouped, msg=f"{variant} vs grouped ", **TOL[dtype]) == 0
        if m is not None and t == 2:
            assert (got == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("e", [257, 1024])
@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_decode_over_more_experts_than_block_threads(activation, e):
    """The decode kernel routes in every block: more experts than its threads (each thread several), with
    either activation, 32 pairs (its most)."""
    x, w1, w2, w, ids = make_case(4, **SMALL, e=e, k=8, dtype=torch.bfloat16, seed=e)
    ids[0, 0] = e - 1
    run_and_check(x, w1, w2, w, ids, activation=activation, block_m=32, variant="decode")


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [8, 16, 32, 64])  # 32: the database's decode rows on sm_90
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_variant(dtype, block_m):
    """The one-launch decode variant (routing in every block, a grid barrier before the combine) and
    the grouped chain on the same inputs, up to its 32 pairs: one token at top-8, pairs piled onto one
    expert (several m-blocks), repeated ids, remote and all-remote experts, a long reduction (split
    K), one pair. Consecutive calls with new routing check that its counters are left at zero."""
    check_few_pairs(dtype, "decode", block_m)
    t, d, i = 2, 4096, 256  # few items over a long reduction: the gated GEMM splits K
    x, w1, w2, w, ids = make_case(t, d, i, 8, 2, dtype, seed=3)
    first = run_and_check(x, w1, w2, w, ids, block_m=block_m, variant="decode")
    for _ in range(5):
        assert torch.equal(again(x, w1, w2, w, ids, block_m=block_m, variant="decode"), first)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["decode", "gemv", "gemv_mma"])
def test_few_pair_variants_under_graph_capture(variant):
    t, e, k = 4, 64, 8
    x, w1, w2, w, ids = make_case(t, **SMALL, e=e, k=k, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    hipkern.fused_moe(x, w1, w2, w, ids, out=out, variant=variant)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        hipkern.fused_moe(x, w1, w2, w, ids, out=out, variant=variant)
    for seed in range(1, 4):
        x.copy_(make_tokens(t, SMALL["d"], torch.bfloat16, seed))
        w.copy_(routing_weights(t, k, seed))
        ids.copy_(uniform_ids(t, k, e, seed) if seed != 2 else torch.full_like(ids, 9))
        poison(out)
        g.replay()
        torch.cuda.synchronize()
        assert checkAllclose(out, reference(x, w1, w2, w, ids), msg=f"{variant} replay {seed} ",
                             **TOL[torch.bfloat16]) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["gemv", "gemv_mma"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_variant(dtype, variant):
    """The matrix-vector variants (a block per gated row and pair, or for gemv_mma per row and expert
    with all its pairs; a wave per output element summing its token's slots): the few-pair cases of
    the decode test (for gemv_mma: 32 pairs on one expert, 8 gated passes of 4 pairs on NVIDIA, 16 of 2
    on CDNA, and 4 down passes of 8, 2 of 16; one pair, a down pass cut into a slice per wave; no kept
    pair), then the edges of their loops: model dims whose chunks do not fill the block's threads (200, 8 / 4 chunks
    of 16 bytes short of one per thread; for gemv_mma segments of one partial run) or need a second
    pass / load batch (8704), inter dims shorter than a wave (72) or spanning several load batches
    with a partial one (2176, over slots 9 at a time), top-32 (a slot per lane of a full wave), ids
    out of range (dropped), the 32-pair limit, and bitwise repeats. float32 has no gemv_mma: a
    ValueError."""
    if variant not in gemv_variants(dtype):
        x, w1, w2, w, ids = make_case(1, 128, 64, 8, 2, dtype)
        with pytest.raises(ValueError, match="variant='gemv_mma' takes float16 or bfloat16"):
            hipkern.fused_moe(x, w1, w2, w, ids, variant=variant)
        return
    check_few_pairs(dtype, variant)
    for t, d, i, e, k in ((1, 8704, 72, 16, 8), (3, 128, 2176, 16, 9), (1, 200, 2176, 64, 32), (32, 256, 128, 8, 1),
                          (2, 7168, 256, 16, 8)):
        x, w1, w2, w, ids = make_case(t, d, i, e, k, dtype, seed=t * 100 + k)
        if k == 9:  # ids out of range are dropped without validate: as pairs of weight 0
            kept_ids, kept_w = ids.clone(), w.clone()
            ids[1, 2], ids[2, 0] = e, -1
            kept_w[1, 2] = kept_w[2, 0] = 0.0
            res = hipkern.fused_moe(x, w1, w2, w, ids, out=poison(torch.empty_like(x)), variant=variant)
            assert checkAllclose(res, reference(x, w1, w2, kept_w, kept_ids), msg=f"{variant}, dropped ids ",
                                 **TOL[dtype]) == 0
        else:
            res = run_and_check(x, w1, w2, w, ids, variant=variant)
        grouped = hipkern.fused_moe(x, w1, w2, w, ids, variant="grouped")
        assert checkAllclose(res, grouped, msg=f"{variant} vs grouped ", **TOL[dtype]) == 0
        for _ in range(3):
            assert torch.equal(again(x, w1, w2, w, ids, variant=variant), res), "not deterministic"


@pytest.mark.gpu
@pytest.mark.parametrize("d,i,e,k", LARGE)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gemv_variant_large_shapes(dtype, d, i, e, k):
    w1, w2 = make_weights(e, d, i, dtype, seed=d)
    for t in (1, 32 // k):
        x, w, ids = make_tokens(t, d, dtype, t), routing_weights(t, k, t), uniform_ids(t, k, e, t)
        for variant in gemv_variants(dtype):
            run_and_check(x, w1, w2, w, ids, variant=variant)
            if t > 1:  # every token on the first token's experts: gemv_mma's pairs grouped by expert
                run_and_check(x, w1, w2, w, ids[:1].expand(t, k).contiguous(), variant=variant)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["grouped", "decode", "gemv", "gemv_mma"])
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_internal_buffers_are_written_before_they_are_read(dtype, block_m, variant):
    """The op's own buffers (the intermediate; for float32 at block_m 64 on sm_90 also the tokens as
    split rows, whose blocks of 64 columns pad D = 200 and I = 72) come from torch's caching allocator
    uninitialised: fill the memory it will hand out with NaN first, so that any element read before it
    is written reaches the output."""
    if variant == "gemv_mma" and dtype == torch.float32:
        pytest.skip("gemv_mma takes 16-bit types (test_gemv_variant checks the error)")
    t, e, k = 13, 8, 2  # 26 pairs: within every variant's domain
    x, w1, w2, w, ids = make_case(t, **ODD, e=e, k=k, dtype=dtype, seed=block_m)
    hipkern.fused_moe(x, w1, w2, w, ids, block_m=block_m, variant=variant)  # module loaded outside
    poison_free_memory(x.device)
    run_and_check(x, w1, w2, w, ids, block_m=block_m, variant=variant)


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [None, 64])  # 64: float32 on sm_90 splits the tokens in a pass of its own
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_graph_capture_and_replay_with_new_routing(dtype, block_m):
    graph_replay_with_new_routing(dtype, 129, 64, 8, block_m=block_m, map_activation="gelu", map_out=False)


def graph_replay_with_new_routing(dtype, t, e, k, seed=0, map_activation="silu", map_out=True, **kw):
    """Two calls captured in one CUDA graph: every expert local into out=, and half of them remote through an
    expert_map with `map_activation` (into out= or functional, its output allocated in the capture); replayed
    with new tokens, weights and routing (uniform, every token on the same experts, every pair on one expert),
    each output poisoned first, against the reference."""
    x, w1, w2, w, ids = make_case(t, **SMALL, e=e, k=k, dtype=dtype, seed=seed)
    emap, w1l, w2l, _ = half_remote(e, w1, w2, seed=seed)
    out, out_map = torch.empty_like(x), torch.empty_like(x)
    mapped = dict(kw, expert_map=emap, activation=map_activation, out=out_map if map_out else None)
    hipkern.fused_moe(x, w1, w2, w, ids, out=out, **kw)  # warm-up (module load) outside the capture
    hipkern.fused_moe(x, w1l, w2l, w, ids, **mapped)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        hipkern.fused_moe(x, w1, w2, w, ids, out=out, **kw)
        out_map = hipkern.fused_moe(x, w1l, w2l, w, ids, **mapped)
    same_k = torch.arange(k, dtype=torch.int32, device="cuda").repeat(t, 1) * 7 + 1
    for s, new_ids in ((1, uniform_ids(t, k, e, 1)), (2, same_k), (3, torch.full_like(ids, 42)),
                       (4, uniform_ids(t, k, e, 4))):
        x.copy_(make_tokens(t, SMALL["d"], dtype, s))
        w.copy_(routing_weights(t, k, s))
        ids.copy_(new_ids)
        poison(out), poison(out_map)
        g.replay()
        torch.cuda.synchronize()
        assert checkAllclose(out, reference(x, w1, w2, w, ids), msg=f"replay {s} ", **TOL[dtype]) == 0
        assert checkAllclose(out_map, reference(x, w1l, w2l, w, ids, map_activation, emap), msg=f"replay {s} map ",
                             **TOL[dtype]) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["grouped", "decode"])
def test_a_graph_captured_on_a_warm_stream_has_counters_of_its_own(variant, monkeypatch):
    """The split-K arrival counters (and the decode variant's grid barrier) are kept per stream for eager
    calls; a call captured on a stream that eager calls already used must still get counters of its own,
    since the graph may be replayed on another stream while eager calls run on the first. Then a replay
    on a second stream, concurrent with eager calls on the first, is checked against the reference."""
    op = sys.modules["hipkern.ops.fused_moe"]
    t, e, k, dtype = 4 if variant == "decode" else 40, 64, 8, torch.bfloat16
    x, w1, w2, w, ids = make_case(t, 2048, 128, e, k, dtype, seed=11)  # D 2048: the gated GEMM splits K
    side, other = torch.cuda.Stream(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager_out = hipkern.fused_moe(x, w1, w2, w, ids, variant=variant)  # the stream's counters now exist
    side.synchronize()
    eager = {c.data_ptr() for c in op._counters.values()}
    assert eager, "an eager grouped / decode call keeps its counters"
    seen = []
    real = op._workspace
    monkeypatch.setattr(op, "_workspace", lambda *a: seen.append(real(*a)) or seen[-1])
    out = torch.empty_like(x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        hipkern.fused_moe(x, w1, w2, w, ids, variant=variant, out=out)
    assert seen and all(c.data_ptr() not in eager for _, c in seen)
    ref = reference(x, w1, w2, w, ids)
    other.wait_stream(torch.cuda.current_stream())
    for _ in range(3):
        poison(out)  # (on the current stream: the replay on `other` waits for it)
        other.wait_stream(torch.cuda.current_stream())
        other.wait_stream(side)
        with torch.cuda.stream(other):
            g.replay()
        with torch.cuda.stream(side):
            eager_again = [hipkern.fused_moe(x, w1, w2, w, ids, variant=variant) for _ in range(4)]
        torch.cuda.synchronize()
        assert checkAllclose(out, ref, msg=f"{variant} replay ", **TOL[dtype]) == 0
        assert all(torch.equal(a, eager_out) for a in eager_again)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,i,e,k,t,routing", [
    (torch.bfloat16, 256, 128, 64, 8, 2048, "uniform"),
    (torch.float32, 256, 128, 64, 8, 2048, "uniform"),
    (torch.float16, 256, 128, 64, 8, 2048, "remote"),
    (torch.bfloat16, 7168, 256, 256, 8, 32, "uniform"),
    (torch.bfloat16, 7168, 256, 256, 8, 32, "same"),     # split-K parts summed by the last to arrive
    (torch.bfloat16, 4096, 14336, 8, 2, 128, "same"),
    (torch.float32, 4096, 14336, 8, 2, 128, "same")])
def test_deterministic(dtype, d, i, e, k, t, routing):
    """Bitwise the same output over 10 more runs, into poisoned outputs: uniform routing, every token on
    the same k experts (few large items, split over K), half the experts remote."""
    x, w1, w2, w, ids = make_case(t, d, i, e, k, dtype)
    emap = None
    if routing == "same":
        ids = torch.randperm(e, generator=_gen(1), device="cuda")[:k].to(torch.int32).repeat(t, 1)
    elif routing == "remote":
        emap, w1, w2, _ = half_remote(e, w1, w2)
    first = run_and_check(x, w1, w2, w, ids, expert_map=emap)
    for _ in range(10):
        assert torch.equal(again(x, w1, w2, w, ids, expert_map=emap), first)


@pytest.mark.gpu
def test_torch_compile():
    dtype, e, k = torch.bfloat16, 64, 8

    def moe(x, w1, w2, w, ids, w1l, w2l, emap):
        a = hipkern.fused_moe(x, w1, w2, w, ids)
        b = hipkern.fused_moe(x, w1l, w2l, w, ids, activation="gelu", expert_map=emap, block_m=16)
        return a * 2, b * 4

    compiled = torch.compile(moe, fullgraph=True)
    w1, w2 = make_weights(e, **SMALL, dtype=dtype)
    emap, w1l, w2l, _ = half_remote(e, w1, w2)
    for t in (16, 33):
        x, w, ids = make_tokens(t, SMALL["d"], dtype, t), routing_weights(t, k, t), uniform_ids(t, k, e, t)
        a, b = compiled(x, w1, w2, w, ids, w1l, w2l, emap)
        assert checkAllclose(a / 2, reference(x, w1, w2, w, ids), **TOL[dtype]) == 0
        assert checkAllclose(b / 4, reference(x, w1l, w2l, w, ids, "gelu", emap), **TOL[dtype]) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_tokens(dtype):
    w1, w2 = make_weights(8, **SMALL, dtype=dtype)
    x = torch.empty(0, SMALL["d"], dtype=dtype, device="cuda")
    w, ids = torch.empty(0, 2, device="cuda"), torch.empty(0, 2, dtype=torch.int32, device="cuda")
    y = hipkern.fused_moe(x, w1, w2, w, ids)
    assert y.shape == (0, SMALL["d"]) and y.dtype == dtype and y.is_cuda
    out = torch.empty(0, SMALL["d"], dtype=dtype, device="cuda")
    assert hipkern.fused_moe(x, w1, w2, w, ids, out=out, validate=True) is out
    emap = torch.tensor([0, -1, 1, -1, 2, 3, 4, 5, 6, 7], dtype=torch.int32, device="cuda")
    assert hipkern.fused_moe(x, w1, w2, w, ids, expert_map=emap, block_m=8).shape == (0, SMALL["d"])


@pytest.mark.gpu
def test_validate_rejects_out_of_range_ids_and_map_values():
    e_global, e_local = 32, 16
    x, w1, w2, w, ids = make_case(33, **SMALL, e=e_global, k=4, dtype=torch.bfloat16)
    w1, w2 = w1[:e_local].contiguous(), w2[:e_local].contiguous()
    emap = torch.arange(e_global, dtype=torch.int32, device="cuda") % e_local
    emap[::3] = -1
    run_and_check(x, w1, w2, w, ids, expert_map=emap)
    assert checkAllclose(again(x, w1, w2, w, ids, expert_map=emap, validate=True),
                         reference(x, w1, w2, w, ids, expert_map=emap), **TOL[x.dtype]) == 0
    for bad in (e_global, -1, 2**31 - 1):
        wrong = ids.clone()
        wrong[5, 1] = bad
        with pytest.raises(ValueError, match="topk_ids"):
            hipkern.fused_moe(x, w1, w2, w, wrong, expert_map=emap, validate=True)
    with pytest.raises(ValueError, match="topk_ids"):  # without a map, ids index w1's experts
        hipkern.fused_moe(x, w1, w2, w, ids, validate=True)
    for bad in (e_local, -2):
        wrong = emap.clone()
        wrong[7] = bad
        with pytest.raises(ValueError, match="expert_map"):
            hipkern.fused_moe(x, w1, w2, w, ids, expert_map=wrong, validate=True)


@pytest.mark.gpu
@pytest.mark.parametrize("spread", ["plain", "values", "rows"])
@pytest.mark.parametrize("block_m", [32, 64])
def test_float32_is_float32_accurate(block_m, spread):
    """float32 without allow_tf32 keeps float32's accuracy on every path: CUDA-core FMAs, or (block_m 64
    on sm_90) scaled fp16 splits on the tensor cores. Errors against float64, relative to each output
    row's largest magnitude, measured up to 8192 x 6144: rms 1.2e-7 (splits) and 3.5e-7 (FMAs), max
    2.3e-6 (TF32's would be ~1e-4), also when values or whole rows span 2^+-20 (the splits scale per
    row and stage)."""
    t, d, i, e, k = 64, 2048, 1024, 8, 2
    x, w1, w2, w, ids = make_case(t, d, i, e, k, torch.float32, seed=block_m)
    g = _gen(7)
    if spread == "values":
        for a in (x, w1, w2):
            a.mul_(torch.pow(2.0, torch.randint(-20, 21, a.shape, device="cuda", generator=g).float()))
    elif spread == "rows":
        w1.mul_(torch.pow(2.0, torch.randint(-20, 21, (e, 2 * i, 1), device="cuda", generator=g).float()))
        x.mul_(torch.pow(2.0, torch.randint(-20, 21, (t, 1), device="cuda", generator=g).float()))
        w1[:, ::7] = 0  # whole zero rows: a scale of its own, nothing to split
    out = poison(torch.empty_like(x))
    hipkern.fused_moe(x, w1, w2, w, ids, block_m=block_m, variant="grouped", out=out)
    ref = reference(x, w1, w2, w, ids)
    err = (out.double() - ref).abs() / ref.abs().amax(dim=1, keepdim=True)
    assert torch.isfinite(err).all(), "unwritten or non-finite outputs"
    assert err.max().item() <= 1e-5 and err.pow(2).mean().sqrt().item() <= 1e-6, \
        f"max {err.max().item():.2e}, rms {err.pow(2).mean().sqrt().item():.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["grouped", "decode"])
@pytest.mark.parametrize("side", ["huge weights", "huge tokens"])
@pytest.mark.parametrize("block_m", [16, 64])
def test_float32_weights_and_tokens_far_from_one(block_m, side, variant, request):
    """float32 gate rows of ~2^116 against tokens of ~2^-100 (and the mirror: tokens of ~2^100 against gate
    rows and w2 of ~2^-100) give the float64 reference's outputs: every product stays in float's range,
    so must the kernels' arithmetic. The tokens are scaled by 2^-a, the gate rows by 2^b and w2 by
    2^(2a - b), which keeps the output O(1) (gate 2^(b - a), up 2^-a, the intermediate ~2^(b - 2a)). The
    documented limit: at block_m 64 on sm_90 the scaled fp16 splits unscale a stage's sums by the
    weight's power of two before the token's, which may overflow for weights above ~2^108 (gate rows of
    ~2^108 passed here, ~2^116 give inf). The strict xfail, on that overflow alone, fails the day it is
    mended; an exact mend measured 0.3-4.4 % slower on the float32 Mixtral-like cases (NOTES.md,
    2026-11-28 (3))."""
    overflow = block_m == 64 and side == "huge weights" and sm90_build()
    if overflow:
        request.applymarker(pytest.mark.xfail(strict=True, raises=OverflowError,
                                              reason="SplitMath's documented limit for weights above ~2^108"))
    t, d, i, e, k = 16 if variant == "decode" else 129, 256, 128, 8, 2  # (decode: at most 32 pairs)
    x, w1, w2, w, ids = make_case(t, d, i, e, k, torch.float32, seed=block_m)
    a, b = (100, 118) if side == "huge weights" else (-100, -100)
    x.mul_(2.0 ** -a)
    w1[:, :i].mul_(2.0 ** b)
    w2.mul_(2.0 ** (2 * a - b))
    assert torch.isfinite(x).all() and torch.isfinite(w1).all() and torch.isfinite(w2).all()
    out = poison(torch.empty_like(x))
    hipkern.fused_moe(x, w1, w2, w, ids, block_m=block_m, variant=variant, out=out)
    ref = reference(x, w1, w2, w, ids)
    assert torch.isfinite(ref).all() and 1e-3 < ref.abs().max().item() < 1e3  # O(1)
    if overflow and not torch.isfinite(out).all():
        raise OverflowError("non-finite outputs where the float64 reference is O(1)")
    assert checkAllclose(out, ref, msg=f"{side} block_m={block_m} {variant} ", **TOL[torch.float32]) == 0


@pytest.mark.gpu
def test_allow_tf32_stays_close():
    """allow_tf32=True may use TF32 for fp32 inputs (10-bit mantissa): bf16's tolerance, not fp32's."""
    x, w1, w2, w, ids = make_case(129, **SMALL, e=64, k=8, dtype=torch.float32)
    res = hipkern.fused_moe(x, w1, w2, w, ids, allow_tf32=True)
    assert checkAllclose(res, reference(x, w1, w2, w, ids), **TOL[torch.bfloat16]) == 0


@pytest.mark.gpu
def test_arguments_on_another_device_are_rejected():
    x, w1, w2, w, ids = make_case(4, **SMALL, e=8, k=2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="w1 must be on"):
        hipkern.fused_moe(x, w1.cpu(), w2, w, ids)
    with pytest.raises(ValueError, match="topk_ids must be on"):
        hipkern.fused_moe(x, w1, w2, w, ids.cpu())
    with pytest.raises(ValueError, match="expert_map must be on"):
        hipkern.fused_moe(x, w1, w2, w, ids, expert_map=torch.arange(8, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\bout must be on"):
        hipkern.fused_moe(x, w1, w2, w, ids, out=torch.empty(4, SMALL["d"], dtype=torch.bfloat16))


# ------------------------------------------------------------------- argument validation (any device)
def _cpu_case(t=4, d=16, i=8, e=4, k=2, dtype=torch.bfloat16, **change):
    c = dict(hidden_states=torch.randn(t, d, dtype=dtype), w1=torch.randn(e, 2 * i, d, dtype=dtype),
             w2=torch.randn(e, d, i, dtype=dtype), topk_weights=torch.rand(t, k),
             topk_ids=torch.randint(0, e, (t, k), dtype=torch.int32))
    c.update(change)
    return c


def _bf(*shape):
    return torch.randn(*shape, dtype=torch.bfloat16)


BAD = [
    # hidden_states
    (dict(hidden_states=torch.randn(4, 16, dtype=torch.float64)), {}, "hidden_states"),
    (dict(hidden_states=torch.ones(4, 16, dtype=torch.int32)), {}, "hidden_states"),
    (dict(hidden_states=_bf(1, 4, 16)), {}, "hidden_states"),
    (dict(hidden_states=_bf(16)), {}, "hidden_states"),
    (dict(hidden_states=_bf(16, 4).t()), {}, "hidden_states"),
    (dict(hidden_states=[[1.0] * 16] * 4), {}, "hidden_states"),
    (_cpu_case(d=0), {}, "hidden_states must have at least one column"),
    # w1: dtype, ndim, odd second dim, D mismatch
    (dict(w1=torch.randn(4, 16, 16, dtype=torch.float16)), {}, "w1"),
    (dict(w1=_bf(16, 16)), {}, "w1"),
    (dict(w1=_bf(4, 17, 16)), {}, "w1"),
    (dict(w1=_bf(4, 16, 24)), {}, "w1"),
    # w2: dtype, not [E, D, I] (transposed, other E, other I), ndim
    (dict(w2=torch.randn(4, 16, 8)), {}, "w2"),
    (dict(w2=_bf(4, 8, 16)), {}, "w2"),
    (dict(w2=_bf(3, 16, 8)), {}, "w2"),
    (dict(w2=_bf(4, 16, 16)), {}, "w2"),
    (dict(w2=_bf(4, 16)), {}, "w2"),
    # topk_weights / topk_ids
    (dict(topk_weights=torch.rand(4, 3)), {}, "topk_(weights|ids)"),
    (dict(topk_weights=torch.rand(5, 2), topk_ids=torch.zeros(5, 2, dtype=torch.int32)), {}, "topk_(weights|ids)"),
    (dict(topk_ids=torch.zeros(4, 2, dtype=torch.int64)), {}, "topk_ids"),
    (dict(topk_ids=torch.zeros(8, dtype=torch.int32)), {}, "topk_ids"),
    (dict(topk_weights=torch.rand(4, 2, dtype=torch.bfloat16)), {}, "topk_weights"),
    (dict(topk_weights=torch.rand(4, 2, dtype=torch.float64)), {}, "topk_weights"),
    (dict(topk_weights=torch.rand(8)), {}, "topk_weights"),
    # 16-byte rows: D and I multiples of 8 (bf16/fp16) or 4 (fp32)
    (_cpu_case(d=12, i=8, dtype=torch.bfloat16), {}, "multiples? of 8"),
    (_cpu_case(d=16, i=12, dtype=torch.bfloat16), {}, "multiples? of 8"),
    (_cpu_case(d=20, i=8, dtype=torch.float16), {}, "multiples? of 8"),
    (_cpu_case(d=6, i=8, dtype=torch.float32), {}, "multiples? of 4"),
    (_cpu_case(d=8, i=2, dtype=torch.float32), {}, "multiples? of 4"),
    # keywords
    ({}, dict(activation="relu"), "activation"),
    ({}, dict(activation=None), "activation"),
    ({}, dict(block_m=256), "block_m"),
    (_cpu_case(dtype=torch.float32), dict(block_m=128), "block_m"),
    ({}, dict(block_m=0), "block_m"),
    ({}, dict(block_m=24), "block_m"),
    ({}, dict(block_m=True), "block_m"),
    ({}, dict(block_m=16.0), "block_m"),
    ({}, dict(variant="v1"), "variant"),
    ({}, dict(variant=1), "variant"),
    (_cpu_case(t=9, k=4), dict(variant="decode"), "variant='decode' takes at most 32"),
    (_cpu_case(t=11, k=3), dict(variant="gemv"), "variant='gemv' takes at most 32"),
    (_cpu_case(t=11, k=3), dict(variant="gemv_mma"), "variant='gemv_mma' takes at most 32"),
    (_cpu_case(dtype=torch.float32), dict(variant="gemv_mma"), "variant='gemv_mma' takes float16 or bfloat16"),
    ({}, dict(variant="decode", block_m=128), "variant='decode' takes block_m up to 64"),
    ({}, dict(expert_map=torch.zeros(4, dtype=torch.int64)), "expert_map"),
    ({}, dict(expert_map=torch.zeros(4)), "expert_map"),
    ({}, dict(expert_map=torch.zeros(2, 2, dtype=torch.int32)), "expert_map"),
    ({}, dict(expert_map=torch.zeros(0, dtype=torch.int32)), "expert_map"),
    ({}, dict(out=_bf(4, 8)), r"\bout\b"),
    ({}, dict(out=_bf(5, 16)), r"\bout\b"),
    ({}, dict(out=torch.empty(4, 16)), r"\bout\b"),
    ({}, dict(out=_bf(1, 4, 16)), r"\bout\b"),
    # everything right but on the CPU
    ({}, {}, "must be on a GPU"),
    (_cpu_case(d=12, i=4, dtype=torch.float32), {}, "must be on a GPU"),  # 12 and 4 are fine for fp32
    (_cpu_case(dtype=torch.float16), dict(expert_map=torch.full((9,), -1, dtype=torch.int32), block_m=8,
                                          activation="gelu"), "must be on a GPU"),
]


@pytest.mark.parametrize("change,kw,match", [pytest.param(c, kw, m, id=f"{i}-{m}") for i, (c, kw, m) in enumerate(BAD)])
def test_bad_arguments_raise_value_error(change, kw, match):
    c = _cpu_case(**change)
    args = [c[n] for n in ARG_NAMES]
    with pytest.raises(ValueError, match=match) as err:
        hipkern.fused_moe(*args, **kw)
    if "GPU" not in match:  # the bad argument's own check fired, not the last one (CPU tensors' device check)
        assert "must be on a GPU" not in str(err.value), str(err.value)


def test_op_is_registered_for_compile_and_graphs():
    schema = torch.ops.hipkern.fused_moe.default._schema
    args = [(a.name, str(a.type)) for a in schema.arguments][:8]
    assert args == [("hidden_states", "Tensor"), ("w1", "Tensor"), ("w2", "Tensor"), ("topk_weights", "Tensor"),
                    ("topk_ids", "Tensor"), ("activation", "str"), ("expert_map", "Optional[Tensor]"),
                    ("block_m", "int")]


def test_fake_impl_gives_the_output_shape_without_a_gpu():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 64, device="cuda", dtype=torch.bfloat16)
        w1 = torch.empty(8, 32, 64, device="cuda", dtype=torch.bfloat16)
        w2 = torch.empty(8, 64, 16, device="cuda", dtype=torch.bfloat16)
        w, ids = torch.empty(5, 2, device="cuda"), torch.empty(5, 2, device="cuda", dtype=torch.int32)
        y = torch.ops.hipkern.fused_moe(x, w1, w2, w, ids, "silu", None, 0)
        assert y.shape == (5, 64) and y.dtype == torch.bfloat16


# ------------------------------------------------------------------- the reference itself (CPU)
def _pair_loop(x, w1, w2, w, ids, activation, expert_map=None, intermediate_dtype=None):
    """out[t] = sum over (t, j) of w[t, j] * w2[e] @ (act(w1[e, :I] @ x_t) * (w1[e, I:] @ x_t)), with
    the activation in plain Python floats: independent of the reference's torch ops."""
    act = {"silu": lambda v: v / (1.0 + math.exp(-v)),
           "gelu": lambda v: 0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0)))}[activation]
    inter = w1.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if expert_map is not None:
                e = int(expert_map[e])
                if e < 0:
                    continue
            xt = x[t].double()
            gate, up = w1[e, :inter].double() @ xt, w1[e, inter:].double() @ xt
            h = torch.tensor([act(float(g)) * float(u) for g, u in zip(gate, up)], dtype=torch.float64)
            if intermediate_dtype is not None:
                h = h.to(intermediate_dtype).double()
            out[t] += float(w[t, j]) * (w2[e].double() @ h)
    return out


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_a_loop_over_pairs(dtype, activation):
    torch.manual_seed(0)
    t, d, i, e, k = 7, 16, 8, 6, 3
    w1, w2 = make_weights(e, d, i, dtype, device="cpu")
    x, w = make_tokens(t, d, dtype, device="cpu"), routing_weights(t, k, device="cpu")
    ids = torch.randint(0, e, (t, k), dtype=torch.int32)
    ids[0] = 2  # duplicates within a row
    ids[1] = torch.tensor([5, 0, 5], dtype=torch.int32)
    inter = None if dtype == torch.float32 else dtype
    got = fused_moe_ref(x, w1, w2, w, ids, activation, None, torch.float64, inter)
    assert got.dtype == torch.float64 and got.shape == (t, d)
    torch.testing.assert_close(got, _pair_loop(x, w1, w2, w, ids, activation, None, inter), rtol=1e-12, atol=1e-12)
    # expert parallelism: global experts 1, 3, 4 remote; local indices in a permuted order
    emap = torch.tensor([2, -1, 0, -1, -1, 1], dtype=torch.int32)
    ids[2] = torch.tensor([1, 3, 4], dtype=torch.int32)  # every pair remote: a zero row
    got = fused_moe_ref(x, w1[:3], w2[:3], w, ids, activation, emap, torch.float64, inter)
    torch.testing.assert_close(got, _pair_loop(x, w1[:3], w2[:3], w, ids, activation, emap, inter),
                               rtol=1e-12, atol=1e-12)
    assert (got[2] == 0).all()
    # ids outside [0, E) through a map are dropped, not wrapped to the map's last entries (-1 -> emap[5])
    out_of_range = ids.clone()
    out_of_range[3] = torch.tensor([-1, 6, -7], dtype=torch.int32)
    got = fused_moe_ref(x, w1[:3], w2[:3], w, out_of_range, activation, emap, torch.float64, inter)
    assert (got[3] == 0).all()
    torch.testing.assert_close(got[4:], _pair_loop(x, w1[:3], w2[:3], w, ids, activation, emap, inter)[4:],
                               rtol=1e-12, atol=1e-12)
    # the benchmark's naive loop: the same sums in the input dtype
    naive = fused_moe_ref(x, w1, w2, w, ids, activation, None, dtype)
    assert naive.dtype == dtype
    assert checkAllclose(naive, fused_moe_ref(x, w1, w2, w, ids, activation), atol=5e-2, rtol=5e-2) == 0


def test_reference_drops_ids_outside_the_experts():
    """Ids outside [0, E), and map values past w1's experts, contribute nothing (as the kernels drop them);
    the reference had raised IndexError for some of them and dropped others."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, generator=g, dtype=torch.float64)
    w1 = torch.randn(6, 16, 16, generator=g, dtype=torch.float64)
    w2 = torch.randn(6, 16, 8, generator=g, dtype=torch.float64)
    w = torch.rand(4, 2, generator=g, dtype=torch.float64).float()
    ids = torch.tensor([[0, 6], [-1, 2], [5, 10**6], [3, 3]], dtype=torch.int32)
    keep = torch.tensor([[1, 0], [0, 1], [1, 0], [1, 1]], dtype=torch.float32)
    want = fused_moe_ref(x, w1, w2, w * keep, ids.clamp(0, 5))
    assert torch.allclose(fused_moe_ref(x, w1, w2, w, ids), want, rtol=1e-12, atol=1e-12)
    emap = torch.tensor([0, 1, 2, 3, 4, 5, 40], dtype=torch.int32)  # global expert 6 -> 40: not one of w1's
    assert torch.allclose(fused_moe_ref(x, w1, w2, w, ids, expert_map=emap), want, rtol=1e-12, atol=1e-12)


def test_reference_zero_tokens_and_bad_activation():
    w1, w2 = make_weights(4, 16, 8, torch.float32, device="cpu")
    x, w, ids = torch.empty(0, 16), torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int32)
    assert fused_moe_ref(x, w1, w2, w, ids).shape == (0, 16)
    with pytest.raises(ValueError, match="activation"):
        fused_moe_ref(torch.randn(2, 16), w1, w2, torch.rand(2, 2), torch.zeros(2, 2, dtype=torch.int32), "relu")


def test_trace_refuses_float32_and_unknown_cases_before_any_gpu_work():
    from hipkern.bench import moe as bench
    from hipkern.bench import moe_trace

    num = next(c.num for c in bench.all_cases() if c.dtype == torch.float32)
    with pytest.raises(SystemExit, match=f"--case {num}: the traced module is bf16 only"):
        moe_trace.main(["--case", str(num)])
    last = max(c.num for c in bench.all_cases())
    with pytest.raises(SystemExit, match=f"--case {last + 1}: no such case; the benchmark's cases are 1-{last}"):
        moe_trace.main(["--case", str(last + 1)])


def test_python_pair_limits_are_the_kernels():
    """The op's pair limits (which variant may run, and the int32 work-item bound before any launch) are
    the kernels' own constants; a change on one side only fails here."""
    import importlib
    import re

    op = importlib.import_module("hipkern.ops.fused_moe")  # the module (the package's name is the function)

    src = pathlib.Path(__file__).resolve().parents[1] / "csrc_hip" / "fused_moe"

    def constant(header, name):
        m = re.search(rf"constexpr int {name} = (\d+);", (src / header).read_text())
        assert m, f"{name} not found in {header}"
        return int(m.group(1))

    assert op.DECODE_MAX_PAIRS == constant("decode.h", "kDecodePairs")
    assert op.GEMV_MAX_PAIRS == constant("gemv.h", "kGemvPairs")
    assert op.ROUTE_MAX_PAIRS == constant("route.h", "kRoutePairs")


def test_gemv_runs_only_grids_hip_runs():
    """gemv's grids (a 256-thread block a pair and inter_dim row; tokens x model_dim units at 64 threads a
    unit on CDNA) stay under 2^32 threads, HIP's limit: a larger call is not chosen for gemv (the database
    nor the heuristic) and a forced one is a ValueError naming both dimensions, before any launch."""
    import importlib

    import re

    op = importlib.import_module("hipkern.ops.fused_moe")
    cfg = (pathlib.Path(__file__).resolve().parents[1] / "csrc_hip" / "fused_moe" / "gemv.h").read_text()
    gated, down = (int(re.search(rf"constexpr int {n} = (\d+);", cfg).group(1)) for n in ("kGatedThreads", "kDownThreads"))
    # a down block of kDownThreads threads covers kDownThreads / 64 units on 64-lane waves
    assert op.GEMV_MAX_GATED_BLOCKS * gated == 2**32 and op.GEMV_MAX_DOWN_UNITS * 64 == 2**32 and down == 256
    assert op.gemv_fits(4, 8, 7168, 2**19 - 1) and not op.gemv_fits(4, 8, 7168, 2**19)
    assert op.gemv_fits(32, 1, 2**21 - 1, 256) and not op.gemv_fits(32, 1, 2**21, 256)
    assert op.choose_variant(1, 8, torch.bfloat16, 8, 256, 7168, 256) == "gemv"
    assert op.choose_variant(1, 8, torch.bfloat16, 8, 256, 7168, 2**21) != "gemv"
    x, w = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(4, 8)
    w1 = torch.empty(64, 2**20, 8, dtype=torch.bfloat16, device="meta")  # shapes only: checked before any launch
    w2 = torch.empty(64, 8, 2**19, dtype=torch.bfloat16, device="meta")
    ids = torch.zeros(4, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"inter_dim 524288, model_dim 8"):
        hipkern.fused_moe(x, w1, w2, w, ids, variant="gemv")


def test_sizes_the_kernels_index_in_int32_are_checked_before_any_launch():
    """model_dim and w1's 2 x inter_dim rows must be below 2^31 (past it, ctypes wrapped them negative, and
    an up row's index wrapped in the gated GEMM's int32 row arithmetic); "decode", whose launcher counts
    DECODE_MAX_PAIRS m-blocks whatever the call, is neither chosen nor taken where their work items pass
    int32 (the default fell on it, and its launcher refused)."""
    import importlib

    op = importlib.import_module("hipkern.ops.fused_moe")
    x, w, ids = torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(1, 1), torch.zeros(1, 1, dtype=torch.int32)
    big = 2**30 + 2**20  # inter_dim: 2 x inter_dim rows past 2^31
    w1 = torch.empty(1, 2 * big, 8, dtype=torch.bfloat16, device="meta")  # shapes only
    w2 = torch.empty(1, 8, big, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match=r"2 x inter_dim rows \(2149580800\) must be below 2\^31"):
        hipkern.fused_moe(x, w1, w2, w, ids)
    inter = 2**28  # fits int32, but 32 m-blocks x inter_dim / 8 columns reach 2^30
    assert not op.decode_fits(1, 1, 8, 8, inter) and op.decode_fits(1, 1, 8, 8, 2**28 - 8)
    assert op.choose_variant(1, 1, torch.bfloat16, 8, None, 8, inter) == "grouped"
    assert op.choose_variant(1, 1, torch.bfloat16, 8, None, 8, 256) == "decode"
    w1 = torch.empty(1, 2 * inter, 8, dtype=torch.bfloat16, device="meta")
    w2 = torch.empty(1, 8, inter, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="variant='decode' takes at most 32 routed pairs .* inter_dim 268435456"):
        hipkern.fused_moe(x, w1, w2, w, ids, variant="decode")


@pytest.mark.gpu
def test_direct_op_calls_are_validated_before_any_launch():
    x = make_tokens(4, 64, torch.bfloat16)
    w1, w2 = make_weights(8, 64, 16, torch.bfloat16)
    w, ids = routing_weights(4, 2), uniform_ids(4, 2, 8)
    with pytest.raises(ValueError, match="w2"):
        torch.ops.hipkern.fused_moe(x, w1, w2[:, :32], w, ids, "silu", None, 0, "")
    with pytest.raises(ValueError, match="topk_ids"):
        torch.ops.hipkern.fused_moe(x, w1, w2, w, ids.long(), "silu", None, 0, "")
    out = torch.full((1, 64), 7.0, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="out"):
        torch.ops.hipkern.fused_moe_out(x, w1, w2, w, ids, "silu", None, 0, "", out)
    torch.cuda.synchronize()
    assert bool((out == 7.0).all())
