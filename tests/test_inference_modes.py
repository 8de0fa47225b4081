"""The ops as serving engines call them: under torch.inference_mode() (inference tensors in and out), and with
weights that are nn.Parameters (requires_grad=True) outside no_grad. The ops are inference-only: no backward,
outputs without a gradient (README)."""
import sys

import pytest
import torch

import hipkern
from hipkern.reference import moe_sorting_ref
from hipkern.testing import poison_next_alloc

from conftest import poison_routing_outputs, poison_sorting_outputs
from moe_cases import make_case
from moe_cases import run_and_check as moe_run_and_check
from pa_cases import make_case as make_pa_case
from pa_cases import run_and_check as pa_run_and_check
from test_grouped_topk import _check as grouped_check
from test_topk_softmax import _check as softmax_check

pytestmark = pytest.mark.gpu


def _every_op(logits, bias, ids, moe_case, pa_case, tag):
    """Each op once, checked against its reference (outputs poisoned where the helpers poison them)."""
    t, dev = logits.shape[0], logits.device
    poison_routing_outputs(dev, t, 4)  # each op's outputs: unwritten shows
    w, i = hipkern.topk_softmax(logits, 4)
    softmax_check(logits, 4, True, w, i)
    poison_routing_outputs(dev, t, 4)
    gw, gi = hipkern.grouped_topk(logits, bias, 4, 8, 2)
    grouped_check(logits, bias, 4, 8, 2, gw, gi)
    poison_sorting_outputs(dev, ids.numel(), 64, 16)
    for got, want in zip(hipkern.moe_sorting(ids, 64, 16), moe_sorting_ref(ids, 64, 16)):
        assert torch.equal(got, want), f"{tag} moe_sorting"
    out = moe_run_and_check(*moe_case, msg=tag)
    o, lse = pa_run_and_check(pa_case, msg=tag)
    return (w, i, gw, gi, out, o, lse)


def test_ops_under_inference_mode_then_outside_it(monkeypatch):
    """Every op under inference_mode (its outputs inference tensors), then the same calls outside it on ordinary
    copies: fused_moe's counters are made inside inference mode first (the cache emptied), then reused outside."""
    monkeypatch.setattr(sys.modules["hipkern.ops.fused_moe"], "_counters", {})
    with torch.inference_mode():
        logits = torch.randn(33, 64, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(64, device="cuda") * 0.1
        ids = torch.randint(0, 64, (33, 4), device="cuda", dtype=torch.int32)
        moe_case = make_case(40, 256, 128, 8, 2, torch.bfloat16, seed=3)
        pa_case = make_pa_case([300, 2000, 1], num_kv_heads=2, group=8)
        inside = _every_op(logits, bias, ids, moe_case, pa_case, "inference_mode ")
        assert all(t.is_inference() for t in inside)
        assert sys.modules["hipkern.ops.fused_moe"]._counters, "fused_moe made no counters inside inference_mode"
    plain = [t.clone() for t in (logits, bias, ids)]
    moe_plain, pa_plain = [t.clone() for t in moe_case], [t.clone() for t in pa_case]
    assert not any(t.is_inference() for t in plain + moe_plain + pa_plain)
    outside = _every_op(*plain, moe_plain, pa_plain, "after inference_mode ")
    for a, b in zip(outside, inside):
        assert torch.equal(a, b), "the same call gave other bits outside inference_mode"


def test_parameters_outside_no_grad_give_outputs_without_a_gradient():
    """Weights as nn.Parameters (requires_grad) with grad mode on: the output carries no gradient (no grad_fn to
    mislead a backward) and has the same bits as the reference-checked call on plain tensors."""
    x, w1, w2, w, ids = make_case(40, 256, 128, 8, 2, torch.bfloat16, seed=4)
    checked = moe_run_and_check(x, w1, w2, w, ids)
    p1, p2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
    assert torch.is_grad_enabled() and p1.requires_grad
    poison_next_alloc(x.device, (x.shape, x.dtype))  # the op's output: an unwritten element shows
    out = hipkern.fused_moe(x, p1, p2, w, ids)
    assert not out.requires_grad and out.grad_fn is None
    assert torch.equal(out, checked)
    q, k, v, bt, cl = make_pa_case([300, 2000, 1], num_kv_heads=2, group=8)
    o_checked, _ = pa_run_and_check((q, k, v, bt, cl))
    qg = q.clone().requires_grad_()  # (before the poison: the op's output, not this copy, gets the poisoned block)
    poison_next_alloc(q.device, (q.shape, q.dtype))
    o = hipkern.paged_attention_decode(qg, k, v, bt, cl)
    assert not o.requires_grad and o.grad_fn is None
    assert torch.equal(o, o_checked)
