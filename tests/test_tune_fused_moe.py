"""The tuner's fused_moe adapter (CPU: shapes, candidates, the shipped shape list's plan; a database
row reaching the op's variant and block_m choice) and (GPU) a small real tuning run."""
import csv

import pytest
import torch

from hipkern import tuning_db
from hipkern.ops.fused_moe import (BLOCK_MS, DECODE_MAX_BLOCK_M, VARIANTS, block_ms_for, choose_block_m, choose_config,
                                   default_block_m)
from hipkern.tune import core
from hipkern.tune.__main__ import main
from hipkern.tune.core import Candidate
from hipkern.tune.fused_moe import ADAPTER

RAW = dict(dtype="bfloat16", model_dim="7168", inter_dim="256", num_experts="256", topk="8", tokens="32")


@pytest.fixture
def fresh(tuning_results):
    return tuning_results / "fused_moe.csv"


@pytest.mark.parametrize("change,match", [(dict(dtype="int8"), "dtype"), (dict(model_dim="7170"), "multiples of 8"),
                                          (dict(topk="0"), "topk"), (dict(topk="300"), "topk at most"),
                                          (dict(num_experts="2048"), "num_experts")])
def test_bad_shapes_name_the_column(change, match):
    with pytest.raises(ValueError, match=match):
        ADAPTER.parse_shape({**RAW, **change})


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_candidates_are_every_block_m_of_the_dtype_heuristic_first(dtype):
    s = ADAPTER.parse_shape({**RAW, "dtype": dtype})
    kept = ADAPTER.candidates(s, ADAPTER.info_for("sm_90", 132)).kept
    assert kept[0] == ADAPTER.heuristic(s, ADAPTER.info_for("sm_90", 132))
    assert sorted(c.kwargs["block_m"] for c in kept) == sorted(block_ms_for(getattr(torch, dtype)))  # 32 tokens
    assert len({c.name for c in kept}) == len(kept)
    assert (128 in [c.kwargs["block_m"] for c in kept]) == (dtype != "float32")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("experts", ["256", "16"])
@pytest.mark.parametrize("tokens,few", [("1", True), ("4", True), ("5", False)])  # top-8: 8, 32, 40 pairs
def test_few_pairs_add_the_decode_and_gemv_variants(dtype, experts, tokens, few):
    s = ADAPTER.parse_shape({**RAW, "dtype": dtype, "tokens": tokens, "num_experts": experts})
    kept = ADAPTER.candidates(s, ADAPTER.info_for("sm_90", 132)).kept
    assert kept[0] == ADAPTER.heuristic(s, ADAPTER.info_for("sm_90", 132))
    # the heuristic is what the op runs without a row: gemv where the pairs are at most half the
    # experts, else decode for 16-bit types where it fits
    gemv = few and 2 * int(tokens) * 8 <= int(experts)
    assert kept[0].variant == ("gemv" if gemv else "decode" if few and dtype != "float32" else "grouped")
    by_variant = {v: sorted(c.kwargs["block_m"] for c in kept if c.variant == v) for v in VARIANTS}
    assert by_variant["grouped"] == sorted(block_ms_for(getattr(torch, dtype)))
    assert by_variant["decode"] == ([b for b in sorted(block_ms_for(getattr(torch, dtype))) if b <= DECODE_MAX_BLOCK_M]
                                    if few else [])
    assert by_variant["gemv"] == ([8] if few else [])
    assert by_variant["gemv_mma"] == ([8] if few and dtype != "float32" else [])  # matrix cores: 16-bit only


def test_shipped_shape_list_plans_without_a_gpu(capsys):
    assert main(["fused_moe", "--dry-run", "--arch", "sm_90", "--cu-count", "132"]) == 0
    assert "65 shapes to tune" in capsys.readouterr().out  # bf16 and fp16 23 each, float32 19


def test_a_database_row_sets_block_m_and_misses_fall_back(fresh, monkeypatch):
    shape = ADAPTER.parse_shape(RAW)
    row = core.make_row(ADAPTER.schema, {"arch": "sm_90", "cu_count": 132}, shape, Candidate.of("grouped", block_m=64),
                        "ok", 500.0, 10**9, 0.0, "", {"date": "2026-11-22", "commit": "abc"})
    core.save(ADAPTER.schema, fresh, [row], {("sm_90", 132, "") + core.shape_key(ADAPTER.schema, shape)})
    monkeypatch.setenv("HIPKERN_TUNING_DB", str(fresh))
    tuning_db.reset()
    args = ("sm_90", 132, 32, 7168, 256, 256, 8)
    assert choose_block_m(*args, torch.bfloat16) == 64  # exact
    assert choose_block_m("sm_90", 132, 20, 7168, 256, 256, 8, torch.bfloat16) == 64  # same bucket
    assert choose_block_m("sm_90", 132, 32, 4096, 256, 256, 8, torch.bfloat16) == default_block_m(32, 8, 256)
    # a row whose block_m the dtype does not offer (fp32 stops at 64) is not taken
    row128 = core.make_row(ADAPTER.schema, {"arch": "sm_90", "cu_count": 132},
                           ADAPTER.parse_shape({**RAW, "dtype": "float32"}), Candidate.of("grouped", block_m=128),
                           "ok", 1.0, 10**9, 0.0, "", {"date": "2026-11-22", "commit": "abc"})
    with open(fresh, "a", newline="") as fh:
        csv.DictWriter(fh, fieldnames=ADAPTER.schema.columns, extrasaction="ignore").writerow(row128)
    tuning_db.reset()
    with pytest.warns(UserWarning, match=r"block_m=128 is not one of \(8, 16, 32, 64\) for float32; row skipped"):
        assert choose_block_m(*args, torch.float32) == default_block_m(32, 8, 256, torch.float32)
    assert set(BLOCK_MS) >= set(block_ms_for(torch.float32))


def _top12_row(fresh, monkeypatch, cand):
    """The only database row (in `fresh`, overlaid) of top-12 at 2 tokens (a shape with no shipped row): `cand`."""
    shape = ADAPTER.parse_shape({**RAW, "topk": "12", "tokens": "2"})
    row = core.make_row(ADAPTER.schema, {"arch": "sm_90", "cu_count": 132}, shape, cand,
                        "ok", 90.0, 10**8, 0.0, "", {"date": "2026-11-23", "commit": "abc"})
    core.save(ADAPTER.schema, fresh, [row], {("sm_90", 132, "") + core.shape_key(ADAPTER.schema, shape)})
    monkeypatch.setenv("HIPKERN_TUNING_DB", str(fresh))
    tuning_db.reset()


def test_a_decode_row_is_taken_where_decode_can_run(fresh, monkeypatch):
    # 2 tokens of top-12 make 24 pairs, 3 tokens 36 (over decode's 32)
    _top12_row(fresh, monkeypatch, Candidate.of("decode", block_m=16))
    assert choose_config("sm_90", 132, 2, 7168, 256, 256, 12, torch.bfloat16) == ("decode", 16)  # exact
    assert choose_config("sm_90", 132, 1, 7168, 256, 256, 12, torch.bfloat16) == ("decode", 16)  # nearest
    # the nearest row for 3 tokens, but 36 pairs: the row's block_m, the grouped variant
    assert choose_config("sm_90", 132, 3, 7168, 256, 256, 12, torch.bfloat16) == ("grouped", 16)
    assert choose_block_m("sm_90", 132, 3, 7168, 256, 256, 12, torch.bfloat16) == 16


def test_a_gemv_row_too_small_for_the_call_falls_back_with_the_default_block_m(fresh, monkeypatch):
    """A gemv row's block_m only names its module (8): where the nearest row is gemv but the call has more
    pairs than gemv takes, the grouped variant runs with default_block_m, not that 8."""
    _top12_row(fresh, monkeypatch, Candidate.of("gemv", block_m=8))
    assert choose_config("sm_90", 132, 2, 7168, 256, 256, 12, torch.bfloat16) == ("gemv", 8)  # exact: 24 pairs
    # 512 tokens (6144 pairs) find the same row, nearest: too many pairs for gemv
    assert choose_config("sm_90", 132, 512, 7168, 256, 256, 12, torch.bfloat16) == (
        "grouped", default_block_m(512, 12, 256))
    assert default_block_m(512, 12, 256) == 64


@pytest.mark.gpu
def test_tuning_run_writes_checked_rows(tmp_path):
    out = tmp_path / "fused_moe.csv"
    assert main(["fused_moe", "--shape", "dtype=bfloat16,model_dim=256,inter_dim=128,num_experts=16,topk=2,tokens=8",
                 "--out", str(out), "--no-progress"]) == 0
    rows = list(csv.DictReader(open(out, newline="")))
    assert len(rows) == 1 and rows[0]["variant"] in VARIANTS and int(rows[0]["block_m"]) in BLOCK_MS
    log = list(csv.DictReader(open(tmp_path / "fused_moe.candidates.csv", newline="")))
    # 8 tokens x top-2: 16 pairs, so decode too at every block_m up to DECODE_MAX_BLOCK_M, gemv and gemv_mma
    decode = [b for b in BLOCK_MS if b <= DECODE_MAX_BLOCK_M]
    assert {r["status"] for r in log} == {"ok"} and len(log) == len(BLOCK_MS) + len(decode) + 2
    assert all(float(r["skewed_us"]) > 0 for r in log)  # every token to the same experts, timed too
    assert float(rows[0]["skewed_us"]) > 0
    assert sorted(int(r["block_m"]) for r in log if r["variant"] == "decode") == decode
