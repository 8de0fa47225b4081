"""The tuning database with synthetic CSVs: exact and nearest lookup, overlay, malformed input."""
import csv
import logging

import pytest

from hipkern import tuning_db
from hipkern.tuning_db import Schema, bucket, lookup

SCHEMA = Schema(op="toyop", exact_keys=("dtype", "head_size"), bucket_keys=("batch", "context"),
                param_keys=("partition_size",), variants=frozenset({"a", "b", "c"}),
                param_ranges={"partition_size": (1, 4096)})
tuning_db.register(SCHEMA)
SHAPE = dict(dtype="bfloat16", head_size=128)


def row(variant="a", batch=8, context=2048, cu=132, arch="sm_90", date="2026-11-20", psize="", **kw):
    r = dict(arch=arch, cu_count=cu, variant=variant, us=10.0, tbps=2.5, err=0.0, date=date, commit="abc",
             dtype="bfloat16", head_size=128, batch=batch, context=context, partition_size=psize)
    r.update(kw)
    return r


def write(path, rows, columns=SCHEMA.columns):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return path


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """A shipped results dir of our own; no user overlay; fresh caches."""
    d = tmp_path / "results"
    monkeypatch.setattr(tuning_db, "shipped_results_dir", lambda: d)
    monkeypatch.delenv("HIPKERN_TUNING_DB", raising=False)
    monkeypatch.delenv("HIPKERN_LOG_UNTUNED", raising=False)
    tuning_db.reset()
    yield d / "sm_90" / "toyop.csv"
    tuning_db.reset()


def find(batch=8, context=2048, cu=132, device="", **shape):
    return lookup("toyop", "sm_90", cu, device_name=device, **{**SHAPE, **shape}, batch=batch, context=context)


def test_bucket():
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 5, 1000, 1024, 1025)] == [1, 1, 2, 4, 4, 8, 1024, 1024, 2048]
    assert [bucket(n) for n in (0.5, 2.5, 4.0)] == [1, 4, 4]  # the smallest power of two >= n


def test_the_memo_tells_shapes_apart_by_key_name(shipped):
    """Two lookups of the same values under other names (or in another keyword order) are other shapes: the memo
    keyed the values alone, and served the first one's choice to the second."""
    write(shipped, [row("a", 8, 2048), row("b", 2048, 8)])
    assert lookup("toyop", "sm_90", 132, **SHAPE, context=8, batch=2048).variant == "b"
    assert lookup("toyop", "sm_90", 132, **SHAPE, batch=8, context=2048).variant == "a"
    assert lookup("toyop", "sm_90", 132, **SHAPE, context=8, batch=2048).variant == "b"
    assert lookup("toyop", "sm_90", 132, **SHAPE, batch=2048, context=8).variant == "b"


def test_exact_row_and_params(shipped):
    write(shipped, [row("a", 8, 2048), row("b", 16, 2048, psize=256)])
    c = find(16, 2048)
    assert (c.variant, c.params, c.source) == ("b", {"partition_size": 256}, "exact")
    assert find(8, 2048).params == {}


def test_nearest_neighbour_rule(shipped, caplog):
    write(shipped, [row("a", 4, 2048), row("b", 64, 2048), row("c", 16, 4096, date="2026-11-01"),
                    row("a", 16, 4096, dtype="float16")])
    with caplog.at_level(logging.INFO, logger="hipkern.tuning"):
        c = find(16, 2048)  # distances: a 2, b 2, c 1
    assert (c.variant, c.source) == ("c", "nearest")
    assert "toyop on sm_90 has no tuned row" in caplog.text and "nearest tuned row (c" in caplog.text
    assert find(8, 2048).variant == "a"  # distances: a 1, c 2, b 3
    assert find(8, 4096).variant == "c"  # distances: c 1, a 2, b 4
    assert find(16, 4096, dtype="float16").variant == "a"  # exact keys must match: only the fp16 row
    assert find(16, 4096, dtype="float32") is None  # nothing with those exact keys: heuristic


def test_nearest_prefers_same_cu_count_then_newer_date(shipped):
    write(shipped, [row("a", 8, 2048, cu=114), row("b", 16, 2048, date="2026-11-01"),
                    row("c", 16, 2048, cu=100, date="2026-11-21")])
    assert find(8, 2048).variant == "a"  # distance 0.5 (cu) beats 1 (batch)
    write(shipped, [row("b", 16, 2048, cu=100, date="2026-11-01"), row("c", 16, 2048, cu=114, date="2026-11-21")])
    tuning_db.reset()
    assert find(16, 2048).variant == "c"  # same distance and buckets: the newer row


@pytest.mark.parametrize("order", [1, -1])
def test_equal_distances_go_to_the_larger_buckets(shipped, order):
    """Batch 8 lies one power of two from both rows: the larger bucket's row wins, in either file order
    (the tie is decided by the rule, not by which row came first)."""
    write(shipped, [row("a", 4, 2048), row("b", 16, 2048)][::order])
    assert find(8, 2048).variant == "b"
    assert find(8, 4096).variant == "b"  # distance 2 to both


def test_another_cu_count_costs_half_a_bucket(shipped):
    """A row of another CU count is 0.5 further: it loses to a row one bucket away on this GPU's count
    (1.5 against 1; with no cost the two would tie, and the larger bucket would win)."""
    write(shipped, [row("a", 16, 2048, cu=114), row("b", 4, 2048)])
    assert find(8, 2048).variant == "b"


H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


def test_rows_of_two_devices_of_one_arch_and_cu_count_are_kept_apart(shipped, caplog):
    """An H100 and an H200 are both sm_90 with 132 SMs: each takes its own row of a shape (the H200's is
    faster and newer, and must not replace the H100's), a row without a device stands for any GPU, and a
    GPU with no row of its own takes another device's row of its shape as nearest (logged as untuned), before
    its own row of a shape one bucket away."""
    write(shipped, [row("a", 8, 2048, device=H100), row("b", 8, 2048, device=H200, date="2026-11-28"),
                    row("c", 16, 2048, device=H200), row("a", 32, 2048)])
    assert (find(8, device=H100).variant, find(8, device=H100).source) == ("a", "exact")
    assert (find(8, device=H200).variant, find(8, device=H200).source) == ("b", "exact")
    assert (find(32, device=H200).variant, find(32, device=H200).source) == ("a", "exact")  # any device's
    with caplog.at_level(logging.INFO, logger="hipkern.tuning"):
        c = find(16, device=H100)  # the H200's row of its own shape (0.25) over its own one bucket away (1)
    assert (c.variant, c.source) == ("c", "nearest")
    assert f"GPU {H100}" in caplog.text and f"nearest tuned row (c, {H200}" in caplog.text
    b200 = find(8, device="NVIDIA B200")  # neither device: the nearer, then the newer
    assert (b200.variant, b200.source) == ("b", "nearest")


def test_a_later_file_without_the_device_column_overrides_every_device_s_rows(shipped, tmp_path, monkeypatch):
    """A user's file from before the column overlays the shipped rows of its shapes on every GPU, as it did
    before the column; a later file's named row overrides only its own device's."""
    write(shipped, [row("a", 8, 2048, device=H100), row("a", 8, 2048, device=H200), row("a", 16, 2048, device=H100)])
    old = write(tmp_path / "old.csv", [row("b", 8, 2048)], columns=[c for c in SCHEMA.columns if c != "device"])
    named = write(tmp_path / "named.csv", [row("c", 16, 2048, device=H200)])
    monkeypatch.setenv("HIPKERN_TUNING_DB", f"{old}:{named}")
    tuning_db.reset()
    for dev in (H100, H200, ""):
        assert (find(8, device=dev).variant, find(8, device=dev).source) == ("b", "exact")
    assert find(16, device=H100).variant == "a" and find(16, device=H200).variant == "c"


def test_a_file_without_the_device_column_stands_for_any_gpu(shipped):
    """Files from before the column (users' tuned files) load as before: their rows are exact for every GPU
    of their arch and CU count."""
    write(shipped, [row("b", 16, 2048)], columns=[c for c in SCHEMA.columns if c != "device"])
    for dev in (H100, H200, ""):
        c = find(16, device=dev)
        assert (c.variant, c.source) == ("b", "exact")


def test_a_full_tie_in_one_file_goes_to_the_later_row(shipped):
    write(shipped, [row("a", 8, 2048, us=5.0), row("b", 8, 2048, us=5.0)])
    with pytest.warns(UserWarning, match="1 rows whose key an earlier row has"):
        assert find(8, 2048).variant == "b"


def test_warnings_name_the_file_s_line_past_blank_lines(shipped):
    write(shipped, [row("a", 8, 2048)])
    with open(shipped, "a") as fh:
        fh.write("\n\n")
    with open(shipped, "a", newline="") as fh:
        csv.DictWriter(fh, fieldnames=list(SCHEMA.columns), extrasaction="ignore").writerow(row("v_old", 16, 2048))
    with pytest.warns(UserWarning, match="toyop.csv, line 5: variant 'v_old'"):
        assert find(16, 2048).variant == "a"


def test_rows_of_other_archs(shipped, tmp_path, monkeypatch, recwarn):
    """In the per-arch layout (results/<arch>/<op>.csv) a row of another arch is misplaced: one warning
    with their count. A file of several archs' rows (the tuner's --out, named by HIPKERN_TUNING_DB) gives
    each arch its own rows, silently."""
    write(shipped, [row("a", 8, 2048), row("b", 16, 2048, arch="gfx942"), row("b", 32, 2048, arch="gfx942")])
    with pytest.warns(UserWarning, match="toyop.csv has 2 rows of other archs than sm_90; skipped") as rec:
        assert find(16, 2048).variant == "a"
    assert len(rec) == 1
    both = write(tmp_path / "both.csv", [row("c", 8, 2048), row("b", 8, 2048, arch="gfx942")])
    write(shipped, [row("a", 8, 2048)])
    monkeypatch.setenv("HIPKERN_TUNING_DB", str(both))
    tuning_db.reset()
    recwarn.clear()
    assert find(8, 2048).variant == "c"
    assert lookup("toyop", "gfx942", 304, **SHAPE, batch=8, context=2048).variant == "b"
    assert not [w for w in recwarn if "both.csv" in str(w.message)]


def test_undated_rows_lose_ties(shipped):
    # same distance (cu_count differs for both), same buckets: the dated row wins
    write(shipped, [row("a", 16, 2048, cu=100, date=""), row("b", 16, 2048, cu=114, date="2026-05-01")])
    assert find(16, 2048).variant == "b"


def test_fallbacks_logged_once_and_appended_to_log_file(shipped, tmp_path, monkeypatch, caplog):
    write(shipped, [row("a", 8, 2048)])
    out = tmp_path / "untuned.csv"
    monkeypatch.setenv("HIPKERN_LOG_UNTUNED", str(out))
    with caplog.at_level(logging.INFO, logger="hipkern.tuning"):
        for _ in range(3):
            find(32, 2048)
            find(16, 1024, dtype="float16")
            find(8, 2048)  # exact: not logged
    assert caplog.text.count("has no tuned row") == 2
    rows = list(csv.DictReader(open(out)))
    assert [(r["dtype"], r["batch"], r["context"]) for r in rows] == [("bfloat16", "32", "2048"), ("float16", "16", "1024")]
    assert rows[0]["op"] == "toyop" and rows[0]["cu_count"] == "132" and rows[0]["device"] == ""
    find(32, 2048, device=H200)  # another GPU's miss of the same shape: its own log row, with its name
    assert list(csv.DictReader(open(out)))[-1]["device"] == H200


def test_user_overlay_wins_row_by_row(shipped, tmp_path, monkeypatch):
    write(shipped, [row("a", 8, 2048), row("a", 16, 2048)])
    user = write(tmp_path / "mine.csv", [row("b", 16, 2048), row("c", 32, 2048)])
    user_dir = tmp_path / "userdb"
    write(user_dir / "sm_90" / "toyop.csv", [row("c", 8, 2048)])
    monkeypatch.setenv("HIPKERN_TUNING_DB", f"{user}:{user_dir}")
    tuning_db.reset()
    assert find(16, 2048).variant == "b"  # theirs wins
    assert find(32, 2048).variant == "c"  # theirs adds
    assert find(8, 2048).variant == "c"  # the later path wins over the shipped row


def test_a_user_row_shadowing_a_shipped_one_is_logged_once_a_file(shipped, tmp_path, monkeypatch, caplog):
    write(shipped, [row("a", 8, 2048), row("a", 16, 2048, device=H100), row("a", 32, 2048)])
    adds = write(tmp_path / "adds.csv", [row("b", 64, 2048)])  # replaces nothing: no line
    user = write(tmp_path / "mine.csv", [row("b", 16, 2048, device=H100, us=7.5, date="2026-11-29"),
                                         row("c", 8, 2048), row("c", 128, 2048)])
    monkeypatch.setenv("HIPKERN_TUNING_DB", f"{adds}:{user}")
    tuning_db.reset()
    with caplog.at_level(logging.INFO, logger="hipkern.tuning"):
        assert find(16, 2048, device=H100).variant == "b" and find(8, 2048).variant == "c"
        find(32, 2048)
    lines = [r.getMessage() for r in caplog.records if "replaces" in r.getMessage()]
    assert len(lines) == 1 and str(user) in lines[0] and "replaces 2 toyop row(s)" in lines[0], lines
    assert "dtype=bfloat16, head_size=128, batch=8, context=2048, cu_count=132: a (10 us, 2026-11-20) -> c" in lines[0]


@pytest.mark.parametrize("bad,msg", [
    (dict(variant="v_old"), "variant 'v_old' is not one of"),
    (dict(batch=6), "batch='6' is not a power of two"),
    (dict(context="x"), "a number column holds something else"),
    (dict(us="fast"), "a number column holds something else"),
    (dict(arch=""), "arch '' is not 'sm_90'"),
    (dict(us="nan"), "us='nan' is not a positive time"),
    (dict(us="inf"), "us='inf' is not a positive time"),
    (dict(us=0), "us='0' is not a positive time"),
    (dict(us=-1.5), "us='-1.5' is not a positive time"),
    (dict(dtype=""), "an exact key is empty"),
    (dict(dtype="  "), "an exact key is empty"),
    (dict(partition_size=0), r"partition_size=0 is outside \[1, 4096\]"),
    (dict(partition_size=8192), r"partition_size=8192 is outside \[1, 4096\]"),
])
def test_malformed_row_skipped_with_one_warning(shipped, bad, msg):
    write(shipped, [row("a", 8, 2048), row(**{"variant": "b", "batch": 16, "context": 2048, **bad})])
    with pytest.warns(UserWarning, match=f"toyop.csv, line 3: {msg}") as rec:
        assert find(8, 2048).variant == "a"
        assert find(16, 2048).variant == "a"  # nearest: the bad row is gone
    assert len(rec) == 1


def test_short_row_skipped_with_one_warning(shipped):
    """A row with fewer fields than the header (csv fills them with None; e.g. a user file whose last
    columns are absent on one line) is skipped like any malformed row, never an error inside the op."""
    write(shipped, [row("a", 8, 2048)])
    with open(shipped, "a") as fh:
        fh.write("sm_90,132,b,9.0\n")
    with pytest.warns(UserWarning, match="toyop.csv, line 3: the row has fewer or more fields than the header"):
        assert find(16, 2048).variant == "a"


def test_untuned_log_of_two_ops_keeps_one_op_a_file(shipped, tmp_path, monkeypatch):
    other = Schema(op="toyop2", exact_keys=("dtype",), bucket_keys=("tokens",), param_keys=(),
                   variants=frozenset({"x"}))
    tuning_db.register(other)
    out = tmp_path / "untuned.csv"
    monkeypatch.setenv("HIPKERN_LOG_UNTUNED", str(out))
    find(32, 2048)
    lookup("toyop2", "sm_90", 132, dtype="bfloat16", tokens=64)
    rows = list(csv.DictReader(open(out)))
    assert [r["op"] for r in rows] == ["toyop"]
    rows2 = list(csv.DictReader(open(tmp_path / "untuned.toyop2.csv")))
    assert [(r["op"], r["tokens"]) for r in rows2] == [("toyop2", "64")]


def test_malformed_or_missing_files(shipped, tmp_path, monkeypatch):
    write(shipped, [row("a", 8, 2048)], columns=[c for c in SCHEMA.columns if c != "commit"])
    monkeypatch.setenv("HIPKERN_TUNING_DB", str(tmp_path / "nope.csv"))
    with pytest.warns(UserWarning) as rec:
        assert find(8, 2048) is None  # no usable row anywhere: heuristic
    text = " ".join(str(w.message) for w in rec)
    assert "lacks columns ['commit']" in text and "nope.csv does not exist" in text
    binary = tmp_path / "binary.csv"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    monkeypatch.setenv("HIPKERN_TUNING_DB", str(binary))
    tuning_db.reset()
    with pytest.warns(UserWarning, match="binary.csv"):
        assert find(8, 2048) is None


def test_no_shipped_file_is_silent(shipped, recwarn):
    assert find(8, 2048) is None
    assert not [w for w in recwarn if "toyop" in str(w.message)]


def test_paged_attention_schema_names_its_variants():
    from hipkern.ops.paged_attention import VARIANTS

    schema = tuning_db._schemas["paged_attention"]
    assert schema.variants == frozenset(VARIANTS)
    assert {"dtype", "head_size", "block_size", "num_q_heads", "num_kv_heads", "kv_layout"} == set(schema.exact_keys)


def test_exact_keys_are_stripped(shipped):
    """A hand-edited row's ' 128' matches head size 128 (the bucket and parameter columns already read
    through int(), which allows the spaces)."""
    write(shipped, [row("b", 8, 2048, head_size=" 128", dtype="bfloat16 ")])
    assert find(8, 2048).variant == "b"


def test_duplicate_keys_in_a_file_keep_the_fastest_then_the_newest(shipped):
    """Within one file the tuner's rule (lowest us, then the newer date), with a warning; across files
    the later file still wins (test_user_overlay_wins_row_by_row)."""
    write(shipped, [row("a", 8, 2048, us=9.0, date="2020-01-01"), row("b", 8, 2048, us=5.0, date="2019-01-01"),
                    row("c", 8, 2048, us=7.0, date="2027-01-01"), row("a", 16, 2048, us=5.0, date="2026-01-01"),
                    row("b", 16, 2048, us=5.0, date="2026-02-01")])
    with pytest.warns(UserWarning, match="toyop.csv has 3 rows whose key an earlier row has"):
        assert find(8, 2048).variant == "b"
    assert find(16, 2048).variant == "b"


def test_another_op_s_file_in_the_overlay_is_silent_for_this_op(shipped, tmp_path, monkeypatch, recwarn):
    """HIPKERN_TUNING_DB may name one file per op: a file with another op's columns is not this op's."""
    other = write(tmp_path / "other.csv", [dict(arch="sm_90", cu_count=132, variant="x", us=1.0, tbps=1.0, err=0.0,
                                                date="", commit="", dtype="bfloat16", tokens=8)],
                  columns=("arch", "cu_count", "variant", "us", "tbps", "err", "date", "commit", "dtype", "tokens"))
    write(shipped, [row("a", 8, 2048)])
    monkeypatch.setenv("HIPKERN_TUNING_DB", str(other))
    tuning_db.reset()
    assert find(8, 2048).variant == "a"
    assert not [w for w in recwarn if "other.csv" in str(w.message)]
    # but a file of this op's that lacks one of its columns still warns
    write(tmp_path / "mine.csv", [row("b", 8, 2048)], columns=[c for c in SCHEMA.columns if c != "context"])
    monkeypatch.setenv("HIPKERN_TUNING_DB", str(tmp_path / "mine.csv"))
    tuning_db.reset()
    with pytest.warns(UserWarning, match=r"mine.csv lacks columns \['context'\]"):
        assert find(8, 2048).variant == "a"


def test_the_op_s_own_check_skips_rows_it_cannot_run(shipped):
    checked = Schema(op="toyop3", exact_keys=("dtype",), bucket_keys=("batch",), param_keys=("partition_size",),
                     variants=frozenset({"a", "b"}),
                     check=lambda r: "b takes no partition_size" if r["variant"] == "b" and r["params"] else None)
    tuning_db.register(checked)
    base = dict(arch="sm_90", cu_count=132, us=1.0, tbps=1.0, err=0.0, date="", commit="", dtype="bfloat16")
    write(shipped.with_name("toyop3.csv"), [dict(base, variant="b", batch=8, partition_size=64),
                                            dict(base, variant="a", batch=16, partition_size=64)],
          columns=checked.columns)
    with pytest.warns(UserWarning, match="toyop3.csv, line 2: b takes no partition_size; row skipped"):
        c = lookup("toyop3", "sm_90", 132, dtype="bfloat16", batch=8)
    assert (c.variant, c.source) == ("a", "nearest")


def _op_rows(op, rows, monkeypatch, tmp_path):
    schema = tuning_db._schemas[op]
    path = write(tmp_path / f"{op}.csv", rows, columns=schema.columns)
    monkeypatch.setenv("HIPKERN_TUNING_DB", str(path))
    tuning_db.reset()


def test_paged_attention_rows_the_op_cannot_run_are_skipped(shipped, tmp_path, monkeypatch):
    """A parameter the variant's plan does not take, or a heads_per_block its kernel lacks for the group:
    skipped with a warning at load (each had made every call of its shape raise)."""
    from hipkern.ops import paged_attention as pa

    base = dict(arch="sm_90", cu_count=132, us=5.0, tbps=1.0, err=0.0, date="2027-01-01", commit="x",
                dtype="bfloat16", head_size=128, block_size=16, num_q_heads=32, num_kv_heads=8, kv_layout="NHD",
                context=1024, partition_size="", heads_per_block="", blocks_per_slot="")
    _op_rows("paged_attention", [dict(base, variant="v16", batch=1, blocks_per_slot=2),
                                 dict(base, variant="v16", batch=2, heads_per_block=8),
                                 dict(base, variant="v3", batch=4, heads_per_block=16),
                                 dict(base, variant="v5", batch=8, blocks_per_slot=2, partition_size=256)],
             monkeypatch, tmp_path)
    shape = dict(dtype="bfloat16", head_size=128, block_size=16, num_q_heads=32, num_kv_heads=8, kv_layout="NHD",
                 context=1024)
    with pytest.warns(UserWarning) as rec:
        c = lookup("paged_attention", "sm_90", 132, **shape, batch=8)
    msgs = " | ".join(str(w.message) for w in rec)
    assert "line 2: variant v16 takes no blocks_per_slot" in msgs
    assert "line 3: heads_per_block for variant v16 with GQA group 4 must be one of [16], got 8" in msgs
    assert "line 4: heads_per_block for variant v3 with GQA group 4 must be one of [1, 2, 4], got 16" in msgs
    assert (c.variant, c.params) == ("v5", {"blocks_per_slot": 2, "partition_size": 256})
    for b in (1, 2, 4):  # every shape now finds the one good row, which the op can plan
        c = lookup("paged_attention", "sm_90", 132, **shape, batch=b)
        var = pa.VARIANTS[c.variant]
        p = pa.with_heads(var, c.params, b, 32, 8, 1024, 132)
        pa.plan_of(var, pa.make_shape(var, b, 32, 8, 1024, 132, 32, 1, p), p)


def test_paged_attention_rows_of_kernels_the_arch_cannot_run_are_skipped(shipped, tmp_path, monkeypatch):
    """On CDNA the matrix-core kernel of v16 and v5 does not run head size 256 (v6's smaller one does): such
    a row (hand-written, or copied from another arch's file) is skipped with a warning, so the shape gets
    the next row or the heuristic instead of a ValueError on every call."""
    base = dict(arch="gfx942", cu_count=304, us=5.0, tbps=1.0, err=0.0, date="2027-01-01", commit="x",
                dtype="bfloat16", head_size=256, block_size=16, num_q_heads=64, num_kv_heads=1, kv_layout="NHD",
                context=4096, partition_size="", heads_per_block="", blocks_per_slot="")
    _op_rows("paged_attention", [dict(base, variant=v, batch=b) for v, b in (("v16", 1), ("v5", 2), ("v6", 4),
                                                                             ("v9", 32))]
             + [dict(base, variant="v16", batch=8, head_size=128)], monkeypatch, tmp_path)
    shape = dict(dtype="bfloat16", head_size=256, block_size=16, num_q_heads=64, num_kv_heads=1, kv_layout="NHD",
                 context=4096)
    with pytest.warns(UserWarning) as rec:
        c = lookup("paged_attention", "gfx942", 304, **shape, batch=1)
    msgs = " | ".join(str(w.message) for w in rec)
    for line, v in ((2, "v16"), (3, "v5")):
        assert f"line {line}: variant {v} does not run head size 256 on gfx942" in msgs
    assert "line 4" not in msgs and "line 6" not in msgs  # v6 at 256, v16 at head size 128: both run
    assert (c.variant, c.source) == ("v6", "nearest")
    assert lookup("paged_attention", "gfx942", 304, **shape, batch=64).variant == "v9"
    assert lookup("paged_attention", "gfx942", 304, **dict(shape, head_size=128), batch=8).variant == "v16"


def test_an_arch_with_spaces_is_the_arch(shipped, tmp_path, monkeypatch, recwarn):
    """A hand-edited " gfx942" row is gfx942's (as the exact keys are stripped), and the op's own check reads the
    arch's name without the spaces (it raised a JitError from every lookup of the arch)."""
    base = dict(arch=" gfx942 ", cu_count=304, us=5.0, tbps=1.0, err=0.0, date="2027-01-01", commit="x",
                dtype="bfloat16", head_size=128, block_size=16, num_q_heads=32, num_kv_heads=8, kv_layout="NHD",
                context=1024, partition_size="", heads_per_block="", blocks_per_slot="")
    _op_rows("paged_attention", [dict(base, variant="v9", batch=8)], monkeypatch, tmp_path)
    shape = dict(dtype="bfloat16", head_size=128, block_size=16, num_q_heads=32, num_kv_heads=8, kv_layout="NHD",
                 context=1024)
    c = lookup("paged_attention", "gfx942", 304, **shape, batch=8)
    assert (c.variant, c.source) == ("v9", "exact") and not [w for w in recwarn if "paged_attention" in str(w.message)]


def test_fused_moe_rows_the_op_cannot_run_are_skipped(shipped, tmp_path, monkeypatch):
    """A block_m off the dtype's grid and a gemv_mma row for float32 are skipped with a warning; an empty
    block_m is the variant's default and keeps the row's variant."""
    import importlib

    import torch

    fm = importlib.import_module("hipkern.ops.fused_moe")
    base = dict(arch="sm_90", cu_count=132, us=5.0, tbps=1.0, err=0.0, date="2027-01-01", commit="x",
                model_dim=4096, inter_dim=1024, num_experts=64, topk=2, block_m="", skewed_us="")
    _op_rows("fused_moe", [dict(base, dtype="bfloat16", tokens=4, variant="gemv_mma"),
                           dict(base, dtype="float32", tokens=4, variant="gemv_mma", block_m=8),
                           dict(base, dtype="bfloat16", tokens=16, variant="decode", block_m=24)],
             monkeypatch, tmp_path)
    with pytest.warns(UserWarning) as rec:
        assert fm.choose_config("sm_90", 132, 4, 4096, 1024, 64, 2, torch.bfloat16) == (
            "gemv_mma", fm.default_block_m(4, 2, 64))
    msgs = " | ".join(str(w.message) for w in rec)
    assert "line 3: variant gemv_mma does not run float32" in msgs
    assert "line 4: block_m=24 is not one of (8, 16, 32, 64, 128) for bfloat16" in msgs
    assert tuning_db.lookup("fused_moe", "sm_90", 132, dtype="float32", model_dim=4096, inter_dim=1024,
                            num_experts=64, topk=2, tokens=4) is None


def _unwritable(kind, tmp_path):
    if kind == "missing folder":
        return tmp_path / "no" / "such" / "untuned.csv"
    if kind == "a folder":
        return tmp_path
    if kind == "below a file":  # ENOTDIR, which root cannot write past either
        (tmp_path / "file").write_text("x")
        return tmp_path / "file" / "untuned.csv"
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    return ro / "untuned.csv"


@pytest.mark.parametrize("kind", ["missing folder", "a folder", "below a file", "read-only folder"])
def test_an_untuned_log_that_cannot_be_written_never_fails_the_op(shipped, tmp_path, monkeypatch, kind):
    """HIPKERN_LOG_UNTUNED is diagnostics: a path it cannot write warns once (naming the variable, the path and
    the OS error) and every call returns the same choice; the first call of each shape raised before."""
    import importlib
    import os

    import torch

    if kind == "read-only folder" and os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    fm = importlib.import_module("hipkern.ops.fused_moe")
    out = _unwritable(kind, tmp_path)
    monkeypatch.setenv("HIPKERN_LOG_UNTUNED", str(out))
    args = ("sm_90", 132, 3, 4096, 14336, 8, 2, torch.bfloat16, H100)
    with pytest.warns(UserWarning, match="HIPKERN_LOG_UNTUNED") as rec:
        first = fm.choose_config(*args)
        assert fm.choose_config(*args) == first == fm.choose_config(*args[:-1], "")
        find(32, 2048)  # another op's miss: the same path, already warned
        find(64, 2048)
    msgs = [str(w.message) for w in rec if "HIPKERN_LOG_UNTUNED" in str(w.message)]
    assert len(msgs) == 1, msgs
    why = {"missing folder": "No such file", "a folder": "Is a directory", "below a file": "Not a directory",
           "read-only folder": "Permission denied"}[kind]
    assert str(out) in msgs[0] and why in msgs[0], msgs[0]
    assert first == (fm.choose_variant(3, 2, torch.bfloat16, fm.default_block_m(3, 2, 8), 8, 4096, 14336),
                     fm.default_block_m(3, 2, 8))


def test_an_untuned_log_path_that_becomes_writable_logs_again(shipped, tmp_path, monkeypatch, recwarn):
    out = tmp_path / "later" / "untuned.csv"
    monkeypatch.setenv("HIPKERN_LOG_UNTUNED", str(out))
    assert find(32, 2048) is None
    out.parent.mkdir()
    assert find(64, 2048) is None
    assert [r["batch"] for r in csv.DictReader(open(out))] == ["64"]
    assert len([w for w in recwarn if "HIPKERN_LOG_UNTUNED" in str(w.message)]) == 1


NOT_INT = r" is not a positive integer \(digits, no leading zero\)"
PA_ROW = dict(arch="sm_90", cu_count=132, us=5.0, tbps=1.0, err=0.0, date="2027-01-01", commit="x", variant="v16",
              dtype="bfloat16", head_size=128, block_size=16, num_q_heads=32, num_kv_heads=8, kv_layout="NHD",
              batch=8, context=1024, partition_size="", heads_per_block="", blocks_per_slot="")


@pytest.mark.parametrize("bad,msg", [
    (dict(dtype="fp16"), r"dtype 'fp16' is not one of \['bfloat16', 'float16'\]"),
    (dict(dtype="float32"), r"dtype 'float32' is not one of \['bfloat16', 'float16'\]"),
    (dict(kv_layout="nhd"), r"kv_layout 'nhd' is not one of \('NHD', 'HND'\)"),
    (dict(block_size="16.0"), "block_size='16.0'" + NOT_INT),
    (dict(block_size=24), "block_size 24 is not a power of two up to 1024"),
    (dict(block_size=2048), "block_size 2048 is not a power of two up to 1024"),
    (dict(head_size="0128"), "head_size='0128'" + NOT_INT),
    (dict(head_size=96), r"head_size 96 is not one of \(64, 128, 256\)"),
    (dict(num_q_heads="32.0"), "num_q_heads='32.0'" + NOT_INT),
    (dict(num_kv_heads=0), "num_kv_heads='0'" + NOT_INT),
    (dict(num_kv_heads=-8), "num_kv_heads='-8'" + NOT_INT),
    (dict(num_q_heads=12), "12 query heads over 8 KV heads is no GQA group the op takes"),
])
def test_paged_attention_rows_of_shapes_the_op_does_not_take_are_skipped(shipped, tmp_path, monkeypatch, bad, msg):
    """A row whose exact keys the op does not take, or names otherwise than lookup does, could never match: it is
    skipped with one warning naming the file's line (such rows loaded silently)."""
    _op_rows("paged_attention", [dict(PA_ROW, variant="v3", batch=1), dict(PA_ROW, **bad)], monkeypatch, tmp_path)
    shape = {k: PA_ROW[k] for k in ("dtype", "head_size", "block_size", "num_q_heads", "num_kv_heads", "kv_layout",
                                    "context")}
    with pytest.warns(UserWarning, match=f"paged_attention.csv, line 3: {msg}; row skipped") as rec:
        c = lookup("paged_attention", "sm_90", 132, **shape, batch=8)
    assert len(rec) == 1
    assert (c.variant, c.source) == ("v3", "nearest")


FM_ROW = dict(arch="sm_90", cu_count=132, us=5.0, tbps=1.0, err=0.0, date="2027-01-01", commit="x", variant="decode",
              dtype="bfloat16", model_dim=4096, inter_dim=1024, num_experts=64, topk=2, tokens=4, block_m="",
              skewed_us="")


@pytest.mark.parametrize("bad,msg", [
    (dict(model_dim="64.0"), "model_dim='64.0'" + NOT_INT),
    (dict(inter_dim="1e3"), "inter_dim='1e3'" + NOT_INT),
    (dict(num_experts="064"), "num_experts='064'" + NOT_INT),
    (dict(topk=0), "topk='0'" + NOT_INT),
    (dict(dtype="bf16"), r"dtype 'bf16' is not one of \['bfloat16', 'float16', 'float32'\]"),
    (dict(model_dim=100), r"model_dim 100 or inter_dim 1024 is no multiple of 8 \(bfloat16\)"),
    (dict(dtype="float32", inter_dim=1026), r"model_dim 4096 or inter_dim 1026 is no multiple of 4 \(float32\)"),
])
def test_fused_moe_rows_of_shapes_the_op_does_not_take_are_skipped(shipped, tmp_path, monkeypatch, bad, msg):
    _op_rows("fused_moe", [dict(FM_ROW, variant="grouped", tokens=8), dict(FM_ROW, **bad)], monkeypatch, tmp_path)
    with pytest.warns(UserWarning, match=f"fused_moe.csv, line 3: {msg}; row skipped") as rec:
        c = lookup("fused_moe", "sm_90", 132, dtype="bfloat16", model_dim=4096, inter_dim=1024, num_experts=64,
                   topk=2, tokens=4)
    assert len(rec) == 1
    assert (c.variant, c.source) == ("grouped", "nearest")


def test_fused_moe_row_with_model_dim_64_0_never_loads_silently(shipped, tmp_path, monkeypatch, recwarn):
    """The reported case: the row's shape is model_dim 64, written as 64.0; the op's calls of model_dim 64 get the
    heuristic either way, now with the warning that says why."""
    import importlib

    import torch

    fm = importlib.import_module("hipkern.ops.fused_moe")
    _op_rows("fused_moe", [dict(FM_ROW, model_dim="64.0", variant="grouped", block_m=128)], monkeypatch, tmp_path)
    got = fm.choose_config("sm_90", 132, 4, 64, 1024, 64, 2, torch.bfloat16)
    assert got[1] == fm.default_block_m(4, 2, 64)
    assert [str(w.message) for w in recwarn if "fused_moe.csv" in str(w.message)] == [
        f"hipkern tuning file {tmp_path / 'fused_moe.csv'}, line 2: model_dim='64.0' is not a positive integer "
        f"(digits, no leading zero); row skipped"]


@pytest.mark.parametrize("content,msg", [
    ("", r"is empty \(no header on its first line\); skipped"),
    ("\n\n", r"is empty \(no header on its first line\); skipped"),
    (";".join(SCHEMA.columns) + "\nsm_90;132;;a;1.0;1;0;;;bfloat16;128;8;2048;\n",
     r"has no tuning columns in its header \('arch;cu_count;device;.*: not comma-separated\?\); skipped"),
    ("\t".join(SCHEMA.columns) + "\n", r"has no tuning columns in its header .*not comma-separated\?\); skipped"),
], ids=["empty", "blank lines", "semicolons", "tabs"])
def test_an_empty_or_not_comma_separated_file_warns(shipped, tmp_path, monkeypatch, content, msg):
    """Such a file named in HIPKERN_TUNING_DB is skipped with a warning naming it and why (it was skipped with a
    DEBUG log only, as another op's file is); the shipped rows still load."""
    write(shipped, [row("a", 8, 2048)])
    bad = tmp_path / "mine.csv"
    bad.write_text(content)
    monkeypatch.setenv("HIPKERN_TUNING_DB", str(bad))
    tuning_db.reset()
    with pytest.warns(UserWarning, match=f"hipkern tuning file {bad} {msg}") as rec:
        assert find(8, 2048).variant == "a"
    assert len(rec) == 1


def test_an_empty_shipped_file_warns(shipped):
    write(shipped, [])
    shipped.write_text("")
    with pytest.warns(UserWarning, match=r"toyop.csv is empty"):
        assert find(8, 2048) is None


def test_a_header_only_file_is_silent(shipped, tmp_path, monkeypatch, recwarn):
    write(shipped, [row("a", 8, 2048)])
    monkeypatch.setenv("HIPKERN_TUNING_DB", str(write(tmp_path / "none.csv", [])))
    tuning_db.reset()
    assert find(8, 2048).variant == "a"
    assert not [w for w in recwarn if "none.csv" in str(w.message)]


def test_missing_paths_in_the_overlay_warn(shipped, tmp_path, monkeypatch):
    """As documented: a path in HIPKERN_TUNING_DB that does not exist, or a folder without <arch>/<op>.csv, is
    skipped with a warning naming the file it looked for."""
    write(shipped, [row("a", 8, 2048)])
    (tmp_path / "empty_db").mkdir()
    monkeypatch.setenv("HIPKERN_TUNING_DB", f"{tmp_path / 'no_db'}:{tmp_path / 'empty_db'}")
    with pytest.warns(UserWarning) as rec:
        assert find(8, 2048).variant == "a"
    assert sorted(str(w.message) for w in rec) == [
        f"hipkern tuning file {tmp_path / 'empty_db' / 'sm_90' / 'toyop.csv'} does not exist; skipped",
        f"hipkern tuning file {tmp_path / 'no_db'} does not exist; skipped"]


def test_the_shipped_database_loads_without_a_warning(monkeypatch):
    """Every shipped file loads every row: no warning at all (a bad row, a duplicate key or a misplaced arch
    would each warn; a warning from the shipped files reaches every user)."""
    import importlib
    import warnings
    from pathlib import Path

    importlib.import_module("hipkern")  # registers every op's schema
    monkeypatch.delenv("HIPKERN_TUNING_DB", raising=False)
    results = Path(__file__).resolve().parents[1] / "tuning" / "results"
    files = sorted(p for p in results.glob("*/*.csv") if not p.name.endswith(".candidates.csv"))
    assert files
    monkeypatch.setattr(tuning_db, "shipped_results_dir", lambda: results)
    tuning_db.reset()
    try:
        for f in files:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                table = tuning_db._table(f.stem, f.parent.name)
            with open(f, newline="") as fh:
                assert len(table.exact) == len(list(csv.DictReader(fh))), f
    finally:
        tuning_db.reset()


def test_a_miss_looked_up_by_threads_at_once_is_logged_once(shipped, tmp_path, monkeypatch, caplog):
    """Eight threads look up the same untuned shape together (the first lookup loads the files, a wide window):
    one log line and one row of the untuned log."""
    import threading
    write(shipped, [row("a", 8, 2048)])
    out = tmp_path / "untuned.csv"
    monkeypatch.setenv("HIPKERN_LOG_UNTUNED", str(out))
    barrier, got = threading.Barrier(8), []

    def go():
        barrier.wait()
        got.append(find(64, 2048))

    with caplog.at_level(logging.INFO, logger="hipkern.tuning"):
        threads = [threading.Thread(target=go) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(got) == 8 and all(c is got[0] for c in got) and got[0].variant == "a"
    assert caplog.text.count("has no tuned row") == 1
    assert len(list(csv.DictReader(open(out)))) == 1


def test_a_choice_made_while_the_database_is_reset_is_not_kept(shipped, monkeypatch):
    """A lookup whose files were read before a reset() (the user changed HIPKERN_TUNING_DB meanwhile) answers
    from the files as they are after it, and remembers that."""
    write(shipped, [row("a", 8, 2048)])
    real, calls = tuning_db._Table.find, []

    def find_then_reset(self, *args):
        found = real(self, *args)
        if not calls:  # the first lookup: the files change, and reset() runs, before it stores its choice
            write(shipped, [row("b", 8, 2048)])
            tuning_db.reset()
        calls.append(found[0]["variant"])
        return found

    monkeypatch.setattr(tuning_db._Table, "find", find_then_reset)
    assert find(8, 2048).variant == "b" and calls == ["a", "b"]
    assert find(8, 2048).variant == "b" and len(calls) == 2


def test_nearest_rows_that_differ_in_cu_count_alone_do_not_depend_on_row_order(shipped):
    """Rows without a device, of two CU counts, neither this GPU's: the nearer CU count, whatever the order."""
    for rows in ([row("a", 8, 2048, cu=114), row("b", 8, 2048, cu=132)],
                 [row("b", 8, 2048, cu=132), row("a", 8, 2048, cu=114)]):
        write(shipped, rows)
        tuning_db.reset()
        assert (find(8, 2048, cu=78).variant, find(8, 2048, cu=140).variant) == ("a", "b")
    write(shipped, [row("b", 8, 2048, cu=140), row("a", 8, 2048, cu=120)])  # equally near 130: the larger
    tuning_db.reset()
    assert find(8, 2048, cu=130).variant == "b"


def test_a_folder_s_op_file_with_wrong_columns_warns(shipped, tmp_path, monkeypatch):
    """<folder>/<arch>/<op>.csv is this op's by its name: a file there with other columns (a renamed key) is not
    skipped silently as another op's file may be."""
    write(shipped, [row("a", 8, 2048)])
    cols = [c if c != "batch" else "num_seqs" for c in SCHEMA.columns if c not in ("context", "head_size")]
    write(tmp_path / "mine" / "sm_90" / "toyop.csv", [], columns=cols)
    monkeypatch.setenv("HIPKERN_TUNING_DB", str(tmp_path / "mine"))
    tuning_db.reset()
    with pytest.warns(UserWarning, match=r"toyop.csv lacks columns"):
        assert find(8, 2048).variant == "a"


def test_a_file_with_a_byte_order_mark_loads(shipped, tmp_path, monkeypatch, recwarn):
    write(shipped, [row("a", 8, 2048)])
    user = write(tmp_path / "bom.csv", [row("b", 8, 2048)])
    user.write_bytes(b"\xef\xbb\xbf" + user.read_bytes())  # as a spreadsheet saves "CSV UTF-8"
    monkeypatch.setenv("HIPKERN_TUNING_DB", str(user))
    tuning_db.reset()
    assert find(8, 2048).variant == "b"
    assert not [w for w in recwarn if "bom.csv" in str(w.message)]
