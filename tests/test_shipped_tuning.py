"""The committed tuning results are self-consistent: for every tuned shape, variant=None's lookup
resolves to the committed row, which is the fastest candidate the tuner measured for that shape and
never slower than the heuristic default (from the tuner's candidate log next to it)."""
import csv
from collections import defaultdict
from pathlib import Path

import pytest

import hipkern.ops.paged_attention as pa
from hipkern import tuning_db

RESULTS = Path(__file__).resolve().parents[1] / "tuning" / "results"
SHIPPED = sorted(p for p in RESULTS.glob("*/*.csv") if not p.name.endswith(".candidates.csv"))


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_something_is_shipped():
    assert (RESULTS / "sm_90" / "paged_attention.csv") in SHIPPED


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_lookup_resolves_every_row_to_itself(path, monkeypatch):
    monkeypatch.delenv("HIPKERN_TUNING_DB", raising=False)
    tuning_db.reset()
    rows = _rows(path)
    assert rows
    keys = [k for k in rows[0] if k not in tuning_db.COMMON and k not in ("partition_size",)]
    for r in rows:
        shape = {k: (int(r[k]) if r[k].isdigit() else r[k]) for k in keys}
        c = tuning_db.lookup(path.stem, r["arch"], int(r["cu_count"]), **shape)
        assert c is not None and c.source == "exact", (r, c)
        want = {"partition_size": int(r["partition_size"])} if r.get("partition_size") else {}
        assert (c.variant, c.params) == (r["variant"], want), r


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_each_row_is_the_best_measured_candidate_and_beats_the_default(path):
    log = path.with_name(path.stem + ".candidates.csv")
    measured = defaultdict(list)
    key_cols = None
    for r in _rows(log):
        key_cols = key_cols or [k for k in r if k not in tuning_db.COMMON + ("partition_size", "status", "note")]
        if r["status"] == "ok":
            measured[tuple(r[k] for k in key_cols)].append(r)
    for r in _rows(path):
        cands = measured[tuple(r[k] for k in key_cols)]
        assert cands, r
        best = min(float(c["us"]) for c in cands)
        assert float(r["us"]) == best, r
        default = pa.heuristic_variant(int(r["head_size"]), r["arch"])
        default_us = [float(c["us"]) for c in cands if c["variant"] == default and not c["partition_size"]]
        assert default_us and float(r["us"]) <= min(default_us), r
