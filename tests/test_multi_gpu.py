"""Every op on a GPU other than the current one, and on two GPUs in turn: tensor parallelism runs one op per GPU,
often from one process. Inputs live on cuda:dev while the other GPU is current; the op must run on the inputs' GPU
(its module, workspaces and split-K / routing counters per device), leave the caller's current device as it was,
and give the same bits as on the other GPU (same model, deterministic kernels). Needs two GPUs; skipped otherwise."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hipkern
from hipkern.reference import moe_sorting_ref, paged_attention_ref
from hipkern.testing import checkAllclose, poison

from moe_cases import TOL as MOE_TOL
from moe_cases import graph_replay_with_new_routing, make_case, reference, route_pairs_here
from moe_cases import run_and_check as moe_run_and_check
from pa_cases import check_out
from pa_cases import make_case as make_pa_case
from pa_cases import run_and_check as pa_run_and_check
from test_grouped_topk import _check as grouped_check
from test_topk_softmax import _check as softmax_check

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs visible to torch")]


def _on(dev, fn, *args, **kw):
    """fn(*args) with cuda:dev current (where "cuda" tensors are made)."""
    with torch.cuda.device(dev):
        return fn(*args, **kw)


def _to(dev, tensors):
    return [t.to(f"cuda:{dev}") if isinstance(t, torch.Tensor) else t for t in tensors]


def _same(a, b, what):
    a, b = (a,) if isinstance(a, torch.Tensor) else a, (b,) if isinstance(b, torch.Tensor) else b
    for x, y in zip(a, b):
        assert torch.equal(x.cpu(), y.cpu()), f"{what}: the two GPUs' outputs differ"


@pytest.mark.parametrize("dev", [0, 1])
def test_routing_ops_on_the_other_gpu(dev):
    other = 1 - dev
    x = _on(dev, torch.randn, 33, 64, device="cuda", dtype=torch.bfloat16)
    bias = _on(dev, torch.randn, 64, device="cuda") * 0.1
    ids = _on(dev, lambda: torch.randint(0, 64, (33, 4), device="cuda", dtype=torch.int32))
    with torch.cuda.device(other):
        w, i = hipkern.topk_softmax(x, 4)
        gw, gi = hipkern.grouped_topk(x, bias, 4, 8, 2)
        sorted_ids = hipkern.moe_sorting(ids, 64, 16)
        assert torch.cuda.current_device() == other, "an op left another GPU current"
    for t in (w, i, gw, gi, *sorted_ids):
        assert t.device == x.device
    softmax_check(x, 4, True, w, i)
    grouped_check(x, bias, 4, 8, 2, gw, gi)
    for name, got, want in zip(("sorted_token_ids", "expert_ids", "num_tokens_post_padded"), sorted_ids,
                               moe_sorting_ref(ids, 64, 16)):
        assert torch.equal(got, want), f"moe_sorting's {name} differs from the reference"
    # the same calls on the other GPU (current there): the same bits
    xo, bo, io = _to(other, (x, bias, ids))
    with torch.cuda.device(other):
        _same(hipkern.topk_softmax(xo, 4), (w, i), "topk_softmax")
        _same(hipkern.grouped_topk(xo, bo, 4, 8, 2), (gw, gi), "grouped_topk")
        _same(hipkern.moe_sorting(io, 64, 16), sorted_ids, "moe_sorting")


# (tokens, D, I, E, k, block_m, variant): the grouped chain routed in its GEMM blocks (200 pairs at block_m 32) and
# after moe_sorting (258 and 600 pairs), the one-launch decode variant, the gemv variant
MOE = [(100, 2048, 256, 16, 2, 32, "grouped"), (129, 2048, 256, 16, 2, 64, "grouped"),
       (300, 256, 128, 8, 2, 16, "grouped"), (4, 2048, 256, 64, 8, 32, "decode"), (2, 1024, 256, 64, 4, None, "gemv")]


@pytest.mark.parametrize("dev", [0, 1])
@pytest.mark.parametrize("t,d,i,e,k,block_m,variant", MOE)
def test_fused_moe_on_the_other_gpu(dev, t, d, i, e, k, block_m, variant):
    other = 1 - dev
    if t * k <= 256 and variant == "grouped":  # the case meant to route in the GEMM blocks does, on cuda:dev
        assert t * k <= _on(dev, route_pairs_here, torch.bfloat16, block_m), "no routing in the blocks here"
    case = _on(dev, make_case, t, d, i, e, k, torch.bfloat16, seed=t)
    with torch.cuda.device(other):
        out = moe_run_and_check(*case, block_m=block_m, variant=variant, msg=f"cuda:{dev} from cuda:{other} ")
        assert torch.cuda.current_device() == other
    assert out.device == case[0].device
    with torch.cuda.device(other):
        again = hipkern.fused_moe(*_to(other, case), block_m=block_m, variant=variant)
    _same(again, out, "fused_moe")


# (lengths, KV heads, group, head size, variant): split partitions merged by the merge kernel (v16, v3) and
# per sequence on the GPU (v5), 64-head wgmma blocks at group 64
PA = [([300, 2000, 1, 4096], 2, 8, 128, "v16"), ([5000, 17], 1, 64, 256, "v16"), ([3000, 1, 700], 2, 4, 128, "v5"),
      ([1500, 64], 2, 4, 64, "v3")]


@pytest.mark.parametrize("dev", [0, 1])
@pytest.mark.parametrize("lens,kv,group,head,variant", PA)
def test_paged_attention_on_the_other_gpu(dev, lens, kv, group, head, variant):
    other = 1 - dev
    case = _on(dev, make_pa_case, lens, num_kv_heads=kv, group=group, head_size=head, seed=len(lens))
    with torch.cuda.device(other):
        out, lse = pa_run_and_check(case, variant=variant, msg=f"cuda:{dev} from cuda:{other} ")
        assert torch.cuda.current_device() == other
    assert out.device == case[0].device
    with torch.cuda.device(other):
        again = hipkern.paged_attention_decode(*_to(other, case), variant=variant, return_lse=True)
    _same(again, (out, lse), "paged_attention_decode")


def test_calls_alternating_between_two_gpus():
    """Calls with workspaces (split partials, routing counters) alternate between the GPUs, each into a
    NaN-poisoned output, twice over: every one matches the reference, the same call on the other GPU bit for bit,
    and its own first round (counters left as they were found)."""
    moe = [make_case(129, 2048, 256, 16, 2, torch.bfloat16, seed=s) for s in range(3)]
    pa = [make_pa_case([300, 2000, 1, 4096], num_kv_heads=2, group=8, seed=s) for s in range(3)]
    moe_1, pa_1 = [_to(1, c) for c in moe], [_to(1, c) for c in pa]
    first = {}
    for rnd in range(2):
        for s in range(3):
            a = hipkern.fused_moe(*moe[s], block_m=64, out=poison(torch.empty_like(moe[s][0])))
            b = hipkern.fused_moe(*moe_1[s], block_m=64, out=poison(torch.empty_like(moe_1[s][0])))
            c = hipkern.paged_attention_decode(*pa[s], out=poison(torch.empty_like(pa[s][0])))
            d = hipkern.paged_attention_decode(*pa_1[s], out=poison(torch.empty_like(pa_1[s][0])))
            assert checkAllclose(a, reference(*moe[s]), msg=f"fused_moe round {rnd} case {s} ",
                                 **MOE_TOL[torch.bfloat16]) == 0
            assert check_out(c, paged_attention_ref(*pa[s])[0], msg=f"paged attention round {rnd} case {s} ") == 0
            _same(b, a, f"fused_moe round {rnd} case {s}")
            _same(d, c, f"paged_attention_decode round {rnd} case {s}")
            if rnd == 0:
                first[s] = (a, c)
            else:
                _same((a, c), first[s], f"round 1 against round 0, case {s}")
    assert torch.cuda.current_device() == 0


# Run in a process of its own, before anything has copied between the GPUs (a copy makes torch enable peer
# access, after which a kernel launched on the wrong GPU could still reach the inputs): each op with its inputs on
# cuda:1 while cuda:0 is current, against float64 / float32 references computed on the CPU.
_FRESH = textwrap.dedent("""
    import torch, hipkern
    from hipkern.reference import fused_moe_ref, paged_attention_ref, topk_softmax_ref
    from hipkern.testing import checkAllclose, rows_scaled
    torch.cuda.set_device(0)
    g = torch.Generator(device="cuda:1").manual_seed(1)
    x = torch.randn(33, 64, generator=g, device="cuda:1")
    w, ids = hipkern.topk_softmax(x, 4)
    rw, rids = topk_softmax_ref(x.cpu(), 4, True)
    assert torch.equal(ids.cpu(), rids) and torch.allclose(w.cpu(), rw, atol=1e-5, rtol=1e-5), "topk_softmax"
    t, d, i, e, k = 40, 256, 128, 8, 2
    h = torch.randn(t, d, generator=g, device="cuda:1").bfloat16()
    w1 = (torch.randn(e, 2 * i, d, generator=g, device="cuda:1") * d ** -0.5).bfloat16()
    w2 = (torch.randn(e, d, i, generator=g, device="cuda:1") * i ** -0.5).bfloat16()
    tw = torch.rand(t, k, generator=g, device="cuda:1") + 0.1
    tid = torch.rand(t, e, generator=g, device="cuda:1").topk(k, dim=1).indices.int()
    out = torch.full_like(h, float("nan"))
    hipkern.fused_moe(h, w1, w2, tw, tid, out=out)
    ref = fused_moe_ref(*(a.cpu() for a in (h, w1, w2, tw, tid)), "silu", None, torch.float64, torch.bfloat16)
    assert torch.allclose(out.cpu().double(), ref.double(), atol=1e-2, rtol=1e-2), "fused_moe"
    nb, bs = 300, 16
    q = torch.randn(3, 8, 128, generator=g, device="cuda:1").bfloat16()
    kc = torch.randn(nb, bs, 2, 128, generator=g, device="cuda:1").bfloat16()
    vc = torch.randn(nb, bs, 2, 128, generator=g, device="cuda:1").bfloat16()
    bt = torch.randperm(nb, generator=g, device="cuda:1")[:3 * 90].view(3, 90).int()
    cl = torch.tensor([1400, 1, 700], dtype=torch.int32).to("cuda:1")
    o = torch.full_like(q, float("nan"))
    hipkern.paged_attention_decode(q, kc, vc, bt, cl, out=o)
    ro, _ = paged_attention_ref(*(a.cpu() for a in (q, kc, vc, bt, cl)))
    # the tests' bf16 tolerance with atol scaled by each row's size (pa_cases.check_out): outputs of long rows are
    # small, and an unscaled 2e-2 let a kernel that drops a row's last tokens pass
    assert checkAllclose(*rows_scaled(o.cpu(), ro), atol=8e-3, rtol=8e-3) == 0, "paged_attention_decode"
    assert torch.cuda.current_device() == 0
    print("fresh process: ok")
""")


def test_a_fresh_process_runs_each_op_on_its_inputs_gpu():
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=600, cwd=root,
                       env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert r.returncode == 0 and "fresh process: ok" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_graph_capture_on_the_second_gpu():
    """fused_moe captured in a CUDA graph on cuda:1 (its counters zeroed inside the capture there), replayed with
    new routing and checked against the reference; then paged attention captured there with a split."""
    with torch.cuda.device(1):
        graph_replay_with_new_routing(torch.bfloat16, 40, 16, 2)
        case = make_pa_case([300, 2000, 1], num_kv_heads=2, group=8, seed=9)
        out = torch.empty_like(case[0])
        hipkern.paged_attention_decode(*case, out=out)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            hipkern.paged_attention_decode(*case, out=out)
        q, k, v, bt, cl = case
        g = torch.Generator(device="cuda").manual_seed(3)
        q.copy_(torch.randn(q.shape, generator=g, device="cuda"))
        cl.copy_(torch.tensor([2040, 1, 900], dtype=torch.int32))
        poison(out)
        graph.replay()
        ref = hipkern.paged_attention_decode(*case, out=poison(torch.empty_like(q)))
        torch.cuda.synchronize()
        assert torch.isfinite(out).all() and torch.equal(out, ref), "the replay differs from a direct call"
    assert check_out(out, paged_attention_ref(*case)[0], msg="graph on cuda:1 ") == 0
