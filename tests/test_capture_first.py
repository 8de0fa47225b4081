"""An op's first call inside a CUDA-graph capture, as a serving engine capturing its decode graphs meets it: in a
fresh process (the module built on disk but not loaded, no launch plan derived), then, in the same process, a
shape not seen before inside a second capture. Each graph is replayed with new inputs and checked against the
reference; the other GPU tests warm every op up outside their captures."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
pytestmark = pytest.mark.gpu

# Per op: make(n) -> (inputs, call, check), inputs refilled in place before each replay by refill(inputs, seed).
COMMON = """
import torch, hipkern
from hipkern.reference import moe_sorting_ref
from hipkern.testing import checkAllclose, poison
import moe_cases as mc, pa_cases as pc
from test_grouped_topk import _check as grouped_check
from test_topk_softmax import _check as softmax_check


def captured(call):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        res = call()
    return g, res


def run(make, refill, check, sizes):
    for n in sizes:  # the first: the op's first call in this process; the next: a new shape
        inputs, call = make(n)
        g, res = captured(call)
        for seed in (1, 2):
            refill(inputs, seed)
            for r in (res if isinstance(res, tuple) else (res,)):
                poison(r)
            g.replay()
            torch.cuda.synchronize()
            check(inputs, res)
    print("ok", flush=True)
"""

OPS = {
    "topk_softmax": """
def make(t):
    x = torch.randn(t, 64, device="cuda")
    return [x], lambda: hipkern.topk_softmax(x, 8)
def refill(inp, seed):
    inp[0].copy_(torch.randn(inp[0].shape, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda"))
def check(inp, res):
    softmax_check(inp[0], 8, True, *res)  # (test_topk_softmax's check: near ties in either order)
run(make, refill, check, (33, 70))
""",
    "grouped_topk": """
def make(t):
    x, b = torch.randn(t, 256, device="cuda"), torch.randn(256, device="cuda") * 0.1
    return [x, b], lambda: hipkern.grouped_topk(x, b, 8, 8, 4)
def refill(inp, seed):
    inp[0].copy_(torch.randn(inp[0].shape, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda"))
def check(inp, res):
    grouped_check(inp[0], inp[1], 8, 8, 4, *res)
run(make, refill, check, (33, 70))
""",
    "moe_sorting": """
def make(t):
    ids = mc.uniform_ids(t, 8, 64)
    return [ids], lambda: hipkern.moe_sorting(ids, 64, 16)
def refill(inp, seed):
    inp[0].copy_(mc.uniform_ids(inp[0].shape[0], 8, 64, seed))
def check(inp, res):
    assert all(torch.equal(a, b) for a, b in zip(res, moe_sorting_ref(inp[0], 64, 16)))
run(make, refill, check, (33, 70))
""",
    "fused_moe": """
def make(t):
    x, w1, w2, w, ids = mc.make_case(t, 256, 128, 64, 8, torch.bfloat16)
    return [x, w1, w2, w, ids], lambda: hipkern.fused_moe(x, w1, w2, w, ids)
def refill(inp, seed):
    t = inp[0].shape[0]
    inp[0].copy_(mc.make_tokens(t, 256, torch.bfloat16, seed)), inp[4].copy_(mc.uniform_ids(t, 8, 64, seed))
def check(inp, res):
    assert checkAllclose(res, mc.reference(*inp), **mc.TOL[torch.bfloat16]) == 0
run(make, refill, check, (3, 40, 300))  # (the database's gemv / decode / grouped choices, by pairs)
""",
    "paged_attention": """
def make(n):
    q, k, v, bt, cl = pc.make_case([1000 + 37 * i for i in range(n)], num_kv_heads=2, group=8)
    return [q, k, v, bt, cl], lambda: hipkern.paged_attention_decode(q, k, v, bt, cl, return_lse=True)
def refill(inp, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    inp[0].copy_(torch.randn(inp[0].shape, generator=g, device="cuda"))
    inp[4].copy_(torch.randint(1, inp[3].shape[1] * 16, inp[4].shape, generator=g, device="cuda"))
def check(inp, res):
    o, lse = pc.paged_attention_ref(*inp)
    assert pc.check_out(res[0], o) == 0 and checkAllclose(res[1], lse, **pc.LSE_TOL) == 0
run(make, refill, check, (3, 9))
""",
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("op", sorted(OPS))
def test_the_first_call_inside_a_capture(op):
    code = COMMON + textwrap.dedent(OPS[op])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
