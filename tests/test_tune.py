"""The tuner (hipkern.tune) on the CPU with a fake op whose timings are deterministic: candidates, rows,
merging, Ctrl-C, resuming, the report, and sharding over worker processes (which import this module
as test_tune). The paged-attention adapter: tests/test_tune_paged_attention.py."""
import contextlib
import csv
import os
from pathlib import Path

import pytest
import torch

from hipkern import tuning_db
from hipkern.tune import core, runner
from hipkern.tune.__main__ import main, parse_gpus, parse_where
from hipkern.tune.core import Candidate, Pruned, dedupe, merge_best
from hipkern.tune.report import report, report_rows

TESTS = Path(__file__).resolve().parent
FAKE_SCHEMA = tuning_db.Schema(op="faketune", exact_keys=("kind", "width"), bucket_keys=("batch",),
                               param_keys=("tile",), variants=frozenset("abcde"), param_ranges={"tile": (1, 64)})
tuning_db.register(FAKE_SCHEMA)
# us per batch element: a is the heuristic, b[tile=2] the best; c leaves an element unwritten (NaN),
# d computes wrong values, e raises: all three rejected although "fastest".
COST = {"a": 10.0, "b": 8.0, "c": 1.0, "d": 2.0, "e": 3.0}
KINDS = ("ok", "interrupt", "crash_cand", "crash_prep", "prep_once", "bad_prep")
CALLS = []  # (shape label, candidate) run in this process
STATE = {"clock": 0.0, "interrupts": 0}


class FakeBench:
    def __init__(self, s):
        self.s, self.cand, self.nbytes = s, None, 1000 * s["batch"]
        self.ref, self.tol = torch.arange(s["width"], dtype=torch.float32), dict(rtol=1e-3, atol=1e-3)

    @contextlib.contextmanager
    def use(self, cand):
        self.cand = cand
        yield
        self.cand = None

    def new_output(self):
        return torch.empty(self.s["width"])

    def call(self, out):
        v, kind = self.cand.variant, self.s["kind"]
        CALLS.append((FakeTuner().describe(self.s), self.cand.name))
        if kind == "crash_cand" and self.cand.name == "b[tile=2]":
            os._exit(4)
        if kind == "interrupt" and v == "d" and STATE["interrupts"] > 0:
            STATE["interrupts"] -= 1
            raise KeyboardInterrupt
        if v == "e":
            raise RuntimeError("launch failed: boom")
        out[: -1 if v == "c" else None] = (self.ref + (v == "d"))[: -1 if v == "c" else None]

    def checked(self, out):
        return out, self.ref

    def time_us(self):
        return COST[self.cand.variant] * self.s["batch"] * (0.75 if self.cand.kwargs.get("tile") == 2 else 1.0)


class FakeTuner:
    op, schema = "faketune", FAKE_SCHEMA

    def parse_shape(self, raw):
        s = {"kind": str(raw["kind"]), "width": int(raw["width"]), "batch": int(raw["batch"])}
        if s["kind"] not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {s['kind']!r}")
        return s

    def describe(self, s):
        return f"{s['kind']} w{s['width']} b{s['batch']}"

    def order(self, s):
        return (s["batch"], s["kind"])

    def device_info(self, device):
        return {"arch": "sm_90", "cu_count": 132}

    def info_for(self, arch, cu_count):
        return {"arch": arch, "cu_count": cu_count}

    def heuristic(self, s, info):
        return Candidate("a")

    def candidates(self, s, info):
        kept, same = dedupe([(Candidate("a"), "a"), (Candidate("b"), "b1"), (Candidate.of("b", tile=1), "b1"),
                             (Candidate.of("b", tile=2), "b2"), (Candidate("c"), "c"), (Candidate("d"), "d"),
                             (Candidate("e"), "e")])
        return Pruned([c for c, _ in kept], same)

    def estimate_s(self, s, cands, info):
        return 0.01 * len(cands) * s["batch"]

    def prepare(self, s, info, device):
        STATE["clock"] += 10.0
        marker = Path(os.environ.get("FAKE_TUNE_DIR", "/nonexistent")) / "crashed"
        if s["kind"] == "crash_prep" or (s["kind"] == "prep_once" and not marker.exists()):
            marker.touch()
            os._exit(5)
        if s["kind"] == "bad_prep":
            raise RuntimeError("out of memory")
        return FakeBench(s)


FAKE = FakeTuner()


def shapes(*specs):
    """specs: (kind, batch) -> fake shapes of width 8."""
    return core.parse_shapes(FAKE, [("test", {"kind": k, "width": 8, "batch": b}) for k, b in specs])


def reset_fake(monkeypatch, tmp_path, tuning_results) -> Path:
    """The fake op's state reset; its results file (tests/test_tune_review.py's fixture uses it too)."""
    CALLS.clear()
    STATE.update(clock=0.0, interrupts=0)
    monkeypatch.setenv("FAKE_TUNE_DIR", str(tmp_path))
    monkeypatch.setenv("HIPKERN_JIT_DIR", str(tmp_path / "jit"))  # (the save lock's directory: core.files_lock)
    monkeypatch.setenv("PYTHONPATH", str(TESTS))  # workers import this module as test_tune
    # the fake op's workers run on no GPU: "--gpus 0,1" on a machine with one GPU made worker 1 fail set_device
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "")
    return tuning_results / "faketune.csv"


@pytest.fixture
def fresh(monkeypatch, tmp_path, tuning_results):
    return reset_fake(monkeypatch, tmp_path, tuning_results)


def rows_of(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def by_key(path):
    return {(r["kind"], int(r["batch"])): r for r in rows_of(path)}


def test_candidate_names_and_dedupe():
    assert Candidate.of("v3", partition_size=256).name == "v3[partition_size=256]" and Candidate("v9").name == "v9"
    kept, same = dedupe([(Candidate("a"), 1), (Candidate.of("a", p=2), 2), (Candidate("b"), 1)])
    assert [c.name for c, _ in kept] == ["a", "a[p=2]"] and same == {"b": "a"}


def test_tune_writes_best_rows_and_rejects_bad_candidates(fresh):
    s = runner.tune(FAKE, shapes(("ok", 1), ("ok", 4)), fresh, progress=False)
    assert len(s.done) == 2 and s.rejected == 6 and not s.failed
    best = by_key(fresh)
    assert list(rows_of(fresh)[0]) == list(FAKE_SCHEMA.columns)  # the database has exactly the schema's columns
    assert [(r["variant"], r["tile"], float(r["us"])) for r in best.values()] == [("b", "2", 6.0), ("b", "2", 24.0)]
    assert best[("ok", 4)]["tbps"] == f"{4000 / 24.0 / 1e6:.4f}"
    cand = {(r["batch"], r["variant"], r["tile"]): r for r in rows_of(core.candidates_path(fresh))}
    assert len(cand) == 12  # 6 candidates per shape: b[tile=1] is b's launch, timed once
    assert ("1", "b", "1") not in cand and cand[("1", "a", "")]["status"] == "ok"
    assert "non-finite" in cand[("1", "c", "")]["note"] and cand[("1", "c", "")]["status"] == "rejected"
    assert "checkAllclose mismatch" in cand[("1", "d", "")]["note"]
    assert cand[("1", "e", "")]["note"] == "RuntimeError: launch failed: boom" and cand[("1", "e", "")]["us"] == ""


def test_rows_round_trip_through_tuning_db_lookup(fresh, monkeypatch):
    runner.tune(FAKE, shapes(("ok", 2)), fresh, progress=False)
    monkeypatch.setenv("HIPKERN_TUNING_DB", str(fresh))
    tuning_db.reset()
    c = tuning_db.lookup("faketune", "sm_90", 132, kind="ok", width=8, batch=2)
    assert (c.variant, c.params, c.source) == ("b", {"tile": 2}, "exact")
    assert tuning_db.lookup("faketune", "sm_90", 132, kind="ok", width=8, batch=8).source == "nearest"


def test_merge_rule():
    def r(variant, us, date, batch=1, status="ok"):
        return dict(arch="sm_90", cu_count=132, variant=variant, us=us, date=date, kind="ok", width=8, batch=batch,
                    tile="", status=status)

    rows = [r("a", 10, "2026-11-01"), r("b", 9, "2026-10-01"), r("c", 1, "2026-11-05", status="rejected"),
            r("z", 0.5, "2026-11-05"),  # a variant the op no longer has
            r("a", 5, "2026-11-01", 2), r("b", 5, "2026-11-02", 2), r("c", 5, "2026-11-02", 2), r("d", 7, "", 2)]
    assert [x["variant"] for x in merge_best(FAKE_SCHEMA, rows)] == ["b", "c"]  # c: same us and date, later row
    assert merge_best(FAKE_SCHEMA, rows[:2] + [r("a", 9, "2026-11-03")])[0]["date"] == "2026-11-03"


def test_a_faster_row_survives_unless_its_candidate_is_measured_again(fresh):
    runner.tune(FAKE, shapes(("ok", 1)), fresh, progress=False)
    old = rows_of(fresh)
    old[0].update(variant="a", tile="7", us="1.000", date="2026-01-01")  # a candidate this run does not time
    core.write_csv(fresh, old, FAKE_SCHEMA.columns)
    runner.tune(FAKE, shapes(("ok", 1)), fresh, progress=False)
    assert [(r["variant"], r["tile"], r["us"]) for r in rows_of(fresh)] == [("a", "7", "1.000")]
    # an older, faster time of a candidate timed again (code since changed) is replaced by the new one
    old = rows_of(fresh)
    old[0].update(variant="a", tile="", us="1.000", date="2026-01-01")
    core.write_csv(fresh, old, FAKE_SCHEMA.columns)
    runner.tune(FAKE, shapes(("ok", 1)), fresh, progress=False)
    assert [r["variant"] + r["tile"] for r in rows_of(fresh)] == ["b2"]  # the run's best: a times 10 again
    assert b"\r" not in fresh.read_bytes() + core.candidates_path(fresh).read_bytes()  # LF, as shipped
    new = core.make_row(FAKE_SCHEMA, FAKE.device_info(0), shapes(("ok", 8))[0], Candidate("a"), "ok", 3.0, 1, 0.0,
                        "", {"date": "2026-11-21", "commit": ""})
    core.save(FAKE_SCHEMA, fresh, [new], complete_keys=set())
    assert len(rows_of(fresh)) == 1 and len(rows_of(core.candidates_path(fresh))) == 7


def test_the_default_keeps_a_shape_unless_beaten_by_more_than_the_margin(fresh, monkeypatch):
    # b[tile=2] times 0.75 x COST["b"]: the default "a" within DEFAULT_MARGIN of it keeps the shape
    monkeypatch.setitem(COST, "a", 0.75 * COST["b"] * (1 + core.DEFAULT_MARGIN / 2))
    runner.tune(FAKE, shapes(("ok", 1)), fresh, progress=False)
    assert [r["variant"] + r["tile"] for r in rows_of(fresh)] == ["a"]
    monkeypatch.setitem(COST, "a", 0.75 * COST["b"] * (1 + 2 * core.DEFAULT_MARGIN))  # now beaten by more
    runner.tune(FAKE, shapes(("ok", 1)), fresh, progress=False)
    assert [r["variant"] + r["tile"] for r in rows_of(fresh)] == ["b2"]
    # the database's row of a candidate this run does not time again (as when a change of the tuner's grid
    # names its launch differently) is held to the same margin: the default within it takes the shape
    monkeypatch.setitem(COST, "a", 0.75 * COST["b"] * (1 + core.DEFAULT_MARGIN / 2))
    stale = dict(rows_of(fresh)[0], variant="e", tile="9", us=f"{0.75 * COST['b']:.3f}")
    core.write_csv(fresh, [stale], FAKE_SCHEMA.columns)
    cands = rows_of(core.candidates_path(fresh))
    core.write_csv(core.candidates_path(fresh), cands + [dict(cands[0], **stale, status="ok", note="")],
                   FAKE_SCHEMA.columns + core.STATUS_COLUMNS)
    runner.tune(FAKE, shapes(("ok", 1)), fresh, progress=False)
    assert [r["variant"] + r["tile"] for r in rows_of(fresh)] == ["a"]


MEASURED = tuning_db.Schema(op="faketune_measured", exact_keys=("kind", "width"), bucket_keys=("batch",),
                            param_keys=("tile",), variants=frozenset("abcde"), measures=("alt_us",))
tuning_db.register(MEASURED)


def test_the_first_measure_decides_among_the_candidates_within_the_window():
    m, w = core.DEFAULT_MARGIN, core.SECOND_WINDOW

    def pick(*specs):  # (variant, us, alt_us); "a" is the default
        rows = [dict(arch="sm_90", cu_count=132, variant=v, us=str(us), alt_us=str(alt), kind="ok", width=8,
                     batch=1, tile="", status="ok", date="") for v, us, alt in specs]
        return sorted(r["variant"] for r in core.prefer_default(MEASURED, rows, lambda row: "a"))

    assert pick(("a", 100, 50), ("b", 99 * (1 + w / 2), 20), ("c", 99, 40)) == ["b"]  # in the window, far better on alt
    assert pick(("a", 100, 50), ("b", 99, 50 / (1 + m / 2))) == ["a"]  # better on alt, but within the margin
    assert pick(("a", 110, 50), ("b", 100 * (1 + 2 * w), 1), ("c", 100, 60)) == ["c"]  # b outside the window
    assert pick(("a", 110, 10), ("c", 100, 60), ("d", 104, 30)) == ["d"]  # the default out; d beats c on alt
    assert pick(("a", 100, 50), ("b", 104, "")) == ["a"]  # a candidate in the window not timed on alt: us decides
    assert pick(("a", 110, 50), ("b", 100, ""), ("c", 101, 1)) == ["a", "b", "c"]  # then merge_best's lowest us
    x = core.SECOND_EXCHANGE  # b loses 3 % on us: it must gain more than 3x % on alt
    assert pick(("a", 100, 50), ("b", 103, 50 / (1 + 0.03 * x * 0.9))) == ["a"]
    assert pick(("a", 100, 50), ("b", 103, 50 / (1 + 0.03 * x * 1.1))) == ["b"]
    assert pick(("a", 100, 50), ("b", 99, 50 / (1 + m * 1.5))) == ["b"]  # a gain on both (b within the margin)
    # the window's fastest on alt does not pay for its loss, a nearer one does: the nearer one
    assert pick(("a", 100, 50), ("b", 103, 50 / 1.05), ("c", 100.5, 50 / (1 + 2 * m))) == ["c"]


class MeasuredBench(FakeBench):
    def time_measures(self):  # c and d are rejected before; e raises; b[tile=2] is slow here, a fast
        return {"alt_us": {"a": 1.0, "b": 5.0}[self.cand.variant] * (2.0 if self.cand.kwargs.get("tile") == 2 else 1.0)}


class MeasuredTuner(FakeTuner):
    op, schema = "faketune_measured", MEASURED

    def prepare(self, s, info, device):
        return MeasuredBench(s)


def test_a_run_records_the_measures_and_weighs_the_first(tmp_path, monkeypatch):
    out = tmp_path / "faketune_measured.csv"
    tuner = MeasuredTuner()
    # "a" slower than b[tile=2] by more than the margin but within the window, and 10x faster on
    # alt_us: a takes the shape (on us alone b[tile=2] would)
    monkeypatch.setitem(COST, "a", 0.75 * COST["b"] * (1 + (core.DEFAULT_MARGIN + core.SECOND_WINDOW) / 2))
    runner.tune(tuner, shapes(("ok", 1)), out, progress=False, info={"arch": "sm_90", "cu_count": 132})
    assert [(r["variant"], r["alt_us"]) for r in rows_of(out)] == [("a", "1.000")]
    log = {r["variant"] + r["tile"]: r for r in rows_of(core.candidates_path(out))}
    assert (log["b2"]["alt_us"], log["b"]["alt_us"], log["c"]["alt_us"]) == ("10.000", "5.000", "")
    assert list(rows_of(out)[0]) == list(MEASURED.columns) and MEASURED.columns[-1] == "alt_us"
    # a bench whose time_measures misses the column: the candidate is rejected, never chosen
    monkeypatch.setattr(MeasuredBench, "time_measures", lambda self: {})
    runner.tune(tuner, shapes(("ok", 2)), out, progress=False, info={"arch": "sm_90", "cu_count": 132})
    notes = {r["note"] for r in rows_of(core.candidates_path(out)) if r["batch"] == "2" and r["variant"] in "ab"}
    assert notes == {"time_measures gave [], not ['alt_us']"}
    assert [r["batch"] for r in rows_of(out)] == ["1"]


def test_skip_done_restores_missing_database_rows_and_bad_files_are_named(fresh):
    runner.tune(FAKE, shapes(("ok", 1)), fresh, progress=False)
    fresh.unlink()  # e.g. killed between writing the candidates file and the database
    CALLS.clear()
    s = runner.tune(FAKE, shapes(("ok", 1)), fresh, skip_done=True, progress=False)
    # only e, rejected for an error (not a wrong result), is measured again
    assert CALLS == [("ok w8 b1", "e")] and not s.failed and by_key(fresh)[("ok", 1)]["variant"] == "b"
    fresh.write_text(fresh.read_text().replace("6.000", "fast"))
    CALLS.clear()
    with pytest.raises(ValueError, match=r"faketune.csv, line 2: not a faketune tuning row"):
        runner.tune(FAKE, shapes(("ok", 2)), fresh, progress=False)
    assert not CALLS  # before any timing


def test_rows_from_before_the_device_column_are_named_and_counted_by_a_dry_run_of_their_device(fresh, capsys):
    """A database written before the device column: a run on a named GPU says that those rows stand for every
    GPU and are neither skipped nor replaced by it; a dry run given --device-name counts that device's rows
    for --skip-done (and only its own)."""
    runner.tune(FAKE, shapes(("ok", 1), ("ok", 2)), fresh, progress=False)
    for path in (fresh, core.candidates_path(fresh)):  # as a file from before the column
        path.write_text("\n".join(",".join(f for n, f in enumerate(line.split(",")) if n != 2)
                                  for line in path.read_text().splitlines()) + "\n")
    capsys.readouterr()
    runner.tune(FAKE, shapes(("ok", 1)), fresh, skip_done=True, progress=False, dry_run=True,
                info={**FAKE.device_info(0), "device": "GPU A"})
    out = capsys.readouterr().out
    assert "name no device (written before the column)" in out and "1 shapes to tune (0 of 1 done already)" in out
    runner.tune(FAKE, shapes(("ok", 1), ("ok", 2)), fresh, progress=False,
                info={**FAKE.device_info(0), "device": "GPU A"})
    cmd = ["test_tune:FakeTuner", "--shape", "kind=ok,width=8,batch=1", "--out", str(fresh), "--skip-done",
           "--dry-run", "--arch", "sm_90", "--cu-count", "132"]
    assert main(cmd + ["--device-name", "GPU A"]) == 0  # its rows count: done but e (rejected for an error)
    assert "1 shapes to tune (0 of 1 done already), 1 candidates" in capsys.readouterr().out
    assert main(cmd + ["--device-name", "GPU B"]) == 0
    assert "1 shapes to tune (0 of 1 done already), 6 candidates" in capsys.readouterr().out


def test_gpus_of_two_devices_are_refused(monkeypatch):
    names = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA H200"}
    monkeypatch.setattr(FAKE, "device_info", lambda g: {"arch": "sm_90", "cu_count": 132, "device": names[g]})
    with pytest.raises(ValueError, match="--gpus: the GPUs differ"):
        runner.device_info(FAKE, [0, 1])
    assert runner.device_info(FAKE, [1])["device"] == "NVIDIA H200"


def test_ctrl_c_keeps_finished_rows_and_skip_done_resumes(fresh):
    STATE["interrupts"] = 1
    todo = shapes(("ok", 1), ("ok", 2), ("interrupt", 4), ("ok", 8))
    with pytest.raises(KeyboardInterrupt):
        runner.tune(FAKE, todo, fresh, progress=False)
    assert set(by_key(fresh)) == {("ok", 1), ("ok", 2)}  # the interrupted shape is unfinished: not chosen yet
    measured = {(r["kind"], r["variant"] + r["tile"]) for r in rows_of(core.candidates_path(fresh))}
    assert {m for m in measured if m[0] == "interrupt"} == {("interrupt", x) for x in ("a", "b", "b2", "c")}
    CALLS.clear()
    s = runner.tune(FAKE, todo, fresh, skip_done=True, progress=False)
    assert s.skipped == 0 and len(s.done) == 4  # (ok 1 and ok 2: e, rejected for an error, again)
    # the interrupted shape (d and e never measured) whole, so its choice compares one run's times; of the finished
    # ones, only e (rejected for an error) again
    measured_again = [("ok w8 b1", "e"), ("ok w8 b2", "e")]
    measured_again += [(s, c) for s in ("interrupt w8 b4", "ok w8 b8") for c in ("a", "b", "b[tile=2]", "c", "d", "e")]
    assert sorted(set(CALLS)) == sorted(measured_again)  # (a candidate that passes is called twice: set)
    best = by_key(fresh)
    assert len(best) == 4 and (best[("interrupt", 4)]["variant"], best[("interrupt", 4)]["tile"]) == ("b", "2")


def test_an_interrupted_re_tune_keeps_the_shape_s_old_row(fresh):
    """A shape tuned before and re-tuned with a Ctrl-C half way: its database row stays until a re-tune
    of it completes (it had been dropped with nothing in its place)."""
    runner.tune(FAKE, shapes(("interrupt", 4), ("ok", 1)), fresh, progress=False)
    before = by_key(fresh)
    assert set(before) == {("interrupt", 4), ("ok", 1)}
    STATE["interrupts"] = 1
    with pytest.raises(KeyboardInterrupt):
        runner.tune(FAKE, shapes(("interrupt", 4)), fresh, progress=False)
    after = by_key(fresh)
    assert set(after) == {("interrupt", 4), ("ok", 1)}
    assert after[("interrupt", 4)] == before[("interrupt", 4)]


def test_time_limit_stops_between_shapes(fresh, monkeypatch):
    monkeypatch.setattr(core, "_now", lambda: STATE["clock"])  # prepare() advances the clock by 10 s
    s = runner.tune(FAKE, shapes(("ok", 1), ("ok", 2), ("ok", 4)), fresh, time_limit=15, progress=False)
    assert s.stopped and sorted(by_key(fresh)) == [("ok", 1), ("ok", 2)]


def test_two_devices_of_one_arch_keep_their_rows_and_report_apart(fresh):
    """Two GPUs of one arch and CU count (an H100 and an H200) tuning into one file: each keeps its rows (the
    faster device's do not replace the other's), and the report shows the device and sums each up apart."""
    for device in ("GPU A", "GPU B"):
        runner.tune(FAKE, shapes(("ok", 1), ("ok", 4)), fresh, progress=False,
                    info={**FAKE.device_info(0), "device": device})
    assert sorted((r["device"], r["batch"]) for r in rows_of(fresh)) == [
        ("GPU A", "1"), ("GPU A", "4"), ("GPU B", "1"), ("GPU B", "4")]
    text = report(FAKE, fresh)
    assert text.splitlines()[0].startswith("device ") and text.count("GPU A   ok w8 b") == 2
    assert "GPU A: tuned vs the default (a)" in text and "GPU B: tuned vs the default (a)" in text


def test_report_table(fresh, capsys):
    runner.tune(FAKE, shapes(("ok", 1), ("ok", 4)), fresh, progress=False)
    rows = report_rows(FAKE, fresh)
    assert [(r["chosen"], r["us"], r["default_us"], r["b_us"], r["c_us"]) for r in rows] == [
        ("b[tile=2]", 6.0, 10.0, 8.0, None), ("b[tile=2]", 24.0, 40.0, 32.0, None)]
    text = report(FAKE, fresh)
    assert "ok w8 b4  b[tile=2]  24.00" in text and text.splitlines()[2].endswith("1.67")
    assert "tuned vs the default (a): geometric-mean gain 1.667x over 2 of 2 shapes" in text
    assert "tuned vs the best single fixed variant (b): geometric-mean gain 1.333x" in text
    assert "c with its defaults has no accepted time on 2 shapes" in text
    assert main(["report", "test_tune:FakeTuner", "--out", str(fresh)]) == 0
    assert "b[tile=2]" in capsys.readouterr().out
    with pytest.raises(ValueError, match="has no tuned rows"):
        report(FAKE, fresh.with_name("none.csv"))


def test_plain_progress_without_tqdm(monkeypatch, capsys):
    monkeypatch.setattr(runner, "_tqdm", None)
    p = runner.Progress(total=2, enabled=True)
    p.update("x")
    p.update("y")
    assert "[tune] 2/2 candidates" in capsys.readouterr().out


def test_two_workers_share_the_shapes_and_a_crashed_one_is_retried(fresh):
    todo = shapes(("ok", 1), ("ok", 2), ("ok", 4), ("ok", 8), ("prep_once", 16))
    s = runner.tune(FAKE, todo, fresh, spec="test_tune:FakeTuner", gpus=[0, 1], progress=False)
    assert len(s.done) == 5 and not s.failed and set(s.per_gpu) == {0, 1}
    assert len(s.crashes) == 1 and "crashed (exit code 5)" in s.crashes[0]
    assert len(by_key(fresh)) == 5 and {r["variant"] + r["tile"] for r in rows_of(fresh)} == {"b2"}


def test_crashing_candidate_is_rejected_and_the_rest_go_on(fresh):
    todo = shapes(("ok", 1), ("crash_cand", 2), ("ok", 4), ("crash_prep", 8))
    s = runner.tune(FAKE, todo, fresh, spec="test_tune:FakeTuner", gpus=[0, 1], progress=False)
    assert set(s.failed) == {3} and "crashed twice" in s.failed[3] and len(s.done) == 3
    cand = {(r["kind"], r["variant"] + r["tile"]): r for r in rows_of(core.candidates_path(fresh))}
    assert cand[("crash_cand", "b2")]["status"] == "rejected"
    assert "worker crashed (exit code 4)" in cand[("crash_cand", "b2")]["note"]
    assert {k for k in cand if k[0] == "crash_cand"} == {("crash_cand", x) for x in ("a", "b", "b2", "c", "d", "e")}
    best = by_key(fresh)
    assert set(best) == {("ok", 1), ("crash_cand", 2), ("ok", 4)} and best[("crash_cand", 2)]["variant"] == "b"


def test_cli_exit_code_says_whether_every_shape_was_tuned(fresh):
    argv = ["test_tune:FakeTuner", "--shape", "kind=ok,width=8,batch=2", "--out", str(fresh), "--no-progress"]
    assert main(argv) == 0 and len(rows_of(fresh)) == 1
    assert main(argv[:3] + ["--shape", "kind=bad_prep,width=8,batch=4"] + argv[3:]) == 1
    assert ("bad_prep", 4) not in by_key(core.candidates_path(fresh)) and set(by_key(fresh)) == {("ok", 2)}


@pytest.mark.parametrize("argv,msg", [
    (["nosuchop"], "op must be one of"),
    (["test_tune:FakeTuner", "--gpus", "0,x"], "--gpus must be comma-separated"),
    (["test_tune:FakeTuner", "--time-limit", "0"], "--time-limit must be a positive"),
    (["test_tune:FakeTuner", "--arch", "sm_90"], "--arch/--cu-count/--device-name only apply to --dry-run"),
    (["test_tune:FakeTuner", "--cu-count", "0"], "--arch/--cu-count/--device-name only apply to --dry-run"),
    (["test_tune:FakeTuner", "--device-name", "X"], "--arch/--cu-count/--device-name only apply to --dry-run"),
    (["test_tune:FakeTuner", "--dry-run", "--arch", "sm_90"], "with both --arch and --cu-count"),
    (["test_tune:FakeTuner", "--dry-run", "--device-name", "X"], "with both --arch and --cu-count"),
    (["test_tune:FakeTuner", "--dry-run", "--arch", "sm_90", "--cu-count", "0"], "--cu-count must be a positive"),
    (["test_tune:FakeTuner", "--dry-run", "--arch", "sm_90", "--cu-count", "-5"], "--cu-count must be a positive"),
    (["test_tune:FakeTuner", "--shapes", "/nonexistent.csv"], "--shapes: /nonexistent.csv does not exist"),
    (["test_tune:FakeTuner", "--shape", "kind=ok,width=8,batch=3"], "batch='3' must be a power of two"),
    (["test_tune:FakeTuner", "--shape", "kind=ok,width"], "--shape must be key=value"),
    (["test_tune:FakeTuner", "--shape", "kind=odd,width=8,batch=2"], "kind must be one of"),
    (["test_tune:FakeTuner", "--shape", "kind=ok,batch=2"], r"missing \['width'\]"),
    (["test_tune:FakeTuner", "--shape", "kind=ok,width=8,batch=2", "--where", "nokey=1"], "--where keys must be"),
    (["test_tune:FakeTuner", "--shape", "kind=ok,width=8,batch=2", "--where", "kind=x"], "no faketune shapes selected"),
])
def test_bad_cli_input_is_a_value_error(argv, msg, fresh):
    with pytest.raises(ValueError, match=msg):
        main(argv)


def test_a_misspelt_arch_is_named_before_any_work(fresh):
    from hipkern.jit import JitError

    with pytest.raises(JitError, match="arch 'sm90' is not a GPU architecture name"):
        main(["test_tune:FakeTuner", "--dry-run", "--arch", "sm90", "--cu-count", "132"])
    with pytest.raises(JitError, match="arch 'gfx' is not a GPU architecture name"):
        main(["report", "test_tune:FakeTuner", "--arch", "gfx"])


def _save_rows(out, widths):
    """One tuner's saves, a shape at a time (a worker process of the test below)."""
    for w in widths:
        row = core.make_row(FAKE_SCHEMA, FAKE.device_info(0), {"kind": "ok", "width": w, "batch": 1}, Candidate("a"),
                            "ok", 1.0 + w, 1, 0.0, "", {"date": "2026-11-28", "commit": ""})
        core.save(FAKE_SCHEMA, out, [row], complete_keys={core.row_key(FAKE_SCHEMA, row)})


def test_two_tuners_saving_into_the_same_files_keep_every_row(tmp_path):
    """Each save reads, merges and rewrites both files; two processes at once take turns (core.files_lock)
    rather than losing each other's rows or renaming a half-written file into place."""
    import multiprocessing

    out = tmp_path / "faketune.csv"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_save_rows, args=(out, range(i, 160, 2))) for i in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    for path in (out, core.candidates_path(out)):
        assert sorted(int(r["width"]) for r in rows_of(path)) == list(range(160)), path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["faketune.candidates.csv", "faketune.csv"]  # no temporaries


def test_files_name_their_bad_rows_by_line_and_times_must_be_positive(fresh):
    runner.tune(FAKE, shapes(("ok", 1), ("ok", 2)), fresh, progress=False)
    good = fresh.read_text()
    for bad in ("nan", "0", "-6.0", "inf"):
        fresh.write_text(good.replace("6.000", bad))
        with pytest.raises(ValueError, match=r"faketune.csv, line 2: not a faketune tuning row .*not positive"):
            runner.tune(FAKE, shapes(("ok", 4)), fresh, progress=False)
    head, *rows = good.splitlines(keepends=True)
    fresh.write_text(head + rows[0] + "\n\n" + rows[1].replace("ok,8,2", "ok,8,two"))
    with pytest.raises(ValueError, match=r"faketune.csv, line 5: not a faketune tuning row"):
        runner.tune(FAKE, shapes(("ok", 4)), fresh, progress=False)


def test_exact_keys_are_stripped_as_the_lookup_strips_them():
    """A hand-edited "ok " is the shape "ok" for the tuner's merge too, so a re-tune replaces its row."""
    assert core.shape_key(FAKE_SCHEMA, {"kind": "ok ", "width": " 8", "batch": "2"}) == ("ok", "8", 2)


def test_parse_helpers():
    assert parse_gpus("0,1,2") == [0, 1, 2] and parse_gpus(None) is None
    with pytest.raises(ValueError, match=r"--gpus names a GPU twice \('0,1,1'\): each GPU takes one timing worker"):
        parse_gpus("0,1,1")  # two workers timing on one GPU at once
    assert parse_where(["dtype=bfloat16", "batch=8"]) == {"dtype": "bfloat16", "batch": "8"}
    with pytest.raises(ValueError, match="--where must be key=value"):
        parse_where(["dtype"])
    with pytest.raises(ValueError, match="--where names dtype twice \\('bfloat16' and 'float16'\\)"):
        parse_where(["dtype=bfloat16", "dtype=float16"])  # the last one used to win silently


def test_tuning_refuses_modules_built_for_another_arch_than_the_gpu_s(monkeypatch):
    """HIPKERN_ARCH=sm_80 on an H100 runs sm_80 modules through their PTX (`bash .ci/gpu sm80`): their timings
    are neither arch's, so the tuner refuses to file them as sm_80 results; the GPU's own arch (under any of
    its names) is tuned as usual."""
    import types

    from hipkern.jit import platform
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(platform, "_device_arch", lambda index: "sm_90")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(multi_processor_count=132, total_memory=80 << 30,
                                                            name="NVIDIA H100 80GB HBM3"))
    monkeypatch.setenv("HIPKERN_ARCH", "sm_80")
    with pytest.raises(ValueError, match=r"HIPKERN_ARCH=sm_80 builds for sm_80, but GPU 0 is sm_90"):
        core.gpu_info(0)
    for name in ("sm_90", "sm_90a"):
        monkeypatch.setenv("HIPKERN_ARCH", name)
        assert core.gpu_info(0) == {"arch": "sm_90", "cu_count": 132, "device": "NVIDIA H100 80GB HBM3", "wave": 32,
                                    "memory": 80 << 30}
    monkeypatch.delenv("HIPKERN_ARCH")
    assert core.gpu_info(0)["arch"] == "sm_90"


# ---------------------------------------------------------------- from an audit (2026-11-29)
def test_a_candidate_that_breaks_the_gpu_is_settled_for_skip_done(fresh, monkeypatch):
    """A candidate after which the GPU is unusable ends a one-process run; its row says so, and --skip-done counts
    it settled, so the next run goes on past it instead of ending there again."""
    monkeypatch.setattr(core, "_device_usable", lambda: False)  # e raises: as if it left a sticky fault
    todo = shapes(("ok", 1), ("ok", 2))
    first = runner.tune(FAKE, todo, fresh, skip_done=True, progress=False)
    assert len(first.crashes) == 1 and not first.done
    cand = {(r["batch"], r["variant"]): r for r in rows_of(core.candidates_path(fresh))}
    assert cand[("1", "e")]["note"].startswith(core.GPU_FAULT + ": RuntimeError: launch failed")
    second = runner.tune(FAKE, todo, fresh, skip_done=True, progress=False)  # shape 1 settled; shape 2 reaches e
    assert set(by_key(fresh)) == {("ok", 1)} and by_key(fresh)[("ok", 1)]["variant"] == "b"
    assert len(second.crashes) == 1
    third = runner.tune(FAKE, todo, fresh, skip_done=True, progress=False)
    assert by_key(fresh)[("ok", 2)]["variant"] == "b" and not third.crashes


class _Renamed(FakeTuner):
    """The fake op after a change: b[tile=2] now launches what plain b launches (pruned as the same launch)."""

    def candidates(self, s, info):
        kept, same = dedupe([(Candidate("a"), "a"), (Candidate("b"), "b2"), (Candidate.of("b", tile=1), "b1"),
                             (Candidate.of("b", tile=2), "b2")])
        return Pruned([c for c, _ in kept], same)


def test_a_candidate_pruned_as_the_same_launch_does_not_compete_with_its_old_time(fresh, monkeypatch):
    """A full re-tune chooses among current times: b[tile=2]'s old 6 us row (its launch is b's now, timed 12 us
    under that name) does not win against the launches timed this run."""
    todo = shapes(("ok", 1))
    runner.tune(FAKE, todo, fresh, progress=False)
    assert (by_key(fresh)[("ok", 1)]["variant"], by_key(fresh)[("ok", 1)]["tile"]) == ("b", "2")
    monkeypatch.setitem(COST, "b", 16.0)  # every b slower: tile 2 (now the same as b) would take 12 us
    runner.tune(_Renamed(), todo, fresh, progress=False)
    row = by_key(fresh)[("ok", 1)]
    assert (row["variant"], row["tile"], float(row["us"])) == ("a", "", 10.0)  # not b[tile=2] at its old 6.000


def test_rows_of_untouched_shapes_this_checkout_cannot_use_are_kept(fresh, capsys):
    """A committed row of another shape with a variant this checkout lacks (a newer one's) survives a run that
    tunes other shapes, with one line saying so."""
    runner.tune(FAKE, shapes(("ok", 1)), fresh, progress=False)
    rows = rows_of(fresh)
    newer = {**rows[0], "variant": "f", "batch": "2"}
    with open(fresh, "a", newline="") as fh:
        csv.DictWriter(fh, fieldnames=list(rows[0])).writerow(newer)
    capsys.readouterr()
    runner.tune(FAKE, shapes(("ok", 4)), fresh, progress=False)
    assert {(r["variant"], r["batch"]) for r in rows_of(fresh)} == {("b", "1"), ("f", "2"), ("b", "4")}
    assert "keeps 1 rows of other shapes that this checkout's faketune cannot use" in capsys.readouterr().out


def test_files_with_a_byte_order_mark_are_read(fresh, tmp_path):
    """As tuning_db reads them (spreadsheets save one): the database, and a shapes list."""
    runner.tune(FAKE, shapes(("ok", 1)), fresh, progress=False)
    fresh.write_bytes(b"\xef\xbb\xbf" + fresh.read_bytes())
    listed = tmp_path / "shapes.csv"
    listed.write_bytes(b"\xef\xbb\xbfkind,width,batch\nok,8,2\n")
    todo = core.read_shapes(FAKE, str(listed))
    runner.tune(FAKE, todo, fresh, progress=False)
    assert set(by_key(fresh)) == {("ok", 1), ("ok", 2)}
