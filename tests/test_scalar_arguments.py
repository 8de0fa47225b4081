"""Integer and float arguments given as numpy scalars (what a shape read from a numpy array or a config
parsed by numpy gives): every op takes them as the Python numbers they equal, as torch.ops' schemas do,
and still refuses bools and floats where an int is asked for."""
import numpy as np
import pytest
import torch

import hipkern
from hipkern.testing import poison
from hipkern.ops._common import as_bool, as_float, as_int

from moe_cases import make_case
from pa_cases import make_case as make_pa_case
from test_fused_moe_args import _cpu_case as moe_cpu_case
from test_paged_attention_args import _call as pa_call
from test_paged_attention_args import _cpu_case as pa_cpu_case


def test_as_int_and_as_float_convert_numpy_scalars_only():
    for v in (np.int8(3), np.int32(3), np.int64(3), np.uint16(3)):
        assert type(as_int(v)) is int and as_int(v) == 3
    for v in (np.float32(0.5), np.float64(0.5), np.float16(0.5)):
        assert type(as_float(v)) is float and as_float(v) == 0.5
    assert type(as_float(np.int64(2))) is float  # an integer is a real number (scale=1 is allowed)
    assert as_float(10**400) == 10**400 and as_float(2) == 2  # Python numbers as they are, for the checks
    # left as they are, for the checks to name: bools, floats where an int is asked for, strings, None, tensors
    for v in (True, np.bool_(True), 2.0, np.float64(2.0), "2", None, torch.tensor(2)):
        assert as_int(v) is v
    for v in (True, np.bool_(True), "0.5", None, torch.tensor(0.5)):
        assert as_float(v) is v
    assert as_bool(np.bool_(False)) is False and as_bool(np.bool_(True)) is True
    for v in (1, np.int64(1), 1.0, "True", None):
        assert as_bool(v) is v


def _logits(t=4, e=16):
    return torch.randn(t, e)


# Each op called on the CPU: an in-range numpy scalar passes the scalar checks, so the call gets as far as
# the device check (done last); an out-of-range one is refused by value; a numpy bool or float is not an int.
CPU_CASES = [
    (lambda v: hipkern.topk_softmax(_logits(), v), "topk", r"gating_logits must be on a GPU",
     r"topk must be in \[1, 16\].*got 17"),
    (lambda v: hipkern.grouped_topk(_logits(), None, v, 4, 2), "topk", r"gating_logits must be on a GPU",
     r"topk must be in \[1, 8\].*got 17"),
    (lambda v: hipkern.grouped_topk(_logits(), None, 2, v, 2), "num_expert_group", r"gating_logits must be on a GPU",
     r"num_expert_group must be in \[1, 16\].*got 17"),
    (lambda v: hipkern.grouped_topk(_logits(), None, 2, 4, v), "topk_group", r"gating_logits must be on a GPU",
     r"topk_group must be in \[1, 4\].*got 17"),
    (lambda v: hipkern.moe_sorting(torch.zeros(4, 2, dtype=torch.int32), v, 16), "num_experts",
     r"topk_ids must be on a GPU", r"num_experts must be in \[1, 1024\].*got 2000"),
    (lambda v: hipkern.moe_sorting(torch.zeros(4, 2, dtype=torch.int32), 8, v), "block_m",
     r"topk_ids must be on a GPU", r"block_m must be in \[1, 1024\].*got 2000"),
]


@pytest.mark.parametrize("call,name,ok,refused", CPU_CASES, ids=lambda c: c if isinstance(c, str) else "")
@pytest.mark.parametrize("kind", [np.int32, np.int64])
def test_numpy_integers_are_taken_as_ints(call, name, ok, refused, kind):
    with pytest.raises(ValueError, match=ok):
        call(kind(4))
    big = 17 if "17" in refused else 2000
    with pytest.raises(ValueError, match=refused):
        call(kind(big))
    with pytest.raises(ValueError, match=rf"{name} must be an int, got bool"):
        call(np.bool_(True))
    with pytest.raises(ValueError, match=rf"{name} must be an int, got float"):
        call(np.float64(4.0))


BOOL_CALLS = [
    ("renormalize", lambda v: hipkern.topk_softmax(_logits(), 2, v), "gating_logits must be on a GPU"),
    ("renormalize", lambda v: hipkern.grouped_topk(_logits(), None, 2, 4, 2, renormalize=v),
     "gating_logits must be on a GPU"),
    ("validate", lambda v: hipkern.moe_sorting(torch.zeros(4, 2, dtype=torch.int32), 8, 16, validate=v),
     "topk_ids must be on a GPU"),
]


@pytest.mark.parametrize("name,call,ok", BOOL_CALLS, ids=[c[0] + str(i) for i, c in enumerate(BOOL_CALLS)])
def test_numpy_bools_are_taken_as_bools(name, call, ok):
    for v in (np.bool_(True), np.bool_(False)):
        with pytest.raises(ValueError, match=ok):
            call(v)
    with pytest.raises(ValueError, match=rf"{name} must be a bool, got int"):
        call(np.int64(1))


def test_moe_sorting_max_padded_checks_its_arguments():
    assert hipkern.moe_sorting_max_padded(np.int64(6), np.int32(4), 2) == 10 == hipkern.moe_sorting_max_padded(6, 4, 2)
    for args, match in [((8, 8, 0), r"block_m must be in \[1, 1024\], got 0"),
                        ((8.0, 8, 16), "num_pairs must be an int, got float"),
                        ((-100, 8, 16), r"num_pairs must be in \[0, 2147483647\], got -100"),
                        ((8, 0, 16), r"num_experts must be in \[1, 1024\], got 0")]:
        with pytest.raises(ValueError, match=match):
            hipkern.moe_sorting_max_padded(*args)


def test_the_ops_modules_hold_their_limits():
    """hipkern.ops.<op> is the op's module (its limits and helpers, which docstrings name), hipkern.<op> the op."""
    import hipkern.ops.fused_moe as fm
    import hipkern.ops.topk_softmax as ts
    assert fm.DECODE_MAX_PAIRS > 0 and callable(fm.choose_config) and callable(fm.gemv_fits)
    assert ts.MAX_TOPK == 16 and hipkern.ops.grouped_topk.MAX_GROUPS == 64 and hipkern.ops.moe_sorting.MAX_EXPERTS
    assert hipkern.fused_moe is fm.fused_moe and hipkern.topk_softmax is ts.topk_softmax
    assert hipkern.paged_attention_decode is hipkern.ops.paged_attention.paged_attention_decode


def test_numpy_scalars_under_torch_compile():
    """torch.compile's tracer turns numpy scalars into arrays of its own; they are still taken (CPU tensors: the
    call gets as far as the device check, the last one, as it does eagerly). Under fullgraph=True it traces them
    as tensors: refused by name, as documented (pass Python numbers there)."""
    class Router(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.topk, self.factor, self.renorm = np.int64(2), np.float32(2.5), np.bool_(True)

        def forward(self, x):
            return hipkern.grouped_topk(x, None, self.topk, 4, 2, renormalize=self.renorm,
                                        routed_scaling_factor=self.factor)

    def route(x, k):
        return hipkern.topk_softmax(x, k)

    with pytest.raises(ValueError, match="gating_logits must be on a GPU"):
        torch.compile(Router(), backend="eager")(_logits())
    with pytest.raises(ValueError, match="gating_logits must be on a GPU"):
        torch.compile(route, backend="eager")(_logits(), np.int64(2))
    torch._dynamo.reset()
    # torch 2.13: the op's ValueError ("topk must be an int, got ndarray") as dynamo passes it on; torch 2.11:
    # dynamo's own error on the numpy scalar's type name (_numpy_kind). Never a traced call.
    with pytest.raises(Exception, match=r"topk must be an int, got ndarray|GetAttrVariable\(NumpyVariable"):
        torch.compile(route, backend="eager", fullgraph=True)(_logits(), np.int64(2))


def test_fused_moe_block_m_as_a_numpy_integer():
    c = moe_cpu_case()
    with pytest.raises(ValueError, match="must be on a GPU"):
        hipkern.fused_moe(**c, block_m=np.int64(16))
    with pytest.raises(ValueError, match=r"block_m must be one of .* got 24"):
        hipkern.fused_moe(**c, block_m=np.int64(24))
    with pytest.raises(ValueError, match=r"block_m must be an int, got bool"):
        hipkern.fused_moe(**c, block_m=np.bool_(True))
    for name in ("allow_tf32", "validate"):
        with pytest.raises(ValueError, match="must be on a GPU"):
            hipkern.fused_moe(**c, **{name: np.bool_(True)})
        with pytest.raises(ValueError, match=f"{name} must be a bool, got int"):
            hipkern.fused_moe(**c, **{name: np.int64(1)})


@pytest.mark.parametrize("kind", [np.float32, np.float64])
def test_float_arguments_as_numpy_floats(kind):
    with pytest.raises(ValueError, match="gating_logits must be on a GPU"):
        hipkern.grouped_topk(_logits(), None, 2, 4, 2, routed_scaling_factor=kind(2.5))
    with pytest.raises(ValueError, match="routed_scaling_factor must be a float finite"):
        hipkern.grouped_topk(_logits(), None, 2, 4, 2, routed_scaling_factor=kind("inf"))
    with pytest.raises(ValueError, match="query must be on a GPU"):
        pa_call(pa_cpu_case(), scale=kind(0.1))
    with pytest.raises(ValueError, match="scale must be a float"):
        pa_call(pa_cpu_case(), scale=kind("nan"))
    with pytest.raises(ValueError, match="scale must be a float"):
        pa_call(pa_cpu_case(), scale=np.bool_(True))
    with pytest.raises(ValueError, match="query must be on a GPU"):
        pa_call(pa_cpu_case(), return_lse=np.bool_(True))


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_numpy_scalars_give_the_python_scalars_results():
    """Each op with numpy scalars against the same call with Python numbers: bitwise the same outputs."""
    x = torch.randn(33, 64, device="cuda", dtype=torch.bfloat16)
    for a, b in zip(hipkern.topk_softmax(x, np.int64(4)), hipkern.topk_softmax(x, 4)):
        assert torch.equal(a, b)
    for a, b in zip(hipkern.grouped_topk(x, None, np.int32(4), np.int64(8), np.int16(2),
                                         routed_scaling_factor=np.float32(2.5)),
                    hipkern.grouped_topk(x, None, 4, 8, 2, routed_scaling_factor=2.5)):
        assert torch.equal(a, b)
    ids = torch.randint(0, 64, (33, 4), device="cuda", dtype=torch.int32)
    for a, b in zip(hipkern.moe_sorting(ids, np.int64(64), np.int32(16)), hipkern.moe_sorting(ids, 64, 16)):
        assert torch.equal(a, b)
    hs, w1, w2, w, tids = make_case(5, 256, 128, 8, 2, torch.bfloat16)
    out_np = hipkern.fused_moe(hs, w1, w2, w, tids, block_m=np.int64(16), out=poison(torch.empty_like(hs)))
    assert torch.equal(out_np, hipkern.fused_moe(hs, w1, w2, w, tids, block_m=16, out=poison(torch.empty_like(hs))))
    args = make_pa_case([1, 17, 300], num_kv_heads=2, group=4)
    out_np = hipkern.paged_attention_decode(*args, scale=np.float32(0.0625), out=poison(torch.empty_like(args[0])))
    assert torch.equal(out_np, hipkern.paged_attention_decode(*args, scale=0.0625,
                                                              out=poison(torch.empty_like(args[0]))))
