"""tests/fuzz.py's routing judges on the CPU, against stand-in ops with a known defect: each must fail the case
(a fuzz that passes them would not catch the defect on a GPU)."""
import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fuzz  # noqa: E402
import fuzz_routing as R  # noqa: E402
import hipkern  # noqa: E402
from hipkern.reference import grouped_topk_ref, topk_softmax_ref  # noqa: E402

# a grouped_topk case (fuzz seed 0's stream) with rows whose renormalised weights are NaN (chosen scores all 0)
NAN_ROWS_SEED = 1611891081


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(R, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


def _grouped(skip_nan_rows):
    def op(x, bias, k, g, tg, *, scoring, renormalize, routed_scaling_factor, group_scoring, out=None):
        w, ids = grouped_topk_ref(x, bias, k, g, tg, scoring, renormalize, routed_scaling_factor,
                                  group_scoring=group_scoring)
        w = w.float()
        wo, io = out if out is not None else (torch.empty_like(w), torch.empty_like(ids))
        io.copy_(ids)
        rows = ~w.isnan().any(dim=1) if skip_nan_rows else torch.ones(w.shape[0], dtype=torch.bool)
        wo[rows] = w[rows]  # NaN rows: left as they were when skip_nan_rows
        return wo, io
    return op


def test_grouped_topk_rows_left_unwritten_fail_where_the_right_weights_are_nan(on_cpu, monkeypatch):
    c = R.draw_grouped(random.Random(NAN_ROWS_SEED))
    x, b = R.grouped_inputs(c, torch.Generator().manual_seed(NAN_ROWS_SEED))
    ref = grouped_topk_ref(x, b, c["topk"], c["groups"], c["topk_group"], c["scoring"], c["renormalize"],
                           c["scaling"], group_scoring=c["group_scoring"])[0]
    assert ref.isnan().any(), "the drawer changed: pick another case with NaN rows"
    monkeypatch.setattr(hipkern, "grouped_topk", _grouped(skip_nan_rows=False))
    assert R.run_grouped(c, NAN_ROWS_SEED, False, fuzz.attempt)[0]["status"] == "passed"
    monkeypatch.setattr(hipkern, "grouped_topk", _grouped(skip_nan_rows=True))
    r = R.run_grouped(c, NAN_ROWS_SEED, False, fuzz.attempt)[0]
    assert r["status"] == "failed" and "left unwritten" in r["msg"]


def test_an_op_that_changes_its_input_fails(on_cpu, monkeypatch):
    def shifting(x, topk, renormalize=False, out=None):  # right outputs, then x -= its row max in place
        w, ids = topk_softmax_ref(x + 0.0, topk, renormalize)
        x.sub_(x.float().amax(dim=1, keepdim=True).to(x.dtype) + 1)
        if out is None:
            return w.float(), ids
        out[0].copy_(w)
        out[1].copy_(ids)
        return out

    master, checked = random.Random("topk_softmax:0"), 0
    while checked < 5:
        seed = master.randrange(2**31)
        c = R.draw_topk(random.Random(seed))
        if not 0 < c["tokens"] <= 512 or c["values"] == "neg_inf":
            continue
        monkeypatch.setattr(hipkern, "topk_softmax", shifting)
        r = R.run_topk(c, seed, False, fuzz.attempt)[0]
        assert r["status"] == "failed" and "changed an input" in r["msg"], (seed, r)
        checked += 1
