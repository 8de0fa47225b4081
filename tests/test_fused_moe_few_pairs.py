"""fused_moe's few-pair variants: decode (one launch), gemv (CUDA cores) and gemv_mma (each expert's pairs on
matrix cores), against the float64 reference, under graph capture, at large shapes."""
import pytest
import torch

import hipkern
from hipkern.testing import checkAllclose, poison

from moe_cases import (
    DTYPES, LARGE, ODD, SMALL, TOL, _gen, again, gemv_variants, half_remote, make_case, make_tokens, make_weights,
    reference, routing_weights, run_and_check, uniform_ids)


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
