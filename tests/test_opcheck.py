"""torch.library.opcheck over every registered op (torch.ops.hipkern.*): the schemas' mutation annotations, the
fake (meta) implementations' shapes, dtypes and strides against the real outputs, and the ops traced by AOT
dispatch with dynamic shapes against eager calls. The tests of each op check its values against a reference;
these check what torch.compile and engines that trace the ops rely on."""
import pytest
import torch

from hipkern import moe_sorting_max_padded
from hipkern.testing import poison
from moe_cases import half_remote, make_case
from pa_cases import make_case as make_pa_case

# case -> the op it checks
_OP_OF = {"topk_softmax": "topk_softmax", "topk_softmax_out": "topk_softmax_out", "grouped_topk": "grouped_topk",
          "grouped_topk_out": "grouped_topk_out", "moe_sorting": "moe_sorting", "moe_sorting_out": "moe_sorting_out",
          "fused_moe": "fused_moe", "fused_moe_grouped": "fused_moe", "fused_moe_out": "fused_moe_out",
          "paged_attention_decode": "paged_attention_decode",
          "paged_attention_decode_lse": "paged_attention_decode"}


def _routing_outs(t, k):
    return poison(torch.empty(t, k, device="cuda")), torch.full((t, k), -7, dtype=torch.int32, device="cuda")


def _sorting_outs(num_pairs, num_experts, block_m):
    cap = moe_sorting_max_padded(num_pairs, num_experts, block_m)
    return (torch.full((cap,), -7, dtype=torch.int32, device="cuda"),
            torch.full((cap // block_m,), -7, dtype=torch.int32, device="cuda"),
            torch.full((1,), -7, dtype=torch.int32, device="cuda"))


def _args():
    g = torch.Generator(device="cuda").manual_seed(11)
    logits = torch.randn(37, 64, generator=g, device="cuda").bfloat16()
    bias = torch.randn(64, generator=g, device="cuda") * 0.1
    ids = torch.randint(0, 64, (37, 4), generator=g, device="cuda", dtype=torch.int32)
    emap = torch.randperm(64, generator=g, device="cuda").int()
    emap[emap >= 32] = -1
    x, w1, w2, tw, tid = make_case(40, 256, 128, 8, 2, torch.bfloat16, seed=5)
    hm_map, hw1, hw2, _ = half_remote(8, w1, w2, seed=5)
    q, kc, vc, bt, cl = make_pa_case([1, 300, 2000, 17], num_kv_heads=2, group=8)
    qh, kh, vh, bth, clh = make_pa_case([5, 700], num_kv_heads=1, group=4, head_size=64, layout="HND",
                                        dtype=torch.float16)
    pa_out = lambda q_: poison(torch.empty_like(q_))  # noqa: E731
    return {
        "topk_softmax": (logits, 4, True),
        "topk_softmax_out": (logits, 4, False, *_routing_outs(37, 4)),
        "grouped_topk": (logits, bias, 4, 8, 2, "sigmoid", True, 2.5, "top2"),
        "grouped_topk_out": (logits, None, 4, 8, 2, "softmax", False, 1.0, "max", *_routing_outs(37, 4)),
        "moe_sorting": (ids, 64, 16, None),
        "moe_sorting_out": (ids, 64, 16, emap, *_sorting_outs(ids.numel(), 64, 16)),
        "fused_moe": (x, w1, w2, tw, tid, "silu", None, 0, ""),
        "fused_moe_grouped": (x, w1, w2, tw, tid, "gelu", None, 32, "grouped"),
        "fused_moe_out": (x, hw1, hw2, tw, tid, "silu", hm_map, 0, "", poison(torch.empty_like(x))),
        "paged_attention_decode": (q, kc, vc, bt, cl, 0.1, "NHD", "", pa_out(q), torch.empty(0, device="cuda")),
        "paged_attention_decode_lse": (qh, kh, vh, bth, clh, 0.125, "HND", "v9", pa_out(qh),
                                       poison(torch.empty(2, 4, device="cuda"))),
    }


CASES = list(_OP_OF)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_opcheck(case):
    args = _args()[case]
    op = getattr(torch.ops.hipkern, _OP_OF[case]).default
    results = torch.library.opcheck(op, args, raise_exception=False)
    assert set(results) >= {"test_schema", "test_faketensor", "test_aot_dispatch_dynamic"}, results
    failed = {test: str(res) for test, res in results.items() if res != "SUCCESS"}
    assert not failed, f"{_OP_OF[case]}: {failed}"


def test_cases_cover_every_registered_op():
    """Each op defined in the hipkern library has an opcheck case above (CPU: names only)."""
    from hipkern.ops._common import lib
    names = set(lib._op_defs) | {n for n in torch._C._dispatch_get_all_op_names() if n.startswith("hipkern::")}
    defined = {name.split("::")[1].split(".")[0] for name in names}
    assert defined, "no op registered"
    assert defined <= set(_OP_OF.values()), f"ops without an opcheck case: {sorted(defined - set(_OP_OF.values()))}"
