"""The tuner where a user committing CSVs trips (a review of 2026-11-28), on the fake op of test_tune: a re-tune
whose candidates all fail, rows the loader would skip, a bad --out, the commit stamp, two tuners saving into one
file, a GPU with no rows of its own, --dry-run without a GPU; and (GPU) the fused_moe adapter's skewed check."""
from pathlib import Path

import pytest
import torch

import test_tune
from hipkern import tuning_db
from hipkern.tune import core, runner
from hipkern.tune.__main__ import main
from hipkern.tune.core import Candidate
from test_tune import CALLS, FAKE, FAKE_SCHEMA, by_key, rows_of, shapes

INFO = {"arch": "sm_90", "cu_count": 132}
STAMP = {"date": "2026-11-28", "commit": "abc"}


@pytest.fixture
def fresh(monkeypatch, tmp_path, tuning_results):
    return test_tune.reset_fake(monkeypatch, tmp_path, tuning_results)


def _row(cand, us, batch=1, **over):
    row = core.make_row(FAKE_SCHEMA, INFO, {"kind": "ok", "width": 8, "batch": batch}, cand, "ok", us, 1e6, 0.0, "",
                        STAMP)
    return {**row, **over}


def test_a_re_tune_whose_candidates_all_fail_keeps_the_row_and_says_so(fresh, monkeypatch):
    """Every candidate failing (a toolchain, the GPU's memory) used to delete the shape's row, exit 0, and leave
    --skip-done nothing to measure."""
    runner.tune(FAKE, shapes(("ok", 1)), fresh, progress=False)
    before = by_key(fresh)[("ok", 1)]
    assert (before["variant"], before["tile"]) == ("b", "2")

    def broken(self, out):
        CALLS.append("broken")
        raise RuntimeError("no kernel image is available")

    with monkeypatch.context() as m:
        m.setattr(test_tune.FakeBench, "call", broken)
        s = runner.tune(FAKE, shapes(("ok", 1)), fresh, progress=False)
    assert s.failed and "every candidate was rejected" in next(iter(s.failed.values())) and not s.done
    assert by_key(fresh)[("ok", 1)] == before
    CALLS.clear()
    s = runner.tune(FAKE, shapes(("ok", 1)), fresh, skip_done=True, progress=False)
    assert len(set(CALLS)) == 6 and not s.failed  # every candidate failed for an error: measured again
    assert (by_key(fresh)[("ok", 1)]["variant"], by_key(fresh)[("ok", 1)]["tile"]) == ("b", "2")


def test_a_candidate_whose_call_after_timing_differs_is_rejected(fresh, monkeypatch):
    """The fastest candidate right on its checked call, then (after its timed calls) leaving an element unwritten
    or writing other bits: rejected as not repeatable, and the next fastest is chosen. A correct candidate runs
    exactly twice (the checked call and the one after timing; the fake's timing calls nothing)."""
    real = test_tune.FakeBench.call
    seen = {}

    def later_wrong(self, out):
        real(self, out)
        n = seen[self.cand.name] = seen.get(self.cand.name, 0) + 1
        if self.cand.name == "b[tile=2]" and n > 1:
            out[3] = out[3] + 1 if self.s["batch"] == 1 else float("nan")

    monkeypatch.setattr(test_tune.FakeBench, "call", later_wrong)
    for batch in (1, 4):
        seen.clear()
        runner.tune(FAKE, shapes(("ok", batch)), fresh, progress=False)
        assert seen["a"] == seen["b"] == 2 and seen["b[tile=2]"] == 2
        row = by_key(fresh)[("ok", batch)]
        assert (row["variant"], row["tile"]) == ("b", ""), batch
        cand = {(r["batch"], r["variant"], r["tile"]): r for r in rows_of(core.candidates_path(fresh))}
        bad = cand[(str(batch), "b", "2")]
        assert bad["status"] == "rejected" and bad["us"] == ""
        assert bad["note"] == "a call after timing differs from the checked one in 1 of 8 output elements " \
                              "(not repeatable)", bad["note"]


def test_skip_done_times_a_shape_with_a_new_candidate_whole(fresh, monkeypatch):
    """A candidate added since a shape was tuned (a new variant, or one the pruning used to drop): --skip-done timed
    it alone, and the shape's choice compared its time with the incumbents' from the earlier run, another machine's
    or another run's speed (on one H200 kind the new candidates came out 2-5 % under their own incumbent default:
    the offset, not the kernel). Now every candidate of such a shape is timed again; a shape with nothing new is not."""
    runner.tune(FAKE, shapes(("ok", 1), ("ok", 2)), fresh, progress=False)
    cands = core.candidates_path(fresh)
    rows = rows_of(cands)
    kept = [r for r in rows if not (r["batch"] == "1" and r["variant"] == "a")]  # as if a were new at batch 1
    core.write_csv(cands, kept, list(rows[0]))
    CALLS.clear()
    s = runner.tune(FAKE, shapes(("ok", 1), ("ok", 2)), fresh, skip_done=True, progress=False)
    assert not s.failed
    assert set(CALLS) == {("ok w8 b1", c) for c in ("a", "b", "b[tile=2]", "c", "d", "e")} | {("ok w8 b2", "e")}


def test_the_save_lock_lives_in_the_user_s_private_cache(fresh, tmp_path):
    """The lock over a save was a predictable file in the shared temporary directory, opened through links and
    truncated: another user could clobber a file of the tuning user, or hold the lock forever; and one was left
    there for every database path ever saved."""
    import tempfile

    with core.files_lock(fresh):
        held = list((tmp_path / "jit" / "tune-locks").glob("*.lock"))
        assert len(held) == 1 and (held[0].stat().st_mode & 0o077) == 0
        assert (tmp_path / "jit" / "tune-locks").stat().st_mode & 0o077 == 0
    assert not list(Path(tempfile.gettempdir()).glob(f"hipkern-tune-{held[0].stem}.lock"))
    assert not held[0].exists()  # removed once released: none pile up (the old ones did, one per database path)


def test_a_row_the_loader_would_skip_is_never_chosen(fresh):
    """A faster "ok" row with parameters the op no longer takes (tile 128, outside tile's range) lost to nothing:
    it was written, then skipped by the loader, and the valid slower row was gone."""
    key = core.gpu_kind(INFO) + core.shape_key(FAKE_SCHEMA, _row(Candidate("b"), 8.0))
    n = core.save(FAKE_SCHEMA, fresh, [_row(Candidate("b"), 8.0), _row(Candidate.of("b", tile=128), 1.0)], {key})
    assert n == 1 and by_key(fresh)[("ok", 1)]["tile"] == ""
    assert core.merge_best(FAKE_SCHEMA, [_row(Candidate.of("b", tile=128), 1.0)]) == []


def test_a_bad_out_is_refused_before_any_timing(fresh, tmp_path):
    cmd = ["test_tune:FakeTuner", "--shape", "kind=ok,width=8,batch=1", "--no-progress", "--out"]
    (tmp_path / "adir").mkdir()
    with pytest.raises(ValueError, match=r"--out .*adir: .*adir is a directory; name the database CSV file"):
        main(cmd + [str(tmp_path / "adir")])
    (tmp_path / "afile").write_text("x\n")
    with pytest.raises(ValueError, match=r"--out .*afile/x.csv: its directory cannot be written"):
        main(cmd + [str(tmp_path / "afile" / "x.csv")])
    assert not CALLS


def test_the_commit_stamp_marks_changes_and_other_repositories(monkeypatch, capsys):
    root = str(core.Path(core.__file__).resolve().parents[2])
    git = {("rev-parse", "--show-toplevel"): root, ("rev-parse", "--short=12", "HEAD"): "0123456789ab",
           ("status", "--porcelain", "--", "hipkern", "csrc_hip"): ""}
    monkeypatch.setattr(core, "_git", lambda where, *args: git.get(args))
    assert core.stamp()["commit"] == "0123456789ab"
    git[("status", "--porcelain", "--", "hipkern", "csrc_hip")] = " M hipkern/ops/fused_moe.py"
    assert core.stamp()["commit"] == "0123456789ab-dirty"
    git[("rev-parse", "--show-toplevel")] = "/elsewhere/outer"  # a wheel inside another repository
    assert core.stamp()["commit"] == ""
    assert "not a git checkout of hipkern" in capsys.readouterr().out


def test_a_second_tuner_s_newer_rows_survive_the_first_s_next_checkpoint(fresh):
    (shape,) = shapes(("ok", 1))
    run = runner.Run(FAKE, fresh, [{"i": 0, "shape": shape, "cands": [], "est": 0.0}], INFO, STAMP, runner.Summary(),
                     progress=False)
    run.add_row(0, _row(Candidate("b"), 8.0, date="2026-11-27"))
    run.save()
    core.save(FAKE_SCHEMA, fresh, [_row(Candidate("b"), 7.0, date="2026-11-28")], set())  # the other tuner
    run.save()  # a checkpoint with nothing new
    (b,) = [r for r in rows_of(core.candidates_path(fresh)) if r["variant"] == "b"]
    assert (b["us"], b["date"]) == ("7.000", "2026-11-28")


def test_a_gpu_with_no_rows_of_its_own_takes_one_device_s_rows(tmp_path, monkeypatch):
    """Another sm_90 GPU of 132 SMs (an H100 NVL, a GH200) took H100 and H200 rows shape by shape by their dates."""
    path = tmp_path / "faketune.csv"
    rows = [_row(Candidate("a"), 5.0, batch=b, device="GPU A", date="2026-11-20") for b in (1, 2, 4)]
    rows += [_row(Candidate("b"), 5.0, batch=b, device="GPU B", date="2026-11-28") for b in (1, 2)]
    core.write_csv(path, rows, FAKE_SCHEMA.columns)
    monkeypatch.setenv("HIPKERN_TUNING_DB", str(path))
    tuning_db.reset()
    try:
        got = {b: tuning_db.lookup("faketune", "sm_90", 132, device_name="GPU C", kind="ok", width=8, batch=b)
               for b in (1, 2, 4)}
        assert {b: (c.variant, c.row["device"]) for b, c in got.items()} == {b: ("a", "GPU A") for b in (1, 2, 4)}
        own = tuning_db.lookup("faketune", "sm_90", 132, device_name="GPU B", kind="ok", width=8, batch=2)
        assert (own.variant, own.source) == ("b", "exact")
    finally:
        tuning_db.reset()


def test_a_dry_run_without_a_gpu_says_its_plan_is_not_a_gpu_s(fresh, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["test_tune:FakeTuner", "--shape", "kind=ok,width=8,batch=1", "--out", str(fresh), "--dry-run",
                 "--arch", "sm_90", "--cu-count", "132"]) == 0
    assert "plans with one resident block an SM for every kernel" in capsys.readouterr().out


def _measure_spoiled(monkeypatch, tokens: int, spoil) -> tuple:
    """core.measure of fused_moe's grouped/16 candidate on a small shape: once as it is (it must pass), then with
    spoil(out, ids) applied to every output of the op; returns the second measurement."""
    from hipkern.tune import fused_moe as adapter

    s = adapter.ADAPTER.parse_shape(dict(dtype="bfloat16", model_dim="256", inter_dim="128", num_experts="16",
                                         topk="2", tokens=str(tokens)))
    bench = adapter.ADAPTER.prepare(s, adapter.ADAPTER.device_info(0), 0)
    real = adapter.fused_moe

    def spoiled(x, w1, w2, tw, ids, *, out, **kw):
        real(x, w1, w2, tw, ids, out=out, **kw)
        spoil(out, ids)
        return out

    cand = Candidate.of("grouped", block_m=16)
    assert core.measure(bench, cand, ("skewed_us",))[0] == "ok"
    monkeypatch.setattr(adapter, "fused_moe", spoiled)
    return core.measure(bench, cand, ("skewed_us",))


@pytest.mark.gpu
def test_the_fused_moe_adapter_rejects_a_candidate_wrong_only_under_skewed_routing(monkeypatch):
    def when_skewed(out, ids):
        if bool((ids == ids[:1]).all()):
            out.mul_(1.5)

    status, us, err, note, fatal, extra = _measure_spoiled(monkeypatch, 8, when_skewed)
    assert status == "rejected" and note.startswith("WrongResult: skewed routing") and not fatal
    assert core.settled(FAKE_SCHEMA, {"status": status, "variant": "grouped", "note": note})


@pytest.mark.gpu
def test_the_fused_moe_adapter_checks_every_token(monkeypatch):
    """The check compared the first 16 tokens only: a candidate wrong in a later token (a later row block of an
    expert) was accepted, and could have become the op's default."""
    status, us, err, note, fatal, extra = _measure_spoiled(monkeypatch, 64, lambda out, ids: out[-1].mul_(1.5))
    assert status == "rejected" and note.startswith("checkAllclose mismatch") and not fatal


def test_a_gpu_s_own_row_wins_a_tie_with_rows_of_no_device(tmp_path, monkeypatch):
    """Rows without a device (files from before the column) are as near as the GPU's own: its own row wins
    the tie, however many rows without a device there are (the device tie-break ranks only the others)."""
    path = tmp_path / "faketune.csv"
    rows = [_row(Candidate("a"), 5.0, batch=b, device="", date="2026-11-20") for b in (1, 32, 64, 128)]
    rows += [_row(Candidate("b"), 5.0, batch=1, device="GPU B", date="2026-11-28")]
    core.write_csv(path, rows, FAKE_SCHEMA.columns)
    monkeypatch.setenv("HIPKERN_TUNING_DB", str(path))
    tuning_db.reset()
    try:
        got = tuning_db.lookup("faketune", "sm_90", 132, device_name="GPU B", kind="ok", width=8, batch=2)
        assert (got.variant, got.row["device"], got.source) == ("b", "GPU B", "nearest")
    finally:
        tuning_db.reset()
