"""Every registered op (torch.ops.hipkern.*) called directly with CPU tensors raises the Python function's
ValueError naming the argument, not the dispatcher's "Could not run ... from the 'CPU' backend" (CPU test)."""
import pytest
import torch

import hipkern  # registers the ops

ops = torch.ops.hipkern
I32 = dict(dtype=torch.int32)


def _calls():
    x, ids, w = torch.randn(3, 64), torch.zeros(3, 2, **I32), torch.rand(3, 2)
    w1, w2 = torch.randn(8, 64, 64), torch.randn(8, 64, 32)
    q, kv = torch.randn(2, 8, 128, dtype=torch.bfloat16), torch.randn(4, 16, 1, 128, dtype=torch.bfloat16)
    bt, lens = torch.zeros(2, 2, **I32), torch.ones(2, **I32)
    return {
        "topk_softmax": (lambda: ops.topk_softmax(x, 2, True), "gating_logits"),
        "topk_softmax_out": (lambda: ops.topk_softmax_out(x, 2, True, w, ids), "gating_logits"),
        "grouped_topk": (lambda: ops.grouped_topk(x, None, 4, 8, 2, "sigmoid", True, 1.0), "gating_logits"),
        "grouped_topk_out": (lambda: ops.grouped_topk_out(x, None, 2, 8, 2, "sigmoid", True, 1.0, "top2", w, ids),
                             "gating_logits"),
        "moe_sorting": (lambda: ops.moe_sorting(ids, 8, 16), "topk_ids"),
        "moe_sorting_out": (lambda: ops.moe_sorting_out(ids, 8, 16, None, torch.empty(128, **I32),
                                                        torch.empty(8, **I32), torch.empty(1, **I32)), "topk_ids"),
        "fused_moe": (lambda: ops.fused_moe(x, w1, w2, w, ids, "silu", None, 0, ""), "hidden_states"),
        "fused_moe_out": (lambda: ops.fused_moe_out(x, w1, w2, w, ids, "silu", None, 0, "", torch.empty_like(x)),
                          "hidden_states"),
        "paged_attention_decode": (lambda: ops.paged_attention_decode(q, kv, kv, bt, lens, 0.1, "NHD", "",
                                                                      torch.empty_like(q), torch.empty(0)), "query"),
    }


@pytest.mark.parametrize("name", sorted(_calls()))
def test_registered_op_on_cpu_tensors_names_the_argument(name):
    call, arg = _calls()[name]
    with pytest.raises(ValueError, match=rf"^{arg} must be on a GPU"):
        call()


def test_every_registered_op_is_covered():
    """Every op of the library (its schemas, not only those looked up so far) is called above, and has a CPU
    kernel."""
    registered = {s.name.split("::")[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("hipkern::")}
    assert registered == set(_calls())
    assert all(torch._C._dispatch_has_kernel_for_dispatch_key(f"hipkern::{n}", "CPU") for n in registered)
    # each public op is a registered op
    assert set(hipkern.__all__) - {"__version__", "moe_sorting_max_padded"} <= registered
