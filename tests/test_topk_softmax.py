"""topk_softmax against a float32 torch reference (softmax, then a stable descending sort)."""
import math

import pytest
import torch

import hipkern
from conftest import launch_piece_rows, poison_routing_outputs, routing_out_overlaps
from hipkern.reference import topk_softmax_ref
from hipkern.testing import checkAllclose, poison

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Weights are float32 arithmetic on both sides; only exp/sum rounding differs.
ATOL, RTOL = 1e-6, 1e-5


def _logits(t, e, dtype, device="cuda", scale=2.0):
    return (torch.randn(t, e, device=device) * scale).to(dtype)


def _run(x, k, renorm):
    out = (poison(torch.empty(x.shape[0], k, device=x.device)),
           poison(torch.empty(x.shape[0], k, device=x.device, dtype=torch.int32)))
    w, i = hipkern.topk_softmax(x, k, renorm, out=out)
    assert w is out[0] and i is out[1]
    return w, i


def _check(x, k, renorm, w, ids):
    """Weights match the reference; ids pick those weights; ids equal the reference's (both rank by the exact
    logit, ties to the lower expert)."""
    ref_w, ref_ids = topk_softmax_ref(x, k, renorm)
    assert checkAllclose(w, ref_w, rtol=RTOL, atol=ATOL, msg="weights ") == 0
    assert ids.dtype == torch.int32 and int(ids.min()) >= 0 and int(ids.max()) < x.shape[1]
    assert (ids.sort(dim=1).values.diff(dim=1) != 0).all(), "an expert chosen twice"
    probs = torch.softmax(x.float(), dim=-1)
    picked = probs.gather(1, ids.long())
    if renorm:
        picked = picked / picked.sum(dim=1, keepdim=True)
    assert checkAllclose(w, picked, rtol=RTOL, atol=ATOL, msg="weights at ids ") == 0
    torch.testing.assert_close(ids, ref_ids, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
# Every instance of the launcher's dispatch on 32-lane waves (and of the 64-lane one where the counts allow):
# 16-byte chunks at 1..32 lanes and more chunks a lane (vector path), and the scalar path (E not a multiple of
# a chunk) at 1, 2, 4 and 8 elements a lane: e.g. 4 / 20 / 32 (float32 1 / 8 lanes), 24 (16-bit 4 lanes), 65
# (float32) and 100 (16-bit: the scalar path's 4 a lane), 130 / 250 (its 8 a lane).
@pytest.mark.parametrize("e", [1, 2, 3, 4, 5, 8, 16, 20, 24, 32, 60, 64, 65, 100, 128, 130, 200, 250, 256, 257, 384,
                               511, 512])
def test_matches_reference_over_expert_counts(dtype, e):
    torch.manual_seed(e)
    for t in (1, 3, 129):
        for k in sorted({1, min(e, 2), min(e, 8), min(e, 9), min(e, 16)}):
            for renorm in (True, False):
                x = _logits(t, e, dtype)
                _check(x, k, renorm, *_run(x, k, renorm))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,e,k", [(1024, 8, 2), (16384, 64, 8), (16384, 256, 8), (4096, 512, 16),
                                   (70001, 128, 6), (2048, 160, 6)])
def test_matches_reference_large(dtype, t, e, k):
    torch.manual_seed(t + e)
    x = _logits(t, e, dtype)
    _check(x, k, True, *_run(x, k, True))
    poison_routing_outputs(x.device, t, k)  # not the last call's buffers
    w, ids = hipkern.topk_softmax(x, k, False)  # the functional form, outputs from the allocator
    _check(x, k, False, w, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,e,k", [(torch.bfloat16, 256, 8), (torch.float16, 257, 9), (torch.bfloat16, 8, 2),
                                     (torch.float32, 256, 8)])
def test_more_row_blocks_than_one_grid(dtype, e, k):
    """Past 2^16 blocks of rows (8 rows a block at E 256, 8 or 4 at E 257, 256 at E 8) the grid is launched in
    pieces of 2^16 blocks, each over its own rows (pointers offset on the host) (hipkern/launch.h kMaxLaunchBlocks; before, HIP refused a
    grid of 2^32 threads). Two pieces of 32-lane rows and 5 rows more: every row a valid choice, sampled rows
    of every piece and both sides of each piece's start against the reference."""
    per_block, _ = launch_piece_rows(e, dtype, 1)
    t = 2 * 65536 * (256 if e <= 8 else 8) + 5
    torch.manual_seed(e)
    x = _logits(t, e, dtype)
    w, ids = _run(x, k, True)
    assert int(ids.min()) >= 0 and int(ids.max()) < e and torch.isfinite(w).all()  # every row written
    assert (ids.sort(dim=1).values.diff(dim=1) != 0).all()
    _, rows = launch_piece_rows(e, dtype, t, every=7)
    assert t > 65536 * per_block  # (past one grid on this GPU)
    _check(x[rows], k, True, w[rows], ids[rows])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("e", [8, 64, 257, 512])
def test_ties_rank_lower_expert_first(dtype, e):
    torch.manual_seed(7)
    x = torch.randint(0, 3, (257, e), device="cuda").to(dtype)  # many exact ties
    x[5] = 1.0  # a row of all-equal logits
    k = min(e, 16)
    w, ids = _run(x, k, True)
    ref_w, ref_ids = topk_softmax_ref(x, k, True)
    assert torch.equal(ids, ref_ids)
    assert torch.equal(ids[5].cpu(), torch.arange(k, dtype=torch.int32))
    assert checkAllclose(w, ref_w, rtol=RTOL, atol=ATOL) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_signed_zeros_tie(dtype):
    x = torch.tensor([[-0.0, 0.0, -0.0, -1.0, 0.0]] * 3, device="cuda").to(dtype)
    w, ids = _run(x, 4, True)
    assert ids.tolist() == [[0, 1, 2, 4]] * 3
    assert checkAllclose(w, torch.full((3, 4), 0.25, device="cuda")) == 0


@pytest.mark.gpu
def test_minus_infinity_logits_are_selectable():
    x = torch.full((4, 64), -math.inf, device="cuda")
    x[:, 10] = 0.0
    x[:, 3] = -1.0
    w, ids = _run(x, 4, False)
    assert ids[:, :2].tolist() == [[10, 3]] * 4
    assert torch.equal(ids[:, 2:], torch.tensor([[0, 1]] * 4, dtype=torch.int32, device="cuda"))
    right = torch.tensor([1.0, math.exp(-1.0)]) / (1 + math.exp(-1.0))  # softmax of 0 and -1; the -inf ones 0
    assert (w[:, 2:] == 0).all() and checkAllclose(w[:, :2], right.cuda().expand(4, 2), rtol=1e-5, atol=1e-6) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("e", [64, 257])  # the vector path and the scalar path
def test_nan_logits_give_in_range_ids(dtype, e):
    """Documented: NaN logits give unspecified but in-range ids (never an index past the row, never one twice);
    the rows without NaN are unaffected."""
    torch.manual_seed(e)
    x = _logits(64, e, dtype)
    x[1, 3], x[2, :] = math.nan, math.nan
    x[3, ::2] = math.nan
    w, ids = _run(x, 8, True)
    assert int(ids.min()) >= 0 and int(ids.max()) < e
    assert (ids.sort(dim=1).values.diff(dim=1) != 0).all()
    clean = torch.ones(64, dtype=torch.bool, device="cuda")
    clean[1:4] = False
    _check(x[clean], 8, True, w[clean], ids[clean])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_unaligned_rows_take_the_scalar_path(dtype):
    torch.manual_seed(3)
    base = _logits(1, 33 * 64 + 1, dtype).view(-1)
    x = base[1:].view(33, 64)  # contiguous but 2-4 bytes off a 16-byte boundary
    assert x.data_ptr() % 16 != 0
    _check(x, 8, True, *_run(x, 8, True))


@pytest.mark.gpu
def test_zero_tokens_and_side_stream():
    w, ids = hipkern.topk_softmax(torch.empty(0, 64, device="cuda"), 8)
    assert w.shape == (0, 8) and ids.shape == (0, 8) and ids.dtype == torch.int32
    x = _logits(4096, 256, torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # the side stream's pool: its next blocks of these sizes come back poisoned
        poison_routing_outputs(x.device, 4096, 8)
        w, ids = hipkern.topk_softmax(x, 8)
    torch.cuda.current_stream().wait_stream(s)
    _check(x, 8, True, w, ids)


@pytest.mark.gpu
def test_deterministic():
    x = _logits(8192, 256, torch.float32)
    first = _run(x, 8, True)
    _check(x, 8, True, *first)
    for _ in range(5):
        again = _run(x, 8, True)  # into poisoned outputs, not a freed buffer holding the last repeat's bits
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    x = _logits(512, 128, torch.bfloat16)
    out = (torch.empty(512, 8, device="cuda"), torch.empty(512, 8, device="cuda", dtype=torch.int32))
    hipkern.topk_softmax(x, 8, out=out)  # warm-up (module load) outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        hipkern.topk_softmax(x, 8, out=out)
        functional = hipkern.topk_softmax(x, 8, False)
    for seed in range(3):
        torch.manual_seed(seed)
        x.copy_(_logits(512, 128, torch.bfloat16))
        poison(out[0]), poison(out[1]), poison(functional[0]), poison(functional[1])
        g.replay()
        torch.cuda.synchronize()
        _check(x, 8, True, *out)
        _check(x, 8, False, *functional)


@pytest.mark.gpu
def test_torch_compile():
    def route(logits):
        w, ids = hipkern.topk_softmax(logits, 4)
        return w * 2, ids

    compiled = torch.compile(route, fullgraph=True)
    for t in (16, 33):
        x = _logits(t, 32, torch.float16)
        compiled(x)  # compiled; then the op's outputs from poisoned blocks
        poison_routing_outputs(x.device, t, 4)
        w, ids = compiled(x)
        _check(x, 4, True, w / 2, ids)


# ---------------------------------------------------------------- argument validation (any device)
def _cpu(t=4, e=8, dtype=torch.float32):
    return torch.randn(t, e, dtype=dtype)


@pytest.mark.parametrize("args,kwargs,match", [
    ((_cpu(), 9), {}, r"topk must be in \[1, 8\]"),
    ((_cpu(), 0), {}, r"topk must be in \[1, 8\]"),
    ((_cpu(4, 64), 17), {}, r"topk must be in \[1, 16\]"),
    ((_cpu(), 2.0), {}, "topk must be an int"),
    ((_cpu(), True), {}, "topk must be an int"),
    ((_cpu(), 2, 1), {}, "renormalize must be a bool"),
    ((_cpu(4, 600), 2), {}, "gating_logits must have 1..512 experts"),
    ((_cpu(4, 0), 1), {}, "gating_logits must have 1..512 experts"),
    ((_cpu()[0], 1), {}, "gating_logits must have 2 dimensions"),
    ((_cpu().unsqueeze(0), 1), {}, "gating_logits must have 2 dimensions"),
    ((_cpu(dtype=torch.float64), 2), {}, "gating_logits must be one of float32, float16, bfloat16"),
    ((torch.ones(4, 8, dtype=torch.int32), 2), {}, "gating_logits must be one of"),
    ((_cpu(8, 4).t(), 2), {}, "gating_logits must be contiguous"),
    (([[1.0, 2.0]], 1), {}, "gating_logits must be a torch.Tensor"),
    ((_cpu(), 2), {}, "gating_logits must be on a GPU"),
    ((_cpu(), 2), {"out": (torch.empty(4, 2),)}, "out must be a pair"),
    ((_cpu(), 2), {"out": (torch.empty(4, 3), torch.empty(4, 2, dtype=torch.int32))},
     r"out\[0\] \(weights\) must have shape \(4, 2\)"),
    ((_cpu(), 2), {"out": (torch.empty(4, 2), torch.empty(4, 2))}, r"out\[1\] \(ids\) must be one of int32"),
])
def test_bad_arguments_raise_value_error(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        hipkern.topk_softmax(*args, **kwargs)


@pytest.mark.gpu
def test_outputs_on_another_device_are_rejected():
    x = _logits(4, 8, torch.float32)
    with pytest.raises(ValueError, match=r"out\[0\] \(weights\) must be on cuda:0"):
        hipkern.topk_softmax(x, 2, out=(torch.empty(4, 2), torch.empty(4, 2, dtype=torch.int32)))


def test_reference_breaks_ties_by_lower_index():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    w, ids = topk_softmax_ref(x, 3, True)
    assert ids.tolist() == [[1, 2, 4]]
    assert torch.allclose(w, torch.full((1, 3), 1 / 3))


def test_reference_ranks_by_logit_where_probabilities_round_equal():
    """As the op documents: distinct logits whose float32 probabilities are equal (all three underflow to 0)
    keep their logits' order, not their indices'."""
    w, ids = topk_softmax_ref(torch.tensor([[0.0, -200.0, -150.0, -120.0]]), 4, False)
    assert ids.tolist() == [[0, 3, 2, 1]] and w.tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_op_is_registered_for_compile_and_graphs():
    assert hasattr(torch.ops.hipkern, "topk_softmax") and hasattr(torch.ops.hipkern, "topk_softmax_out")
    schema = str(torch.ops.hipkern.topk_softmax_out.default._schema)
    assert "Tensor(a!) weights" in schema and "Tensor(b!) ids" in schema


@pytest.mark.gpu
def test_direct_op_calls_are_validated_before_any_launch():
    """torch.ops.hipkern.topk_softmax(_out) called directly get the Python function's checks (too small out
    views had been written past their ends)."""
    x = torch.randn(1000, 64, device="cuda")
    w = torch.full((1, 4), 7.0, device="cuda")
    ids = torch.full((1, 4), 7, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=r"out\[0\] \(weights\) must have shape \(1000, 4\)"):
        torch.ops.hipkern.topk_softmax_out(x, 4, True, w, ids)
    with pytest.raises(ValueError, match="gating_logits must be contiguous"):
        torch.ops.hipkern.topk_softmax(torch.randn(64, 1000, device="cuda").t(), 4, True)
    with pytest.raises(ValueError, match="topk must be in"):
        torch.ops.hipkern.topk_softmax(x, 65, True)
    torch.cuda.synchronize()
    assert bool((w == 7.0).all() and (ids == 7).all())


@pytest.mark.gpu
def test_out_overlapping_the_logits_or_each_other_is_rejected():
    x = torch.randn(64, 8, device="cuda")
    for out, match in routing_out_overlaps(x):
        with pytest.raises(ValueError, match=match):
            hipkern.topk_softmax(x, 8, out=out)
        with pytest.raises(ValueError, match=match):
            torch.ops.hipkern.topk_softmax_out(x, 8, True, *out)
