"""The benchmarks' bar report (hipkern.bench.bars) on hand-made rows: each bar met and missed."""
import math

import re

import pytest
import torch

from hipkern.bench import bars


def _pa(b, ctx, hq, hkv, d, us, mb, sdpa=1e9, floor=1.0, moved=None, check="passed"):
    moved = mb if moved is None else moved  # all bytes moved (K, V, Q, O); mb: the KV alone
    return dict(BatchSize=b, ContextLen=ctx, NumQHeads=hq, NumKVHeads=hkv, HeadSize=d, Custom_Time_us=us, KV_MB=mb,
                Bytes_MB=moved, TBps=moved / us, SDPA_contiguous_us=sdpa, Floor_us=floor, Check=check)


def _verdicts(lines, key):
    return [line.split(": ")[-1].split(" (")[0] for line in lines if key in line]


def test_pa_bandwidth_bars_by_size():
    rows = [_pa(32, 4096, 32, 8, 128, 100.0, 279.0, floor=90.0),  # 2.79 TB/s on >= 256 MB
            _pa(64, 4096, 32, 8, 128, 100.0, 281.0),  # 2.81
            _pa(8, 4096, 32, 8, 128, 100.0, 241.0),  # 2.41 on 64-256 MB
            _pa(8, 4096, 32, 8, 128, 100.0, 63.0)]  # under 64 MB: no bandwidth bar
    lines = bars.paged_attention(rows)
    assert len(lines) == 3
    assert _verdicts(lines, "TB/s") == ["NOT met", "met", "met"]
    assert "NOT met (bar 99.64 us = 1.107x the read floor 90.00 us)" in lines[0]


def test_pa_reference_grid_sdpa_and_smallest_shape():
    rows = [_pa(1, 256, 64, 8, 128, 9.9, 1.0, sdpa=20.0), _pa(1, 256, 64, 1, 256, 10.1, 0.3, sdpa=10.0),
            _pa(32, 2048, 64, 8, 128, 97.0, 269.0, sdpa=96.0)]
    lines = bars.paged_attention(rows)
    assert _verdicts(lines, "against SDPA") == ["met", "NOT met", "NOT met"]
    assert _verdicts(lines, "the smallest") == ["met", "NOT met"]


def test_pa_mixed_lengths_share_of_copy_and_its_size_bar():
    """The mixed batch has its own bar (80 % of copy) and, holding ~300 MB, the 2.8 TB/s of every shape of
    256 MB or more: both are judged."""
    ok = _pa(32, "mixed<= 4096", 32, 8, 128, 100.0, 241.0)
    low = _pa(32, "mixed<= 4096", 32, 8, 128, 100.0, 239.0)
    assert _verdicts(bars.paged_attention([ok, low]), "80 % of copy") == ["met", "NOT met"]
    assert _verdicts(bars.paged_attention([ok, low]), "(2") == ["met", "NOT met"]  # 2.41 / 2.39 on 64-256 MB
    big = _pa(32, "mixed<= 4096", 32, 8, 128, 100.0, 270.0)  # 2.7 TB/s on 270 MB: 90 % of copy, under 2.8
    lines = bars.paged_attention([big])
    assert _verdicts(lines, "mixed lengths") == ["met", "NOT met"]
    assert ">= 2.8 TB/s" in lines[1] and "(270 MB of KV)" in lines[1]
    # today's rows: ContextLen the longest length (an int), Lengths "mixed a..b"; judged alike, said alike
    now = dict(big, ContextLen=4096, Lengths="mixed 1..4096")
    assert bars.paged_attention([now]) == lines
    # a uniform 64-head row of ContextLen <= 2048 is a reference shape (SDPA bar); the mixed one never is
    assert not any("SDPA" in ln for ln in bars.paged_attention([dict(now, NumQHeads=64, ContextLen=2048)]))


def test_pa_csv_reads_context_lengths_as_numbers(tmp_path):
    """The mixed row wrote "mixed<= 3796" into ContextLen, so a spreadsheet or pandas read the column as text."""
    import csv

    from hipkern.bench.paged_attention import COLUMNS
    from hipkern.testing import BenchTable

    t = BenchTable(COLUMNS)
    rest = {c: 1.0 for c in COLUMNS}
    t.add(**dict(rest, BatchSize=32, ContextLen=2048, Lengths="uniform", Check="passed"))
    t.add(**dict(rest, BatchSize=32, ContextLen=3796, Lengths="mixed 1..3796", Check="passed"))
    rows = list(csv.DictReader(open(t.to_csv(tmp_path / "pa.csv"))))
    assert [int(r["ContextLen"]) for r in rows] == [2048, 3796]
    assert [r["Lengths"] for r in rows] == ["uniform", "mixed 1..3796"]


def test_pa_size_classes_go_by_the_kv_alone():
    """254 MB of KV plus 3 MB of Q and O is a 64-256 MB shape (2.4 TB/s), judged at its rate over all 257 MB."""
    lines = bars.paged_attention([_pa(64, 4096, 32, 8, 128, 100.0, 254.0, moved=257.0)])
    assert lines == ["[bar] 64 x 4096 x 32/8 heads x 128 (254 MB of KV): 2.570 TB/s, bar >= 2.4 TB/s: met "
                     "(bar 107.08 us = 107.083x the read floor 1.00 us)"]


def test_a_row_whose_check_failed_meets_no_bar():
    rows = [_pa(1, 256, 64, 8, 128, 5.0, 300.0, sdpa=20.0, check="FAILED")]
    lines = bars.paged_attention(rows)
    assert len(lines) == 3 and all("NOT met (its output FAILED the check)" in line for line in lines)
    u = _moe("bfloat16", 1, 7168, 256, 256, 8, "uniform", 10.0, 88.0, check="FAILED")
    lines = bars.moe([u, _moe("bfloat16", 1, 7168, 256, 256, 8, "skewed", 10.0, 88.0)])
    assert len(lines) == 5 and all("NOT met (its output FAILED the check)" in line for line in lines[:2])
    assert "NOT met (its output FAILED the check)" in lines[4]  # the skew bar: its uniform row failed
    assert _verdicts(lines[2:4], "skewed") == ["met", "met"]


def test_pa_no_shape_slower_than_10_us_in_both_readings():
    """The smallest shapes (1 x 256) within 10 us; and, the stricter reading, every reference shape whose read
    floor is under 10 us."""
    rows = [_pa(1, 256, 64, 8, 128, 9.5, 1.0, floor=6.0), _pa(8, 256, 64, 8, 128, 10.4, 8.4, floor=7.0),
            _pa(32, 256, 64, 8, 128, 18.0, 33.0, floor=14.0), _pa(8, 2048, 64, 1, 256, 19.0, 17.0, floor=11.0)]
    lines = bars.paged_attention(rows)
    assert _verdicts(lines, "the smallest") == ["met"]
    # 1 x 256: judged once, as the smallest; 32 x 256 and 8 x 2048: floors of 14 and 11 us, exempt
    strict = [line for line in lines if "stricter reading" in line]
    assert _verdicts(strict, "") == ["NOT met", "exempt, its read floor 14.00 us is over 10 us",
                                     "exempt, its read floor 11.00 us is over 10 us"]
    assert "8 x 256" in strict[0] and "32 x 256" in strict[1] and "8 x 2048" in strict[2]


def test_the_report_says_when_the_run_is_not_on_an_h100():
    assert bars.device_lines("NVIDIA H100 80GB HBM3") == []
    (line,) = bars.device_lines("NVIDIA H200")
    assert "not an H100" in line and "judge nothing" in line
    assert bars.device_lines("NVIDIA H100 80GB HBM3", "sm_90", "sm_90") == []
    (line,) = bars.device_lines("NVIDIA H100 80GB HBM3", "sm_80", "sm_90")  # HIPKERN_ARCH=sm_80: through PTX
    assert "built for sm_80 (HIPKERN_ARCH), not this GPU's sm_90" in line and "judge nothing" in line
    assert len(bars.device_lines("NVIDIA H200", "sm_80", "sm_90")) == 2


def _moe(dtype, tokens, d, i, e, k, routing, us, mb, weight_mb=None, floor=1.0, check="passed"):
    return dict(dtype=dtype, tokens=tokens, model_dim=d, inter_dim=i, E=e, topk=k, routing=routing, custom_us=us,
                TBps=mb / us, weight_MB=mb if weight_mb is None else weight_mb, floor_us=floor, check=check)


def test_moe_skew_against_its_uniform_counterpart():
    rows = [_moe("bfloat16", 8, 7168, 256, 256, 8, "uniform", 100.0, 270.0),  # 2.7 TB/s
            _moe("bfloat16", 8, 7168, 256, 256, 8, "skewed", 40.0, 88.0),  # 2.2: 0.815 of uniform
            _moe("bfloat16", 2, 7168, 256, 256, 8, "uniform", 100.0, 250.0),
            _moe("bfloat16", 2, 7168, 256, 256, 8, "skewed", 40.0, 92.0),  # 2.3: 0.92
            _moe("bfloat16", 16, 7168, 256, 256, 8, "uniform", 100.0, 250.0),
            _moe("bfloat16", 16, 7168, 256, 256, 8, "skewed", 40.0, 90.5),  # 0.905: 10.5 % more time per byte
            # the weights alone count: 2.3 TB/s with the hidden states, 2.2 (0.88) without
            _moe("bfloat16", 32, 7168, 256, 256, 8, "uniform", 100.0, 250.0),
            _moe("bfloat16", 32, 7168, 256, 256, 8, "skewed", 40.0, 92.0, weight_mb=88.0),
            _moe("bfloat16", 4, 7168, 256, 256, 8, "skewed", 10.0, 88.0)]  # no uniform row: no skew bar
    lines = bars.moe(rows)
    skew = [line for line in lines if "of uniform's" in line]
    assert _verdicts(skew, "skewed") == ["NOT met", "met", "NOT met", "NOT met"]
    assert "0.815 of uniform" in skew[0] and "0.905 of uniform" in skew[2] and "0.880 of uniform" in skew[3]
    # and each skewed reference shape's own rate against 2.4 TB/s: 2.2, 2.3, 2.2625, 2.2, 8.8
    rate = [line for line in lines if "skewed" in line and "TB/s over the weights" in line]
    assert _verdicts(rate, "skewed") == ["NOT met", "NOT met", "NOT met", "NOT met", "met"]


def test_moe_skewed_reference_shapes_take_the_uniform_bars_too():
    """A skewed Mixtral-like 32-token call over 1.6 GB of weights at 2.73 TB/s is within 10 % of uniform's
    2.9 TB/s per byte, but under the 2.8 TB/s of a reference shape over 1 GB."""
    rows = [_moe("bfloat16", 32, 8192, 16384, 8, 2, "uniform", 2000.0, 5800.0),
            _moe("bfloat16", 32, 8192, 16384, 8, 2, "skewed", 590.0, 1611.0)]
    lines = [line for line in bars.moe(rows) if "skewed" in line]
    assert _verdicts(lines, "") == ["NOT met", "met"]
    assert "2.731 TB/s over the weights" in lines[0] and ">= 2.8 TB/s" in lines[0]


def test_moe_uniform_bars_and_the_one_token_bar():
    rows = [_moe("bfloat16", 32, 8192, 6144, 8, 2, "uniform", 1000.0, 2810.0, weight_mb=2790.0),  # > 1 GB: 2.8
            _moe("bfloat16", 32, 7168, 256, 256, 8, "uniform", 375.0, 910.0, weight_mb=900.0),  # <= 1 GB: 2.4
            _moe("bfloat16", 1, 7168, 256, 256, 8, "uniform", 39.0, 88.0),  # 2.26 TB/s, 39 us
            # 8 experts' fp32 weights, 4831.8 / 12884.9 MB: 1.3 x 1610.6 us = 2093.8 us, 1.3 x 4295.0 = 5583.5
            _moe("float32", 128, 8192, 6144, 8, 2, "uniform", 2000.0, 4831.8),
            _moe("float32", 128, 8192, 16384, 8, 2, "uniform", 5700.0, 12884.9),
            _moe("bfloat16", 64, 4096, 14336, 8, 2, "uniform", 100.0, 10.0)]  # Mixtral 8x7B: no bar
    lines = bars.moe(rows)
    assert len(lines) == 6
    assert _verdicts(lines, "") == ["NOT met", "met", "NOT met", "met", "met", "NOT met"]
    assert "<= 40 us (its own)" in lines[3]


def test_bars_read_only_columns_the_benchmarks_write():
    """A row with exactly a benchmark's columns (and numbers in them) is judged without a KeyError, so a
    renamed column fails here, not on the GPU machine at the end of a run."""
    from hipkern.bench import moe, paged_attention

    pa = {c: 1.0 for c in paged_attention.COLUMNS}
    pa.update(BatchSize=1, ContextLen=256, NumQHeads=64, NumKVHeads=8, HeadSize=128, KV_MB=300.0)
    assert len(bars.paged_attention([pa])) == 3  # size, SDPA, the smallest (the stricter 10 us: not twice)
    row = {c: 1.0 for c in moe.COLUMNS}
    row.update(dtype="bfloat16", tokens=1, model_dim=7168, inter_dim=256, E=256, topk=8)
    assert len(bars.moe([dict(row, routing="uniform"), dict(row, routing="skewed")])) == 5  # 2 + 2 + the skew


def test_the_bytes_the_benchmarks_count():
    """Paged attention: each sequence's K and V up to its own length, plus Q and O; fused MoE: an activated
    expert's gate, up and down weights (3 x D x I elements), once."""
    import torch

    from hipkern.bench import moe, paged_attention

    # 3 sequences of 1, 17 and 4096 tokens, 8 KV heads x 128, 64 query heads, bf16
    assert paged_attention.bytes_moved([1, 17, 4096], 8, 64, 128, 2) == (4114 * 8 * 128 * 2 + 2 * 3 * 64 * 128) * 2
    assert paged_attention.bytes_moved([2048] * 32, 1, 64, 256, 2) == 32 * 2048 * 256 * 2 * 2 + 2 * 32 * 64 * 256 * 2
    case = moe.Case(0, torch.bfloat16, 1, 7168, 256, 256, 8, "uniform", "ref")
    assert case.expert_bytes == 3 * 7168 * 256 * 2
    assert moe.Case(0, torch.float32, 1, 8192, 6144, 8, 2, "skewed", "ref").expert_bytes == 3 * 8192 * 6144 * 4


def test_bench_cli_refuses_block_m_128_where_the_cases_include_float32(capsys):
    """fused_moe offers block_m 128 for 16-bit types only: the CLI says so before any case runs (it used to
    fail on the first float32 case, after its naive timing, and abort every benchmark after it)."""
    from hipkern.bench.__main__ import main

    for argv in (["moe", "--block-m", "128"], ["all", "--block-m", "128", "--dtype", "fp32"],
                 ["moe", "--block-m", "128", "--cases", "1-4,41"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and "selected moe cases include float32" in capsys.readouterr().err


@pytest.mark.parametrize("argv,match", [
    (["moe", "--cases", "99"], r"'99' is not a test number or a range a-b within 1-\d+"),
    (["moe", "--cases", "7-3"], r"'7-3' is not a test number or a range"),
    (["moe", "--cases=-3"], r"'-3' is not a test number, a range a-b"),
    (["moe", "--cases", "1-2-3"], r"'1-2-3' is not a test number, a range a-b"),
    (["moe", "--cases", "mixtral", "--dtype", "fp32"], r"--cases mixtral with --dtype fp32 selects no case"),
    (["paged_attention", "--cases", "3"], r"--cases: options of the moe benchmark, which this run does not"),
    (["topk_softmax", "--dtype", "fp32", "--block-m", "16"], r"--dtype, --block-m: options of the moe benchmark"),
])
def test_bench_cli_refuses_selections_that_select_nothing_or_do_not_apply(argv, match, capsys):
    """Before any GPU work: an empty or malformed --cases (it ran nothing and exited 0, or raised a bare
    ValueError after the GPU probe), and moe options given to other benchmarks (silently ignored)."""
    from hipkern.bench.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and re.search(match, capsys.readouterr().err)


def test_bench_cli_takes_bf16_cases_with_block_m_128_and_runs_a_benchmark_once(monkeypatch):
    import torch

    from hipkern.bench import __main__ as cli

    ran = []

    def fake_moe(out, quick=False, cases=None, dtype=None, block_m=None):
        ran.append(dict(cases=cases, dtype=dtype, block_m=block_m))
        return 0

    monkeypatch.setattr(cli, "BENCHES", {**cli.BENCHES, "moe": fake_moe})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("hipkern.bench.device_line", lambda: "a GPU")
    assert cli.main(["moe", "moe", "--cases", "mixtral", "--block-m", "128"]) == 0
    assert ran == [{"cases": "mixtral", "dtype": None, "block_m": 128}]


def test_moe_case_header_is_the_reference_line_then_the_routing():
    from hipkern.bench.moe import all_cases

    head, routing = all_cases()[-1].header().split("\n")
    assert re.fullmatch(r"Test \d\d: dtype=\w+, token=\d+, model_dim=\d+, inter_dim=\d+, E=\d+, topk=\d+", head)
    assert routing == "[perf] routing: uniform"


def test_a_case_checked_on_several_routings_prints_one_check_line(capsys):
    """One checkAllclose line a case, as in the reference log (it printed one a routing, prefixed), the worst."""
    import torch

    from hipkern.bench.moe import check_routings

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, generator=g)
    w1, w2 = torch.randn(4, 32, 32, generator=g), torch.randn(4, 32, 16, generator=g)
    w = torch.full((4, 2), 0.5)
    sets = [(w, torch.tensor([[0, 1]] * 4, dtype=torch.int32)), (w, torch.tensor([[2, 3]] * 4, dtype=torch.int32))]
    from hipkern.reference import fused_moe_ref

    bad = {"n": 0}

    def custom(tw, ids):  # right on the first routing, wrong on the second
        bad["n"] += 1
        y = fused_moe_ref(x, w1, w2, tw, ids, compute_dtype=torch.float32)
        return y * (1.5 if bad["n"] == 2 else 1.0)

    err, _ = check_routings(custom, torch.empty(4, 32), sets, x, w1, w2)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "checkAllclose" in ln]
    assert err > 0.5 and len(lines) == 1 and lines[0].startswith("[checkAllclose") and "failed!" in lines[0]


def test_bench_cli_all_keeps_extra_benchmarks_named_beside_it(monkeypatch, tmp_path):
    """`all` runs every benchmark of BENCHES; an EXTRA one named beside it (the partition sweep) runs too, once
    (it was dropped: "all" replaced the whole list); an unknown name is still refused."""
    import torch

    from hipkern import bench
    from hipkern.bench import __main__ as cli

    ran = []
    fake = lambda name: lambda out, quick=False: ran.append(name) or 0  # noqa: E731
    monkeypatch.setattr(cli, "BENCHES", {n: fake(n) for n in ("moe", "paged_attention", "topk_softmax")})
    monkeypatch.setattr(cli, "EXTRA", {"paged_attention_sweep": fake("paged_attention_sweep")})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "device_line", lambda: "device: test")
    assert cli.main(["all", "paged_attention_sweep", "--out", str(tmp_path)]) == 0
    assert ran == ["moe", "paged_attention", "topk_softmax", "paged_attention_sweep"]
    ran.clear()
    assert cli.main(["paged_attention_sweep", "all", "moe", "--out", str(tmp_path)]) == 0
    assert ran == ["moe", "paged_attention", "topk_softmax", "paged_attention_sweep"]
    ran.clear()
    assert cli.main(["all", "--out", str(tmp_path)]) == 0
    assert ran == ["moe", "paged_attention", "topk_softmax"]
    with pytest.raises(SystemExit):
        cli.main(["all", "nonsense"])


def test_moe_fp32_128_token_floors_are_the_larger_of_weights_and_arithmetic():
    """The issue's floors for the fp32 Mixtral-like 128-token shapes: the weights at 3.0 TB/s (uniform: 1.6 /
    4.3 ms) or the arithmetic at 52 TFLOP/s (1.5 / 4.0 ms), the larger. Skewed routing reads 2 experts' weights
    (0.4 ms at I 6144), so its bar is 1.3x its arithmetic (1486.8 us): 1932.9 us."""
    u = _moe("float32", 128, 8192, 6144, 8, 2, "uniform", 1700.0, 4831.8)
    sk = _moe("float32", 128, 8192, 6144, 8, 2, "skewed", 2050.0, 1207.96)
    assert bars.moe_arithmetic_us(u) == pytest.approx(1486.8, abs=0.1)
    lines = bars.moe([u, sk])
    assert "<= 2094 us (1.3x the larger floor: weights 1611 us, arithmetic 1487 us)" in lines[0]
    assert "<= 1933 us (1.3x the larger floor: weights 403 us, arithmetic 1487 us)" in lines[1]
    assert _verdicts(lines[:2], "") == ["met", "NOT met"]
    # the skew bar: 0.589 / 2.842 TB/s = 0.207, under 0.909 of it; 2.584 TB/s over 1207.96 MB is 467.5 us, in
    # which 77.3 GFLOP ask 165 TFLOP/s
    assert "0.207 of uniform's TB/s (2050.0 us), bar >= 1/1.1 = 0.909 (2.584 TB/s): NOT met" in lines[2]
    assert lines[2].endswith(" [the bar's time asks 165 TFLOP/s of fp32 arithmetic, 3.2x the issue's 52]")


def test_moe_skew_arithmetic_note_only_where_the_bar_asks_more_than_52_tflops():
    """bf16 skew lines carry no such note, nor fp32 ones whose bar asks no more than the issue's 52 TFLOP/s."""
    rows = [_moe("float32", 32, 7168, 256, 256, 8, "uniform", 300.0, 800.0),
            _moe("float32", 32, 7168, 256, 256, 8, "skewed", 80.0, 176.2),
            _moe("bfloat16", 128, 8192, 6144, 8, 2, "uniform", 1000.0, 2415.9),
            _moe("bfloat16", 128, 8192, 6144, 8, 2, "skewed", 1000.0, 604.0)]
    assert not any("TFLOP/s of fp32" in line for line in bars.moe(rows))


def test_moe_check_covers_every_timed_routing():
    """The benchmark times some cases over three routings; a kernel wrong on any one of them (or leaving an
    element of the poisoned output unwritten) fails the row's check, not only one wrong on the first."""
    from hipkern.bench.moe import check_routings
    from hipkern.reference import fused_moe_ref

    g = torch.Generator().manual_seed(0)
    t, d, i, e, k = 3, 16, 8, 6, 2
    x = torch.randn(t, d, generator=g)
    w1, w2 = torch.randn(e, 2 * i, d, generator=g) * 0.3, torch.randn(e, d, i, generator=g) * 0.3
    sets = [(torch.rand(t, k, generator=g), torch.randint(0, e, (t, k), generator=g, dtype=torch.int32))
            for _ in range(3)]
    out = torch.empty_like(x)

    def right(w, ids):
        return out.copy_(fused_moe_ref(x, w1, w2, w, ids))

    def wrong_on(j):
        def custom(w, ids):
            right(w, ids)
            if ids is sets[j][1]:
                out[0, 0] += 1.0
            return out
        return custom

    def unwritten(w, ids):
        out[1:] = fused_moe_ref(x, w1, w2, w, ids)[1:]
        return out

    assert check_routings(right, out, sets, x, w1, w2)[0] == 0
    for j in range(3):
        err, max_err = check_routings(wrong_on(j), out, sets, x, w1, w2)
        assert err > 0 and max_err == pytest.approx(1.0, rel=1e-4), j
    err, max_err = check_routings(unwritten, out, sets, x, w1, w2)
    assert err > 0 and math.isnan(max_err)
