"""fused_moe against a float64 per-expert torch loop (fused_moe_ref), over expert counts, top-k, token
counts, sizes that are not multiples of the tiles, every block_m, both activations, skewed and
expert-parallel routing, ids outside the experts, out in place; graphs, determinism, torch.compile and
float32 accuracy. Split K, tensor maps and in-block routing: test_fused_moe_splits.py; the few-pair
variants: test_fused_moe_few_pairs.py; argument checks and the reference: test_fused_moe_args.py."""
import math
import sys

import pytest
import torch

import hipkern
from hipkern.ops.fused_moe import BLOCK_MS as OP_BLOCK_MS
from hipkern.testing import checkAllclose, poison, poison_free_memory, poison_next_alloc

from conftest import sm90_build
from moe_cases import (
    BLOCK_MS, DTYPES, LARGE, ODD, SMALL, TOL, _gen, again, force_moe_sorting, gemv_variants,
    graph_replay_with_new_routing, half_remote, make_case, make_tokens, make_weights, reference, route_pairs_here,
    routing_weights, run_and_check, uniform_ids)


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
# (variant, tokens, block_m): every kernel path; grouped also at block_m 16 and 128, whose weights are tensor-map
# boxes on sm_90 (an expert coordinate past w1 / w2's experts must read as zeros there, not past them)
EVERY_PATH = [("gemv", 2, None), ("gemv_mma", 3, None), ("decode", 4, None), ("grouped", 40, None), ("grouped", 40, 16),
              ("grouped", 40, 128), ("grouped", 300, None), ("grouped", 300, 128)]


def nan_padded(w1, w2, extra):
    """Views of w1 and w2 at the start of buffers with `extra` more experts of NaN: a read past the
    experts spreads NaN into the output."""
    e, two_i, d = w1.shape
    buf1 = torch.full((e + extra, two_i, d), math.nan, dtype=w1.dtype, device=w1.device)
    buf2 = torch.full((e + extra, *w2.shape[1:]), math.nan, dtype=w2.dtype, device=w2.device)
    buf1[:e], buf2[:e] = w1, w2
    return buf1[:e], buf2[:e]


@pytest.mark.gpu
@pytest.mark.parametrize("variant,t,block_m", EVERY_PATH)
def test_expert_map_past_the_local_experts_never_reads_past_w1_w2(variant, t, block_m):
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
    hipkern.fused_moe(x, w1v, w2v, w, ids, expert_map=emap, variant=variant, block_m=block_m, out=out)
    ref = reference(x, w1, w2, w, ids, expert_map=ref_map)
    assert checkAllclose(out, ref, msg=f"{variant} T={t} block_m={block_m} ", **TOL[dtype]) == 0
    assert (out[0] == 0).all()
    with pytest.raises(ValueError, match="expert_map values"):
        hipkern.fused_moe(x, w1v, w2v, w, ids, expert_map=emap, variant=variant, block_m=block_m, validate=True)


@pytest.mark.gpu
@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("variant,t,block_m", EVERY_PATH)
def test_ids_outside_the_experts_are_dropped_as_the_reference_drops_them(variant, t, block_m, mapped):
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
    hipkern.fused_moe(x, w1v, w2v, w, ids, expert_map=emap, variant=variant, block_m=block_m, out=out)
    ref = reference(x, w1, w2, w, ids, expert_map=emap)
    assert checkAllclose(out, ref, msg=f"{variant} T={t} block_m={block_m} map={mapped} ", **TOL[dtype]) == 0
    assert (out[0] == 0).all()
    inside = torch.where((ids >= 0) & (ids < e), ids, 0)  # the same call with the outside pairs' weight 0
    kept_w = torch.where((ids >= 0) & (ids < e), w, 0)
    assert checkAllclose(out, reference(x, w1, w2, kept_w, inside, expert_map=emap), **TOL[dtype]) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("variant,t,block_m", EVERY_PATH)
def test_out_in_place_or_apart_from_the_inputs(variant, t, block_m):
    """out may be hidden_states itself (every variant reads all of it before writing out); an out that
    shares memory with any other input, or only part of hidden_states, is refused before the launch (its
    blocks would write what others still read)."""
    e, k, dtype, d, i = 16, 4, torch.bfloat16, ODD["d"], ODD["i"]
    x, w1, w2, w, ids = make_case(t, d, i, e, k, dtype, seed=t)
    emap = torch.randperm(e, generator=_gen(t), device="cuda").to(torch.int32)
    ref = reference(x, w1, w2, w, ids, expert_map=emap)
    opts = dict(expert_map=emap, variant=variant, block_m=block_m)
    inplace = x.clone()
    assert hipkern.fused_moe(inplace, w1, w2, w, ids, **opts, out=inplace) is inplace
    assert checkAllclose(inplace, ref, msg=f"{variant} block_m={block_m} in place ", **TOL[dtype]) == 0
    big = torch.randn(2 * t + 1, d, device="cuda").to(dtype)
    xs = big[:t]
    with pytest.raises(ValueError, match="out must not overlap hidden_states"):
        hipkern.fused_moe(xs, w1, w2, w, ids, **opts, out=big[1:t + 1])
    with pytest.raises(ValueError, match="out must not overlap w2"):
        hipkern.fused_moe(x, w1, w2, w, ids, **opts, out=w2.view(-1)[: t * d].view(t, d))
    raw = torch.zeros(t * d * 2 + 64, dtype=torch.uint8, device="cuda")  # out's bytes, ids and map inside them
    ids_in = raw[:ids.numel() * 4].view(torch.int32).view(ids.shape)
    ids_in.copy_(ids)
    emap_in = raw[256:256 + e * 4].view(torch.int32)
    emap_in.copy_(emap)
    out = raw[: t * d * 2].view(dtype).view(t, d)
    for args, kw, name in (((ids_in,), {"expert_map": emap}, "topk_ids"), ((ids,), {"expert_map": emap_in}, "expert_map")):
        with pytest.raises(ValueError, match=f"out must not overlap {name}"):
            hipkern.fused_moe(x, w1, w2, w, *args, variant=variant, block_m=block_m, out=out, **kw)


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


@pytest.mark.gpu
def test_launch_plans_are_memoised_by_what_they_depend_on(monkeypatch):
    """An eager call derives its launch (the database's variant and block_m; whether the GEMMs route the pairs, the
    intermediate's size) once per shape: the same call again asks launch_choice nothing; another shape, a database
    reset or a replaced _block_route_pairs (force_moe_sorting) asks again; a module_override (a diagnostic build)
    is launched inside its block only, whenever the shape's plan was made; every output matches the reference."""
    from hipkern import tuning_db
    from hipkern.ops._common import module_for, module_override
    op = sys.modules["hipkern.ops.fused_moe"]
    asked = []
    real = op.launch_choice

    def counting(dev, num_tokens, *rest):
        asked.append(num_tokens)
        return real(dev, num_tokens, *rest)

    monkeypatch.setattr(op, "launch_choice", counting)
    monkeypatch.setattr(op, "_CHOICES", {})
    monkeypatch.setattr(op, "_PLANS", {})
    cases = {t: make_case(t, **SMALL, e=64, k=8, dtype=torch.bfloat16, seed=t) for t in (3, 20, 5)}
    variants = {3: None, 20: "grouped", 5: None}  # 20 x 8 = 160 pairs: the grouped GEMMs route them in their blocks
    for t in (3, 3, 20, 3):
        run_and_check(*cases[t], variant=variants[t])  # (each: an out= call, then the same call functional)
    assert asked == [3, 20]
    tuning_db.reset()
    run_and_check(*cases[3])
    assert asked == [3, 20, 3]
    (choice,) = [c for key, c in op._CHOICES.items() if key[2] == 20]  # (variant, block_m)
    (plan,) = [p for key, p in op._PLANS.items() if key[2] == 20]  # (routed, intermediate bytes)
    assert choice[0] == "grouped" and plan[0] == (route_pairs_here(torch.bfloat16, choice[1]) >= 160)
    force_moe_sorting(monkeypatch)  # the chain then sorts first: a plan of its own
    run_and_check(*cases[20], variant="grouped")
    assert asked == [3, 20, 3, 20]
    assert sorted(p[0] for key, p in op._PLANS.items() if key[2] == 20) == sorted([plan[0], False])

    class Counting:  # the module, its launches counted
        def __init__(self, mod):
            self.mod, self.calls = mod, 0

        def __getattr__(self, name):
            return getattr(self.mod, name)

        def hk_fused_moe(self, *args):
            self.calls += 1
            return self.mod.hk_fused_moe(*args)

    dev = torch.cuda.current_device()
    for t in (3, 5):  # 3: its plan made before the override; 5: first inside it
        bm = op._choice(dev, torch.bfloat16, t, 256, 128, 64, 8, 0, "")[1]
        spy = Counting(module_for("fused_moe", dev, dtype="bfloat16", block_m=bm))
        with module_override(spy, "fused_moe", dev, dtype="bfloat16", block_m=bm):
            run_and_check(*cases[t])
        assert spy.calls == 2  # (the out= call and the functional one)
        run_and_check(*cases[t])
        assert spy.calls == 2, "the override outlived its block"


@pytest.mark.gpu
def test_validation_is_memoised_by_what_it_reads(monkeypatch):
    """An eager call validates an argument set once (_common.validated): the same call again skips _validate, and
    a bad argument is still refused after a good call of the same shapes: a strided topk_ids, an expert_map on
    the CPU, a block_m float equal to a good int, an out of another dtype."""
    op = sys.modules["hipkern.ops.fused_moe"]
    seen = []
    real = op._validate

    def counting(*args):
        seen.append(args[7])  # block_m
        return real(*args)

    monkeypatch.setattr(op, "_validate", counting)
    monkeypatch.setattr(op, "_VALID", {})
    x, w1, w2, w, ids = make_case(3, **SMALL, e=64, k=8, dtype=torch.bfloat16, seed=5)
    for _ in range(2):
        run_and_check(x, w1, w2, w, ids, block_m=16)  # (each: an out= call, then the functional one)
    assert seen == [16, 16]  # the out= set and the functional set, once each
    emap = torch.arange(64, dtype=torch.int32, device=x.device)
    run_and_check(x, w1, w2, w, ids, block_m=16, expert_map=emap)
    assert len(seen) == 4
    strided = torch.stack([ids, ids], dim=2)[:, :, 0]
    bad = [(dict(topk_ids=strided), "topk_ids"), (dict(expert_map=emap.cpu()), "expert_map"),
           (dict(block_m=16.0), "block_m"), (dict(out=torch.empty(x.shape, device=x.device)), "out")]
    for change, name in bad:
        args = dict(hidden_states=x, w1=w1, w2=w2, topk_weights=w, topk_ids=ids, block_m=16, expert_map=emap,
                    out=torch.empty_like(x))
        args.update(change)
        with pytest.raises(ValueError, match=f"^{name} must "):
            hipkern.fused_moe(**args)
    assert len(seen) == 4 + len(bad) and len(op._VALID) == 4


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
    eager = set(op._counters.values())  # (addresses: hk_alloc_zeroed's, outside torch's allocator)
    assert eager, "an eager grouped / decode call keeps its counters"
    seen = []
    real = op._workspace
    monkeypatch.setattr(op, "_workspace", lambda *a: seen.append(real(*a)) or seen[-1])
    out = torch.empty_like(x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        hipkern.fused_moe(x, w1, w2, w, ids, variant=variant, out=out)
    assert seen and all(isinstance(c, torch.Tensor) and c.data_ptr() not in eager for _, c in seen)
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
        compiled(x, w1, w2, w, ids, w1l, w2l, emap)  # compiled; then the ops' outputs from poisoned blocks
        poison_next_alloc(x.device, (x.shape, x.dtype), (x.shape, x.dtype))
        a, b = compiled(x, w1, w2, w, ids, w1l, w2l, emap)
        assert checkAllclose(a / 2, reference(x, w1, w2, w, ids), **TOL[dtype]) == 0
        assert checkAllclose(b / 4, reference(x, w1l, w2l, w, ids, "gelu", emap), **TOL[dtype]) == 0


@pytest.mark.gpu
def test_validate_under_torch_compile():
    """validate=True syncs: compiled code runs its check eagerly and still refuses a map value past w1's
    experts; a full graph refuses validate=True with an error that says why."""
    w1, w2 = make_weights(16, **SMALL, dtype=torch.bfloat16)
    emap, w1l, w2l, _ = half_remote(16, w1, w2)
    x, w, ids = make_tokens(9, SMALL["d"], torch.bfloat16, 9), routing_weights(9, 4, 9), uniform_ids(9, 4, 16, 9)

    def moe(x, w, ids, emap):
        return hipkern.fused_moe(x, w1l, w2l, w, ids, expert_map=emap, validate=True) * 2

    torch._dynamo.reset()  # compiled code is cached by function: fullgraph=True below must trace afresh
    assert checkAllclose(torch.compile(moe)(x, w, ids, emap) / 2, reference(x, w1l, w2l, w, ids, expert_map=emap),
                         **TOL[torch.bfloat16]) == 0
    past = emap.clone()
    past[int(ids[0, 0])] = w1l.shape[0]
    with pytest.raises(ValueError, match=r"expert_map values .*\(w1's first dim\)"):
        torch.compile(moe)(x, w, ids, past)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="validate=True reads values on the host"):
        torch.compile(moe, fullgraph=True)(x, w, ids, emap)


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
        with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 32\) \(expert_map's length\)"):
            hipkern.fused_moe(x, w1, w2, w, wrong, expert_map=emap, validate=True)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 16\) \(w1's first dim\)"):  # no map: w1's
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
@pytest.mark.parametrize("t", [3, 40])  # (the database's gemv-family and grouped choices)
def test_torch_compile_reduce_overhead(t, monkeypatch):
    """mode="reduce-overhead": inductor warms the call up on its own stream (the op's kept counters for that stream
    made then, with the thread's allocations routed to the graph's pool: no kept counters may come from there),
    records it in a CUDA graph and replays it with new tokens and routing copied into its buffers."""
    monkeypatch.setattr(sys.modules["hipkern.ops.fused_moe"], "_counters", {})  # (none kept for a reused stream)
    dtype, e, k = torch.bfloat16, 64, 8

    def moe(x, w1, w2, w, ids):
        return hipkern.fused_moe(x, w1, w2, w, ids) + 0

    compiled = torch.compile(moe, mode="reduce-overhead", fullgraph=True)
    w1, w2 = make_weights(e, **SMALL, dtype=dtype)
    for step in range(4):  # warm-up, record, then replays
        x, w, ids = make_tokens(t, SMALL["d"], dtype, step), routing_weights(t, k, step), uniform_ids(t, k, e, step)
        out = compiled(x, w1, w2, w, ids).clone()  # (a replay's output is the graph's buffer: taken before the next)
        assert checkAllclose(out, reference(x, w1, w2, w, ids), msg=f"step {step} ", **TOL[dtype]) == 0


@pytest.mark.gpu
def test_allow_tf32_stays_close():
    """allow_tf32=True may use TF32 for fp32 inputs (10-bit mantissa): bf16's tolerance, not fp32's."""
    x, w1, w2, w, ids = make_case(129, **SMALL, e=64, k=8, dtype=torch.float32)
    poison_next_alloc(x.device, (x.shape, x.dtype))  # the op's output: an unwritten element shows
    res = hipkern.fused_moe(x, w1, w2, w, ids, allow_tf32=True)
    assert checkAllclose(res, reference(x, w1, w2, w, ids), **TOL[torch.bfloat16]) == 0
