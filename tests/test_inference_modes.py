"""The ops as serving engines call them: under torch.inference_mode() (inference tensors in and out), and with
weights that are nn.Parameters (requires_grad=True) outside no_grad. The ops are inference-only: no backward,
outputs without a gradient (README)."""
import pytest
import torch

import hipkern

from moe_cases import make_case
from moe_cases import run_and_check as moe_run_and_check
from pa_cases import make_case as make_pa_case
from pa_cases import run_and_check as pa_run_and_check
from test_topk_softmax import _check as softmax_check

pytestmark = pytest.mark.gpu


def test_ops_under_inference_mode():
    with torch.inference_mode():
        x = torch.randn(33, 64, device="cuda", dtype=torch.bfloat16)
        w, ids = hipkern.topk_softmax(x, 4)
        assert w.is_inference() and ids.is_inference()
        softmax_check(x, 4, True, w, ids)
        case = make_case(40, 256, 128, 8, 2, torch.bfloat16, seed=3)
        out = moe_run_and_check(*case, msg="inference_mode ")
        assert out.is_inference()
        o, lse = pa_run_and_check(make_pa_case([300, 2000, 1], num_kv_heads=2, group=8), msg="inference_mode ")
        assert o.is_inference() and lse.is_inference()
    # then outside it, on ordinary tensors (workspaces the op may have made inside it are reused)
    plain = [t.clone() for t in case]
    assert not plain[0].is_inference()
    assert torch.equal(moe_run_and_check(*plain, msg="after inference_mode "), out)


def test_parameters_outside_no_grad_give_outputs_without_a_gradient():
    """Weights as nn.Parameters (requires_grad) with grad mode on: the same bits as plain tensors, and the output
    carries no gradient (it has no grad_fn to mislead a backward)."""
    x, w1, w2, w, ids = make_case(40, 256, 128, 8, 2, torch.bfloat16, seed=4)
    p1, p2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
    assert torch.is_grad_enabled() and p1.requires_grad
    out = hipkern.fused_moe(x, p1, p2, w, ids)
    assert not out.requires_grad and out.grad_fn is None
    assert torch.equal(out, moe_run_and_check(x, w1, w2, w, ids))
    q, k, v, bt, cl = make_pa_case([300, 2000, 1], num_kv_heads=2, group=8)
    o = hipkern.paged_attention_decode(q.requires_grad_(), k, v, bt, cl)
    assert not o.requires_grad and o.grad_fn is None
    assert torch.equal(o, hipkern.paged_attention_decode(q.detach(), k, v, bt, cl))
