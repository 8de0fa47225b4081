"""Every op called from 8 Python threads at once, as serving engines with worker threads or overlap schedulers call
them: in a fresh process (the first call of each op, which loads its module and the tuning database, made by
several threads at once), behind a barrier, each thread on its own CUDA stream (or all on one shared stream), each
op several times on the thread's own random inputs, into NaN-poisoned out= tensors; every result is checked against
the reference once the device is synchronised. fused_moe runs once as the database chooses and once on the grouped
chain whose GEMMs split K (every token on the same 2 experts, a long reduction: test_fused_moe_splits), so each
thread's first call makes kept split-K counters: for its own stream, or (one shared stream) for all of them at once."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch


TESTS = Path(__file__).resolve().parent
pytestmark = pytest.mark.gpu

THREADS, REPS = 8, 3

CODE = """
import sys, threading, time, traceback
import torch, hipkern
from hipkern.reference import moe_sorting_ref
from hipkern.testing import checkAllclose, poison
import moe_cases as mc, pa_cases as pc
from test_grouped_topk import _check as grouped_check
from test_topk_softmax import _check as softmax_check

THREADS, REPS, SHARED = {threads}, {reps}, {shared}
T, D, I, E, K = 40, 4096, 256, 16, 2  # (test_fused_moe_splits: too few items for the grid, so K splits)


def gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def fused_moe(i, r, w1, w2):
    x, w = mc.make_tokens(T, D, torch.bfloat16, seed=100 * i + r), mc.routing_weights(T, K, seed=100 * i + r)
    a = (i + r) % E
    ids = torch.tensor([[a, (a + 1 + r) % E]], dtype=torch.int32, device="cuda").repeat(T, 1)
    outs = [poison(torch.empty_like(x)) for _ in range(2)]
    hipkern.fused_moe(x, w1, w2, w, ids, out=outs[0])  # the database's choice (first call: its lookup)
    hipkern.fused_moe(x, w1, w2, w, ids, out=outs[1], block_m=32, variant="grouped")  # split K, kept counters
    return ("fused_moe", (x, w1, w2, w, ids), outs)


def routing_outs(t, k):  # a routing op's out= pair (weights, ids), poisoned
    return poison(torch.empty(t, k, device="cuda")), poison(torch.empty(t, k, dtype=torch.int32, device="cuda"))


def topk_softmax(i, r, *_):
    x = torch.randn(33, 64, generator=gen(1000 * i + r), device="cuda")
    out = routing_outs(33, 8)
    return ("topk_softmax", (x,), hipkern.topk_softmax(x, 8, out=out))


def grouped_topk(i, r, *_):
    x = torch.randn(70, 256, generator=gen(2000 * i + r), device="cuda")
    b = torch.randn(256, generator=gen(3000 * i + r), device="cuda") * 0.1
    out = routing_outs(70, 8)
    return ("grouped_topk", (x, b), hipkern.grouped_topk(x, b, 8, 8, 4, out=out))


def moe_sorting(i, r, *_):
    ids = mc.uniform_ids(50, 8, 64, seed=4000 * i + r)
    n = hipkern.moe_sorting_max_padded(ids.numel(), 64, 16)
    out = [poison(torch.empty(m, dtype=torch.int32, device="cuda")) for m in (n, n // 16, 1)]
    return ("moe_sorting", (ids,), hipkern.moe_sorting(ids, 64, 16, out=out))


def paged_attention(i, r, *_):
    case = pc.make_case([300 + 97 * i, 2000, 1, 777 + r], num_kv_heads=2, group=8, seed=5000 * i + r)
    o, lse = hipkern.paged_attention_decode(*case, out=poison(torch.empty_like(case[0])), return_lse=True)
    return ("paged_attention", case, (o, lse))


OPS = [fused_moe, topk_softmax, grouped_topk, moe_sorting, paged_attention]
shared = torch.cuda.Stream() if SHARED else None
barrier = threading.Barrier(THREADS, timeout=600)
results, errors = [], []


def worker(i):
    try:
        with torch.cuda.stream(shared or torch.cuda.Stream()):
            w1, w2 = mc.make_weights(E, D, I, torch.bfloat16, seed=i)
            order = OPS[i % len(OPS):] + OPS[:i % len(OPS)]  # first calls of every op, several at once
            barrier.wait()
            for r in range(REPS):
                for op in order:
                    results.append(op(i, r, w1, w2))
    except BaseException:
        errors.append(f"thread {{i}}:\\n" + traceback.format_exc())
        barrier.abort()


threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
for t in threads:
    t.start()
deadline = time.monotonic() + 600  # one for all the threads (the subprocess's own limit is 900 s)
for t in threads:
    t.join(timeout=max(0.0, deadline - time.monotonic()))
assert not any(t.is_alive() for t in threads), "a thread hangs"
assert not errors, "\\n".join(errors)
torch.cuda.synchronize()
assert len(results) == THREADS * REPS * len(OPS), len(results)
for name, inp, res in results:
    if name == "fused_moe":
        ref = mc.reference(*inp)
        for out in res:
            assert checkAllclose(out, ref, msg="fused_moe ", **mc.TOL[torch.bfloat16]) == 0
    elif name == "topk_softmax":
        softmax_check(inp[0], 8, True, *res)
    elif name == "grouped_topk":
        grouped_check(inp[0], inp[1], 8, 8, 4, *res)
    elif name == "moe_sorting":
        for got, want in zip(res, moe_sorting_ref(inp[0], 64, 16), strict=True):
            assert torch.equal(got, want), "moe_sorting"
    else:
        o, lse = pc.paged_attention_ref(*inp)
        assert pc.check_out(res[0], o) == 0 and checkAllclose(res[1], lse, **pc.LSE_TOL) == 0
print("ok", flush=True)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("shared", [False, True], ids=["stream-per-thread", "one-shared-stream"])
def test_every_op_from_threads_from_the_first_call(shared):
    code = textwrap.dedent(CODE.format(threads=THREADS, reps=REPS, shared=shared))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]
