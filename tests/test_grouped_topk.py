"""grouped_topk against a float64 torch reference (DeepSeek-V3 routing, stable tie rules)."""
import pytest
import torch

import hipkern
from conftest import launch_piece_rows, poison_routing_outputs, routing_out_overlaps
from hipkern.reference import grouped_topk_ref, grouped_topk_scores_ref
from hipkern.testing import checkAllclose, poison

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
RTOL, ATOL = 1e-5, 1e-6  # float32 kernel vs float64 reference
# (E, groups, kept groups): DeepSeek-V3 (256/8/4), V2 (160/8/3), Kimi-K2-like (384/1/1), one expert
# per group, groups of non-power-of-two size or count, every group kept (no group stage), the limits. And
# the launcher's instances with the group stage: float32 rows of 4 and 8 chunks (16, 32), 16-bit rows of 2
# (16); the scalar path (E not a multiple of a 16-byte chunk) at 1, 2, 4 and 8 elements a lane (6 for every
# dtype, 20, 36 and 100 for 16-bit types, 33 and 65 for float32, 130 for float32 and 16-bit), with groups
# narrower than their lanes (6: groups of 3); float32's one-lane vector rows (4); one kept group of several; 64
# groups of one expert.
CONFIGS = [(8, 1, 1), (8, 4, 2), (8, 8, 3), (64, 8, 3), (64, 1, 1), (96, 3, 2), (160, 8, 3), (256, 8, 4),
           (256, 8, 8), (256, 64, 5), (257, 1, 1), (384, 1, 1), (512, 16, 16), (512, 64, 8),
           (6, 2, 1), (16, 4, 2), (20, 4, 1), (32, 4, 2), (36, 4, 3), (64, 64, 8), (100, 4, 2), (130, 2, 1),
           (4, 2, 1), (33, 3, 2), (65, 5, 2)]


def _logits(t, e, dtype, scale=2.0):
    return (torch.randn(t, e, device="cuda") * scale).to(dtype)


def _bias(e):
    return torch.randn(e, device="cuda") * 0.3


def _run(x, bias, k, g, tg, **kw):
    out = (poison(torch.empty(x.shape[0], k, device=x.device)),
           poison(torch.empty(x.shape[0], k, device=x.device, dtype=torch.int32)))
    w, ids = hipkern.grouped_topk(x, bias, k, g, tg, out=out, **kw)
    assert w is out[0] and ids is out[1]
    return w, ids


def _near(sorted_desc, width):
    """Rows whose first `width` + 1 sorted values hold two distinct values within float32 noise."""
    top = sorted_desc[:, : width + 1]
    gaps = -top.diff(dim=1)
    return ((gaps > 0) & (gaps < 1e-6 + 1e-5 * top[:, 1:].abs())).any(dim=1)


def _check(x, bias, k, g, tg, w, ids, scoring="sigmoid", renormalize=True, scale=1.0, group_scoring="top2"):
    """Weights are the scores at the returned ids; ids equal the float64 reference's wherever the
    group boundary and the top k+1 selection scores have no near-tie (distinct but within float32
    noise); exact ties follow the tie rule on both sides and must agree."""
    t, e = x.shape
    s, b, gs = grouped_topk_scores_ref(x, bias, g, scoring, group_scoring=group_scoring)
    ref_w, ref_ids = grouped_topk_ref(x, bias, k, g, tg, scoring, renormalize, scale, group_scoring=group_scoring)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    if t == 0:
        return
    assert int(ids.min()) >= 0 and int(ids.max()) < e
    assert (ids.sort(dim=1).values.diff(dim=1) != 0).all(), "an expert chosen twice"
    picked = s.gather(1, ids.long())
    if renormalize:
        picked = picked / picked.sum(dim=1, keepdim=True)
    assert checkAllclose(w, (picked * scale).float(), rtol=RTOL, atol=ATOL, msg="weights at ids ") == 0
    near = torch.zeros(t, dtype=torch.bool, device=x.device)
    if tg < g:
        near |= _near(gs.sort(dim=1, descending=True).values[:, tg - 1:], 1)
    kept_groups = torch.zeros(t, g, dtype=torch.bool, device=x.device)
    kept_groups.scatter_(1, gs.sort(dim=1, descending=True, stable=True).indices[:, :tg], True)
    masked = b.masked_fill(~kept_groups.repeat_interleave(e // g, dim=1), float("-inf"))
    near |= _near(masked.sort(dim=1, descending=True).values, min(k, tg * (e // g) - 1))
    # sigmoid scores of E >= 257 experts crowd the top k+1 within float32 noise in up to ~8 % of rows
    assert int(near.sum()) <= max(2, 0.15 * t), f"{int(near.sum())} of {t} rows with near-ties"
    exact = ~near
    torch.testing.assert_close(ids[exact], ref_ids[exact], rtol=0, atol=0)
    assert checkAllclose(w[exact], ref_w[exact], rtol=RTOL, atol=ATOL) == 0
    if near.any():
        _check_near_rows(b[near], gs[near], ids[near].long(), k, g, tg)


def _noise(v):
    return 1e-6 + 1e-5 * v.abs()


def _check_near_rows(b, gs, ids, k, g, tg):
    """Rows with a near-tie: the ids need not be the reference's, but they must be a top-k that float32
    noise allows. Every valid choice keeps the groups clearly above the first dropped one ("must") and
    only groups within noise of the last kept one ("may"); so each id lies in a "may" group, its score
    is within noise of the k-th best over the "must" groups or above it, and every expert of a "must"
    group clearly above the k-th best over the "may" groups is chosen. The kept groups hold the ids'
    groups, so these are at most tg, and no expert of them left out is clearly above a chosen one; the
    ids come in decreasing score, ties within noise either way."""
    e = b.shape[1]
    ordered = gs.sort(dim=1, descending=True).values
    last_kept = ordered[:, tg - 1:tg]
    may = gs >= last_kept - _noise(last_kept)
    if tg < g:
        first_dropped = ordered[:, tg:tg + 1]
        must = gs > first_dropped + _noise(first_dropped)
    else:
        must = torch.ones_like(may)
    per_expert = lambda groups: groups.repeat_interleave(e // g, dim=1)  # noqa: E731
    assert per_expert(may).gather(1, ids).all(), "an id outside every group a valid choice could keep"
    kth = lambda groups: b.masked_fill(~per_expert(groups), float("-inf")).topk(k, dim=1).values[:, -1:]  # noqa: E731
    low, high = kth(must), kth(may)
    picked = b.gather(1, ids)
    assert (picked >= low - _noise(low).nan_to_num(posinf=0.0)).all(), "an id clearly under the k-th score"
    clearly_in = per_expert(must) & (b > high + _noise(high))
    chosen = torch.zeros_like(clearly_in).scatter_(1, ids, True)
    assert (chosen | ~clearly_in).all(), "an expert clearly inside the top k was left out"
    ids_groups = torch.zeros_like(may).scatter_(1, ids // (e // g), True)
    assert (ids_groups.sum(dim=1) <= tg).all(), "ids from more groups than topk_group"
    lowest = picked.min(dim=1, keepdim=True).values
    passed_over = per_expert(ids_groups) & ~chosen & (b > lowest + _noise(lowest).nan_to_num(posinf=0.0))
    assert not passed_over.any(), "an expert of a chosen group clearly above a chosen one was left out"
    assert (picked[:, 1:] <= picked[:, :-1] + _noise(picked[:, :-1]).nan_to_num(posinf=0.0)).all(), \
        "ids not in decreasing score"


def _topks(e, g, tg):  # 12 and 16: several slots a lane on random data (not only on all-ties rows); and
    # every expert of the kept groups where that is at most 16
    return sorted({k for k in (1, 2, 8, 9, 12, 16, tg * (e // g)) if k <= min(16, tg * (e // g))})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
@pytest.mark.parametrize("e,g,tg", CONFIGS)
@pytest.mark.parametrize("group_scoring", ["top2", "max"])
def test_matches_reference(dtype, scoring, e, g, tg, group_scoring):
    torch.manual_seed(e * 131 + g * 7 + tg)
    for t in (1, 3, 129):
        for k in _topks(e, g, tg):
            for bias in (None, _bias(e)):
                renorm, scale = (True, 1.0) if k % 2 else (False, 2.5)
                x = _logits(t, e, dtype)
                w, ids = _run(x, bias, k, g, tg, scoring=scoring, renormalize=renorm, routed_scaling_factor=scale,
                              group_scoring=group_scoring)
                _check(x, bias, k, g, tg, w, ids, scoring, renorm, scale, group_scoring)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [2048, 70001])
def test_deepseek_v3_shape_many_tokens(dtype, t):
    torch.manual_seed(t)
    x, bias = _logits(t, 256, dtype), _bias(256)
    w, ids = _run(x, bias, 8, 8, 4, routed_scaling_factor=2.5)
    _check(x, bias, 8, 8, 4, w, ids, scale=2.5)
    # The bias changes the choice for many tokens (it is used), but never the weights' source.
    poison_routing_outputs(x.device, t, 8)  # outputs from the allocator
    w0, ids0 = hipkern.grouped_topk(x, None, 8, 8, 4, routed_scaling_factor=2.5)
    assert (ids0 != ids).any(dim=1).float().mean() > 0.5
    _check(x, None, 8, 8, 4, w0, ids0, scale=2.5)


@pytest.mark.gpu
@pytest.mark.parametrize("e,g,tg,k", [(256, 8, 4, 8), (8, 4, 2, 2)])
def test_more_row_blocks_than_one_grid(e, g, tg, k):
    """Past 2^16 blocks of rows (256 / lanes-a-row rows each: 8 at E 256, 256 at E 8) the grid is launched in
    pieces of 2^16 blocks, each over its own rows (pointers offset on the host) (hipkern/launch.h kMaxLaunchBlocks; before, HIP refused
    a grid of 2^32 threads). Two full pieces and a third of 3 rows (DeepSeek-V3's shape: 1,048,579 tokens):
    rows from every piece and both sides of each piece's start against the reference, every row a valid
    choice."""
    per_block, _ = launch_piece_rows(e, torch.bfloat16, 1)
    t = 2 * 65536 * per_block + 3
    torch.manual_seed(e)
    x, bias = _logits(t, e, torch.bfloat16), _bias(e)
    w, ids = _run(x, bias, k, g, tg)
    assert int(ids.min()) >= 0 and int(ids.max()) < e and torch.isfinite(w).all()
    assert (ids.sort(dim=1).values.diff(dim=1) != 0).all()
    _, rows = launch_piece_rows(e, torch.bfloat16, t, every=97)
    _check(x[rows], bias, k, g, tg, w[rows], ids[rows])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
@pytest.mark.parametrize("e,g,tg,k", [(256, 8, 4, 8), (64, 4, 2, 9), (512, 64, 8, 16), (257, 1, 1, 8)])
@pytest.mark.parametrize("group_scoring", ["top2", "max"])
def test_exact_ties_follow_the_index_rule(dtype, scoring, e, g, tg, k, group_scoring):
    """Equal logits and biases in multiples of 1/8: every score, sum and comparison is exact in float32
    and float64 alike, with many equal selection scores and equal group scores."""
    torch.manual_seed(11)
    x = torch.zeros(257, e, device="cuda", dtype=dtype)
    bias = torch.randint(0, 4, (e,), device="cuda").float() / 8
    w, ids = _run(x, bias, k, g, tg, scoring=scoring, group_scoring=group_scoring)
    ref_w, ref_ids = grouped_topk_ref(x, bias, k, g, tg, scoring, group_scoring=group_scoring)
    assert torch.equal(ids, ref_ids)
    assert checkAllclose(w, torch.full_like(w, 1.0 / k), rtol=RTOL, atol=ATOL) == 0
    # Integer logits without bias: ties inside and across groups, scores far apart otherwise.
    x = torch.randint(0, 3, (257, e), device="cuda").to(dtype)
    x[7] = 1.0  # a row of all-equal logits: the first groups, then the first experts, win
    w, ids = _run(x, None, k, g, tg, scoring=scoring, group_scoring=group_scoring)
    ref_w, ref_ids = grouped_topk_ref(x, None, k, g, tg, scoring, group_scoring=group_scoring)
    assert torch.equal(ids, ref_ids)
    assert torch.equal(ids[7].cpu(), torch.arange(k, dtype=torch.int32))
    assert checkAllclose(w, ref_w, rtol=RTOL, atol=ATOL) == 0


@pytest.mark.gpu
def test_group_ties_keep_the_lower_group():
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0, 2.0, 2.0, 0.0, 0.0, 2.0, 2.0, 0.0, 0.0, 2.0, 2.0, 0.0, 0.0]],
                     device="cuda").repeat(5, 1)
    w, ids = _run(x, None, 4, 4, 2)  # groups 1, 2, 3 tie: 1 and 2 are kept
    assert ids.tolist() == [[4, 5, 8, 9]] * 5
    assert checkAllclose(w, torch.full_like(w, 0.25)) == 0
    x[:, 4] = 2.5  # group 1 leads; by their maxima groups 2 and 3 tie (2 kept), by top-2 sums as well
    for group_scoring in ("top2", "max"):
        w, ids = _run(x, None, 3, 4, 2, group_scoring=group_scoring)
        assert ids.tolist() == [[4, 5, 8]] * 5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("e,g,tg", [(256, 8, 4), (130, 2, 1)])  # the vector path and the scalar path
def test_nan_and_minus_infinity_logits(dtype, e, g, tg):
    """Documented: NaN logits give unspecified but in-range ids; with renormalize, a token whose chosen scores
    are all 0 (sigmoid of -inf logits) gets NaN weights. -inf logits score 0 and are ranked by their bias alone
    (so with a bias they may come before finite ones), as the reference ranks them; without one, after every
    finite logit. Rows without NaN match the reference."""
    import math

    torch.manual_seed(e)
    for bias in (None, _bias(e)):
        x = _logits(64, e, dtype)
        x[1, 3], x[2, :] = math.nan, math.nan
        x[3, ::2] = math.nan
        x[4, :] = -math.inf  # every score 0: weights 0 / 0
        x[5, :] = -math.inf
        x[5, 7], x[5, 9] = 1.0, -1.0  # two finite logits, in one group (group size >= 16 here)
        w, ids = _run(x, bias, 8, g, tg)
        assert int(ids.min()) >= 0 and int(ids.max()) < e and (ids.sort(dim=1).values.diff(dim=1) != 0).all()
        ref_w, ref_ids = grouped_topk_ref(x[4:6], bias, 8, g, tg)
        assert torch.equal(ids[4:6], ref_ids) and w[4].isnan().all() and ref_w[0].isnan().all()
        w7 = torch.full((64, 8), 7.0, device="cuda")  # a finite poison: NaN is row 4's right value, written
        hipkern.grouped_topk(x, bias, 8, g, tg, out=(w7, poison(torch.empty(64, 8, dtype=torch.int32, device="cuda"))))
        assert w7[4].isnan().all() and torch.equal(w7[5], w[5])
        assert checkAllclose(w[5], ref_w[1].float(), rtol=RTOL, atol=ATOL) == 0 and torch.isfinite(w[5]).all()
        if bias is None:
            assert ids[5, :2].tolist() == [7, 9] and (w[5, 2:] == 0).all()
        clean = torch.ones(64, dtype=torch.bool, device="cuda")
        clean[1:4] = False
        clean[4:6] = False
        _check(x[clean], bias, 8, g, tg, w[clean], ids[clean])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_unaligned_logits_and_bias_take_the_scalar_path(dtype):
    torch.manual_seed(3)
    x = _logits(1, 33 * 256 + 1, dtype).view(-1)[1:].view(33, 256)
    bias = _bias(257)[1:]
    assert x.data_ptr() % 16 != 0 and bias.data_ptr() % 16 != 0
    _check(x, bias, 8, 8, 4, *_run(x, bias, 8, 8, 4))
    x = _logits(33, 256, dtype)  # aligned logits, unaligned bias
    _check(x, bias, 8, 8, 4, *_run(x, bias, 8, 8, 4))


@pytest.mark.gpu
def test_zero_tokens_and_side_stream():
    w, ids = hipkern.grouped_topk(torch.empty(0, 256, device="cuda"), _bias(256), 8, 8, 4)
    assert w.shape == (0, 8) and ids.shape == (0, 8) and ids.dtype == torch.int32
    x, bias = _logits(4096, 256, torch.bfloat16), _bias(256)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # the side stream's pool: its next blocks of these sizes come back poisoned
        poison_routing_outputs(x.device, 4096, 8)
        w, ids = hipkern.grouped_topk(x, bias, 8, 8, 4)
    torch.cuda.current_stream().wait_stream(s)
    _check(x, bias, 8, 8, 4, w, ids)


@pytest.mark.gpu
def test_deterministic():
    x, bias = _logits(8192, 256, torch.float32), _bias(256)
    first = _run(x, bias, 8, 8, 4)
    _check(x, bias, 8, 8, 4, *first)
    for _ in range(10):
        again = _run(x, bias, 8, 8, 4)  # into poisoned outputs, not a freed buffer holding the last repeat's bits
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@pytest.mark.gpu
@pytest.mark.parametrize("group_scoring", ["top2", "max"])
def test_cuda_graph_capture_and_replay(group_scoring):
    gs = dict(group_scoring=group_scoring)
    x, bias = _logits(512, 256, torch.bfloat16), _bias(256)
    out = (torch.empty(512, 8, device="cuda"), torch.empty(512, 8, device="cuda", dtype=torch.int32))
    hipkern.grouped_topk(x, bias, 8, 8, 4, out=out, **gs)  # warm-up (module load) outside the capture
    hipkern.grouped_topk(x, None, 8, 8, 4, scoring="softmax", **gs)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        hipkern.grouped_topk(x, bias, 8, 8, 4, out=out, **gs)
        functional = hipkern.grouped_topk(x, None, 8, 8, 4, scoring="softmax", renormalize=False, **gs)
    for seed in range(3):
        torch.manual_seed(seed)
        x.copy_(_logits(512, 256, torch.bfloat16))
        bias.copy_(_bias(256))
        poison(out[0]), poison(out[1]), poison(functional[0]), poison(functional[1])
        g.replay()
        torch.cuda.synchronize()
        _check(x, bias, 8, 8, 4, *out, **gs)
        _check(x, None, 8, 8, 4, *functional, scoring="softmax", renormalize=False, **gs)


@pytest.mark.gpu
@pytest.mark.parametrize("group_scoring", ["top2", "max"])
def test_torch_compile(group_scoring):
    def route(logits, bias):
        w, ids = hipkern.grouped_topk(logits, bias, 4, 4, 2, routed_scaling_factor=2.0, group_scoring=group_scoring)
        return w * 2, ids

    compiled = torch.compile(route, fullgraph=True)
    bias = _bias(32)
    for t in (16, 33):
        x = _logits(t, 32, torch.float16)
        compiled(x, bias)  # compiled; then the op's outputs from poisoned blocks
        poison_routing_outputs(x.device, t, 4)
        w, ids = compiled(x, bias)
        _check(x, bias, 4, 4, 2, w / 2, ids, scale=2.0, group_scoring=group_scoring)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_hand_computed_case_on_the_gpu(dtype):
    """test_reference_on_a_hand_computed_case's row through the kernel: by top-2 sums groups 3 and 1 are kept
    (experts 6, 7, 2: 6 and 7 tie, the lower first), by their largest score groups 2 and 0 (experts 4, 1, 0)."""
    x = torch.tensor([[0.0, 3.0, 1.0, 1.0, 4.0, -4.0, 2.0, 2.0]], device="cuda").to(dtype)
    s = torch.sigmoid(x.double())[0]
    for group_scoring, expect in (("top2", [6, 7, 2]), ("max", [4, 1, 0])):
        w, ids = _run(x, None, 3, 4, 2, group_scoring=group_scoring)
        assert ids.tolist() == [expect], group_scoring
        p = s[expect]
        assert torch.allclose(w[0].double(), p / p.sum(), rtol=1e-6, atol=0), group_scoring


@pytest.mark.gpu
def test_arguments_on_another_device_are_rejected():
    x = _logits(4, 8, torch.float32)
    with pytest.raises(ValueError, match="correction_bias must be on cuda:0"):
        hipkern.grouped_topk(x, torch.zeros(8), 2, 1, 1)
    with pytest.raises(ValueError, match=r"out\[0\] \(weights\) must be on cuda:0"):
        hipkern.grouped_topk(x, None, 2, 1, 1, out=(torch.empty(4, 2), torch.empty(4, 2, dtype=torch.int32)))


# ---------------------------------------------------------------- argument validation (any device)
def _cpu(t=4, e=16, dtype=torch.float32):
    return torch.randn(t, e, dtype=dtype)


B16 = torch.zeros(16)


@pytest.mark.parametrize("args,kwargs,match", [
    ((_cpu(), B16, 2, 3, 1), {}, r"num_expert_group must divide the number of experts \(16\)"),
    ((_cpu(), B16, 2, 0, 1), {}, r"num_expert_group must be in \[1, 16\]"),
    ((_cpu(4, 256), None, 2, 128, 1), {}, r"num_expert_group must be in \[1, 64\]"),
    ((_cpu(), B16, 2, 4, 5), {}, r"topk_group must be in \[1, 4\]"),
    ((_cpu(), B16, 2, 4, 0), {}, r"topk_group must be in \[1, 4\]"),
    ((_cpu(), B16, 9, 4, 2), {}, r"topk must be in \[1, 8\]"),
    ((_cpu(), B16, 0, 4, 2), {}, r"topk must be in \[1, 8\]"),
    ((_cpu(4, 64), None, 17, 1, 1), {}, r"topk must be in \[1, 16\]"),
    ((_cpu(), B16, 2.0, 4, 2), {}, "topk must be an int"),
    ((_cpu(), B16, 2, 4.0, 2), {}, "num_expert_group must be an int"),
    ((_cpu(), B16, 2, 4, True), {}, "topk_group must be an int"),
    ((_cpu(), B16, 2, 4, 2), {"scoring": "relu"}, "scoring must be one of 'sigmoid', 'softmax'"),
    ((_cpu(), B16, 2, 4, 2), {"renormalize": 1}, "renormalize must be a bool"),
    ((_cpu(), B16, 2, 4, 2), {"routed_scaling_factor": float("inf")}, "routed_scaling_factor must be a float finite"),
    ((_cpu(), B16, 2, 4, 2), {"routed_scaling_factor": 1e39}, "routed_scaling_factor must be a float finite in float32"),
    ((_cpu(), B16, 2, 4, 2), {"routed_scaling_factor": 10**400}, "routed_scaling_factor must be a float finite"),
    ((_cpu(), B16, 2, 4, 2), {"routed_scaling_factor": "2"}, "routed_scaling_factor must be a float finite"),
    ((_cpu(), B16, 2, 4, 2), {"scoring": ["sigmoid"]}, "scoring must be one of 'sigmoid', 'softmax'"),
    ((_cpu(), B16, 2, 4, 2), {"group_scoring": "sum"}, "group_scoring must be one of 'top2', 'max'"),
    ((_cpu(), B16, 2, 4, 2), {"group_scoring": None}, "group_scoring must be one of 'top2', 'max'"),
    ((_cpu(4, 600), None, 2, 1, 1), {}, "gating_logits must have 1..512 experts"),
    ((_cpu(4, 0), None, 1, 1, 1), {}, "gating_logits must have 1..512 experts"),
    ((_cpu()[0], B16, 1, 1, 1), {}, "gating_logits must have 2 dimensions"),
    ((_cpu(dtype=torch.float64), B16, 2, 4, 2), {}, "gating_logits must be one of float32, float16, bfloat16"),
    ((_cpu(16, 4).t(), None, 2, 1, 1), {}, "gating_logits must be contiguous"),
    (([[1.0, 2.0]], None, 1, 1, 1), {}, "gating_logits must be a torch.Tensor"),
    ((_cpu(), torch.zeros(8), 2, 4, 2), {}, r"correction_bias must have shape \(16,\)"),
    ((_cpu(), torch.zeros(16, dtype=torch.bfloat16), 2, 4, 2), {}, "correction_bias must be one of float32"),
    ((_cpu(), torch.zeros(32)[::2], 2, 4, 2), {}, "correction_bias must be contiguous"),
    ((_cpu(), [0.0] * 16, 2, 4, 2), {}, "correction_bias must be a torch.Tensor"),
    ((_cpu(), B16, 2, 4, 2), {}, "gating_logits must be on a GPU"),
    ((_cpu(), B16, 2, 4, 2), {"out": (torch.empty(4, 2),)}, "out must be a pair"),
    ((_cpu(), B16, 2, 4, 2), {"out": (torch.empty(4, 3), torch.empty(4, 2, dtype=torch.int32))},
     r"out\[0\] \(weights\) must have shape \(4, 2\)"),
    ((_cpu(), B16, 2, 4, 2), {"out": (torch.empty(4, 2), torch.empty(4, 2))}, r"out\[1\] \(ids\) must be one of int32"),
])
def test_bad_arguments_raise_value_error(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        hipkern.grouped_topk(*args, **kwargs)


def test_reference_keeps_a_kept_group_s_masked_expert_before_dropped_groups():
    """A bias of -inf (an expert masked out) in a kept group: topk reaches it, and it still comes before every expert
    of the dropped groups (the reference masked those to -inf too, and its stable sort took the lower index, in a
    dropped group)."""
    inf = float("inf")
    x, bias = torch.zeros(1, 6), torch.tensor([-inf, -inf, -inf, 0.0, 0.0, -inf])
    w, ids = grouped_topk_ref(x, bias, 3, 2, 1)  # groups {0, 1, 2} (score -inf) and {3, 4, 5} (kept)
    assert ids.tolist() == [[3, 4, 5]] and torch.allclose(w, torch.full((1, 3), 1 / 3))


@pytest.mark.gpu
def test_masked_experts_in_kept_groups():
    """Correction biases of -inf (experts masked out) beside finite ones: the op picks within the kept groups as the
    reference does, a masked expert of a kept group before any of a dropped group."""
    inf = float("inf")
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(3)).cuda()
    bias = torch.zeros(16)
    bias[[0, 1, 2, 5, 9, 10, 11, 14, 15]] = -inf  # groups of 4: {3}, {4, 6, 7}, {8}, {12, 13} finite
    bias = bias.cuda()
    for k, tg in ((3, 1), (4, 2), (6, 2)):
        w, ids = hipkern.grouped_topk(x, bias, k, 4, tg)
        ref_w, ref_ids = grouped_topk_ref(x, bias, k, 4, tg)
        assert torch.equal(ids, ref_ids.cuda()), (k, tg)
        assert checkAllclose(w, ref_w.cuda(), rtol=RTOL, atol=ATOL) == 0


def test_reference_on_a_hand_computed_case():
    # Sigmoid scores: groups of 2 sum to g0 1.453, g1 1.462, g2 1.000, g3 1.762: g3 and g1 are kept, so
    # expert 4 (the best single score) is not chosen; 6 and 7 tie (6 first), then 2 before 3.
    x = torch.tensor([[0.0, 3.0, 1.0, 1.0, 4.0, -4.0, 2.0, 2.0]])
    s = torch.sigmoid(x.double())[0]
    w, ids = grouped_topk_ref(x, None, 3, 4, 2)
    assert ids.tolist() == [[6, 7, 2]]
    expect = torch.stack([s[6], s[7], s[2]])
    assert torch.allclose(w[0].double(), expect / expect.sum(), rtol=1e-6)
    # A bias lifts expert 3 above 6 and 7 for selection; its weight stays its unbiased score.
    bias = torch.tensor([0.0, 0.0, 0.0, 0.2, 0.0, 0.0, 0.0, 0.0])
    w, ids = grouped_topk_ref(x, bias, 3, 4, 2, renormalize=False, routed_scaling_factor=2.0)
    assert ids.tolist() == [[3, 6, 7]]
    assert torch.allclose(w[0].double(), 2.0 * torch.stack([s[3], s[6], s[7]]), rtol=1e-6)
    # Softmax scores: group sums e^0+e^3, 2e, e^4+e^-4, 2e^2 keep g2 and g0: experts 4, 1, 0.
    w, ids = grouped_topk_ref(x, None, 3, 4, 2, scoring="softmax")
    assert ids.tolist() == [[4, 1, 0]]
    p = torch.exp(x.double()[0, [4, 1, 0]])
    assert torch.allclose(w[0].double(), p / p.sum(), rtol=1e-6)
    # Groups scored by their largest score (DeepSeek-V2): g0 3.0, g1 1.0, g2 4.0, g3 2.0 keep g2 and g0
    # (where the top-2 sums kept g3 and g1): experts 4, 1, 0.
    w, ids = grouped_topk_ref(x, None, 3, 4, 2, group_scoring="max")
    assert ids.tolist() == [[4, 1, 0]]
    assert grouped_topk_scores_ref(x, None, 4, group_scoring="max")[2].tolist() == [[s[1], s[2], s[4], s[6]]]
    # One expert per group: a group scores its only expert; all groups kept equals a plain top-k.
    w, ids = grouped_topk_ref(x, None, 2, 8, 3)
    assert ids.tolist() == [[4, 1]]
    assert grouped_topk_ref(x, None, 3, 1, 1)[1].tolist() == [[4, 1, 6]]


def test_op_is_registered_for_compile_and_graphs():
    assert hasattr(torch.ops.hipkern, "grouped_topk") and hasattr(torch.ops.hipkern, "grouped_topk_out")
    schema = str(torch.ops.hipkern.grouped_topk_out.default._schema)
    assert "Tensor(a!) weights" in schema and "Tensor(b!) ids" in schema


def test_fake_impl_gives_the_output_shapes_without_a_gpu():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 256, device="cuda", dtype=torch.bfloat16)
        w, ids = torch.ops.hipkern.grouped_topk(x, torch.empty(256, device="cuda"), 8, 8, 4, "sigmoid", True, 2.5)
        assert w.shape == (5, 8) and w.dtype == torch.float32 and ids.dtype == torch.int32
        with pytest.raises(ValueError, match="num_expert_group must divide"):
            torch.ops.hipkern.grouped_topk(x, None, 8, 7, 4, "sigmoid", True, 1.0)
        w, ids = torch.ops.hipkern.grouped_topk(x, None, 8, 8, 4, "softmax", True, 1.0, "max")
        assert w.shape == (5, 8)


@pytest.mark.gpu
def test_direct_op_calls_are_validated_before_any_launch():
    """torch.ops.hipkern.grouped_topk(_out) called directly get the Python function's checks (a short bias
    had been read past its end, too small out views written past theirs)."""
    x = torch.randn(1000, 256, device="cuda")
    with pytest.raises(ValueError, match=r"correction_bias must have shape \(256,\)"):
        torch.ops.hipkern.grouped_topk(x, torch.zeros(8, device="cuda"), 8, 8, 4, "sigmoid", True, 1.0)
    w = torch.full((1, 8), 7.0, device="cuda")
    ids = torch.full((1, 8), 7, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=r"out\[0\] \(weights\) must have shape \(1000, 8\)"):
        torch.ops.hipkern.grouped_topk_out(x, None, 8, 8, 4, "sigmoid", True, 1.0, "top2", w, ids)
    with pytest.raises(ValueError, match="gating_logits must be contiguous"):
        torch.ops.hipkern.grouped_topk(torch.randn(256, 1000, device="cuda").t(), None, 8, 8, 4, "sigmoid", True, 1.0)
    with pytest.raises(ValueError, match="gating_logits must be one of"):
        torch.ops.hipkern.grouped_topk(x.double(), None, 8, 8, 4, "sigmoid", True, 1.0)
    with pytest.raises(ValueError, match="group_scoring must be one of"):
        torch.ops.hipkern.grouped_topk(x, None, 8, 8, 4, "sigmoid", True, 1.0, "mean")
    with pytest.raises(ValueError, match="group_scoring must be one of"):
        torch.ops.hipkern.grouped_topk_out(x, None, 8, 8, 4, "sigmoid", True, 1.0, "mean", w, ids)
    torch.cuda.synchronize()
    assert bool((w == 7.0).all() and (ids == 7).all())


@pytest.mark.gpu
def test_out_overlapping_the_inputs_or_each_other_is_rejected():
    x = torch.randn(64, 8, device="cuda")
    for out, match in routing_out_overlaps(x):
        with pytest.raises(ValueError, match=match):
            hipkern.grouped_topk(x, None, 8, 1, 1, out=out)
        with pytest.raises(ValueError, match=match):
            torch.ops.hipkern.grouped_topk_out(x, None, 8, 1, 1, "sigmoid", True, 1.0, "top2", *out)
    ids = torch.empty(64, 8, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=r"out\[1\] \(ids\) must not overlap correction_bias"):
        hipkern.grouped_topk(x, ids.view(torch.float32)[0], 8, 1, 1, out=(torch.empty(64, 8, device="cuda"), ids))
