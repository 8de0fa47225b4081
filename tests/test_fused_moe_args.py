"""fused_moe's argument checks (before any launch; most on the CPU), its registered op and fake impl, the
trace tool's refusals, and the float64 reference itself against a loop over pairs."""
import math
import pathlib

import pytest
import torch

import hipkern
from hipkern.reference import fused_moe_ref
from hipkern.testing import checkAllclose

from moe_cases import ARG_NAMES, DTYPES, SMALL, make_case, make_tokens, make_weights, routing_weights, uniform_ids


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
    with pytest.raises(ValueError, match=r"2 x inter_dim rows \(2149580800\) below 2\^31"):
        hipkern.fused_moe(x, w1, w2, w, ids)
    # model_dim within a k-tile of 2^31 (2^31 - 8: accepted before): the tile count (dim + 511) / 512 wrapped
    for d in (2**31 - 8, 2**30):
        xd = torch.empty(1, d, dtype=torch.bfloat16, device="meta")
        w1 = torch.empty(1, 16, d, dtype=torch.bfloat16, device="meta")
        w2 = torch.empty(1, d, 8, dtype=torch.bfloat16, device="meta")
        with pytest.raises(ValueError, match=rf"model_dim \({d}\) must be below 2\^30"):
            hipkern.fused_moe(xd, w1, w2, w, ids)
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
    with pytest.raises(ValueError, match=r"^out must have shape \(4, 64\)"):
        torch.ops.hipkern.fused_moe_out(x, w1, w2, w, ids, "silu", None, 0, "", out)
    torch.cuda.synchronize()
    assert bool((out == 7.0).all())


def test_decode_is_not_refused_by_the_grouped_gemms_work_item_bound(monkeypatch):
    """"decode" counts DECODE_MAX_PAIRS m-blocks (decode_fits checks its work items): the grouped GEMMs'
    bound (a block an expert, E of them) refused a one-token decode call over 1024 experts and a large
    model_dim, telling the caller to split tokens; the grouped refusal names the experts too."""
    import importlib

    op = importlib.import_module("hipkern.ops.fused_moe")
    monkeypatch.setattr(op.jit, "current_arch", lambda d=None: "sm_90")
    monkeypatch.setattr(op, "sm_count", lambda d: 132)
    monkeypatch.setattr(op, "gpu_name", lambda d: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(op, "_CHOICES", {})
    dim = 8380424
    assert op.decode_fits(1, 1, 8, dim, 8)
    assert op._choice(0, torch.bfloat16, 1, dim, 8, 1024, 1, 8, "decode") == ("decode", 8)
    with pytest.raises(ValueError, match="1 routed pairs over 1024 experts .* split the tokens over calls, or the "
                                         "experts"):
        op._choice(0, torch.bfloat16, 1, dim, 8, 1024, 1, 8, "grouped")



class _FakeCounterModule:
    """hk_fused_moe_workspace and hk_alloc_zeroed as a fused_moe module exports them; the first `fail` allocations
    fail (an out-of-memory outside torch's cache)."""

    def __init__(self, fail=0):
        self.fail, self.allocs = fail, []

    def hk_fused_moe_workspace(self, dev, floats, ints):
        floats._obj.value, ints._obj.value = 1000, 12
        return 0

    def hk_alloc_zeroed(self, dev, nbytes, stream, out):
        self.allocs.append((dev, nbytes, stream))
        if len(self.allocs) <= self.fail:
            return 2
        out._obj.value = 0x1000 * len(self.allocs)
        return 0

    def check(self, rc, op):
        raise RuntimeError(f"hipkern {op}: out of memory")


def test_threads_first_calls_on_one_stream_keep_one_allocation(monkeypatch):
    """Eight threads make their first eager call on one stream at once (the allocation releases the GIL, as
    ctypes does): one allocation, kept and used by all; before, each thread allocated and all but the last
    address were lost for the process."""
    import sys
    import threading
    import time

    op = sys.modules["hipkern.ops.fused_moe"]
    monkeypatch.setattr(op, "_counters", {})
    monkeypatch.setattr(op, "raw_stream", lambda dev: 0xABC)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    class SlowAlloc(_FakeCounterModule):
        def hk_alloc_zeroed(self, dev, nbytes, stream, out):
            time.sleep(0.2)  # the other threads run meanwhile
            return super().hk_alloc_zeroed(dev, nbytes, stream, out)

    mod, barrier, got = SlowAlloc(), threading.Barrier(8), []
    op._workspace(mod, 0, torch.device("cpu"))  # the sizes asked once, so that only the counters race
    op._counters.clear()
    mod.allocs.clear()

    def first_call():
        barrier.wait(timeout=10)
        got.append(op._workspace(mod, 0, torch.device("cpu"))[1])

    threads = [threading.Thread(target=first_call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(got) == 8 and len(mod.allocs) == 1, (got, mod.allocs)
    assert set(got) == {op._counters[(0, 0xABC, 12)]}


def test_kept_counters_come_from_the_runtime_once_per_device_and_stream(monkeypatch):
    """Eager calls keep their counters per (device, stream) as addresses from hk_alloc_zeroed (not torch's allocator,
    whose blocks may lie in a CUDA graph's pool); a failed allocation is tried again once after torch's cache is
    emptied, then raises; a call being captured gets a zeroed tensor of its own."""
    import sys

    op = sys.modules["hipkern.ops.fused_moe"]
    monkeypatch.setattr(op, "_counters", {})
    monkeypatch.setattr(op, "raw_stream", lambda dev: 0xABC + dev)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    mod = _FakeCounterModule(fail=1)
    assert op._workspace(mod, 0, torch.device("cpu")) == (1000, 0x2000)
    assert mod.allocs == [(0, 48, 0xABC), (0, 48, 0xABC)] and emptied == [1]
    assert op._workspace(mod, 0, torch.device("cpu")) == (1000, 0x2000) and len(mod.allocs) == 2  # kept
    assert op._workspace(mod, 1, torch.device("cpu"))[1] == 0x3000  # another device (and its stream)
    with pytest.raises(RuntimeError, match="fused_moe counters: out of memory"):
        op._workspace(_FakeCounterModule(fail=2), 2, torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    floats, counters = op._workspace(mod, 0, torch.device("cpu"))
    assert isinstance(counters, torch.Tensor) and counters.shape == (12,) and not counters.any()
    assert op._ptr(counters) == counters.data_ptr() and op._ptr(0x2000) == 0x2000 and op._ptr(None) is None
