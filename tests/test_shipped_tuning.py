"""The committed tuning results are self-consistent: for every tuned shape, variant=None's lookup
resolves to the committed row, which is the heuristic default within the tuner's margin of the fastest
candidate, else the fastest; or, where the op has a second measure (fused_moe's skewed_us), a
candidate within the tuner's window of the fastest that beats that choice there by more than the
margin and by more than the tuner's exchange rate times its loss on the first (from the tuner's
candidate log next to it)."""
import csv
from collections import defaultdict
from pathlib import Path

import pytest

import hipkern  # noqa: F401  (registers every op's schema)
from hipkern import tuning_db
from hipkern.tune import core

RESULTS = Path(__file__).resolve().parents[1] / "tuning" / "results"
SHIPPED = sorted(p for p in RESULTS.glob("*/*.csv") if not p.name.endswith(".candidates.csv"))


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_something_is_shipped():
    assert (RESULTS / "sm_90" / "paged_attention.csv") in SHIPPED


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*/*.csv")), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_files_have_lf_line_endings(path):
    """As the tuner writes them (core.write_csv), so that a merge diffs only the rows it changed."""
    assert b"\r" not in path.read_bytes()


def _shape(schema, r) -> dict:
    return {k: (int(r[k]) if r[k].isdigit() else r[k]) for k in schema.exact_keys + schema.bucket_keys}


def _params(schema, r) -> dict:
    return {k: int(r[k]) for k in schema.param_keys if r.get(k)}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_lookup_resolves_every_row_to_itself(path, monkeypatch):
    monkeypatch.delenv("HIPKERN_TUNING_DB", raising=False)
    tuning_db.reset()
    schema = tuning_db._schemas[path.stem]
    rows = _rows(path)
    assert rows
    for r in rows:
        assert r["device"], f"a shipped row names the GPU that timed it: {r}"
        c = tuning_db.lookup(path.stem, r["arch"], int(r["cu_count"]), device_name=r["device"], **_shape(schema, r))
        assert c is not None and c.source == "exact", (r, c)
        assert (c.variant, c.params) == (r["variant"], _params(schema, r)), r


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_each_row_is_the_default_within_the_margin_or_the_best_beyond_it_or_better_on_the_second_measure(path):
    schema = tuning_db._schemas[path.stem]
    adapter = core.load_adapter(path.stem)
    keys = ("arch", "cu_count", "device") + schema.exact_keys + schema.bucket_keys  # each GPU's own candidates
    measured = defaultdict(list)
    for r in _rows(path.with_name(path.stem + ".candidates.csv")):
        if r["status"] == "ok":
            measured[tuple(r[k] for k in keys)].append(r)
    for r in _rows(path):
        cands = measured[tuple(r[k] for k in keys)]
        assert cands, r
        best = min(float(c["us"]) for c in cands)
        default = adapter.heuristic(adapter.parse_shape(r), adapter.info_for(r["arch"], int(r["cu_count"])))
        default_us = [float(c["us"]) for c in cands
                      if c["variant"] == default.variant and _params(schema, c) == default.kwargs]
        assert default_us, r
        margin = 1 + core.DEFAULT_MARGIN
        assert float(r["us"]) <= best * (1 + core.SECOND_WINDOW), r  # always within the window of the fastest
        near = [c for c in cands if float(c["us"]) <= best * margin]
        window = [c for c in cands if float(c["us"]) <= best * (1 + core.SECOND_WINDOW)]
        default_near = [c for c in near if c["variant"] == default.variant and _params(schema, c) == default.kwargs]
        first = default_near[0] if default_near else min(near, key=lambda c: float(c["us"]))  # the us rule's choice
        is_first = (r["variant"], _params(schema, r)) == (first["variant"], _params(schema, first))
        if not schema.measures or any(not c.get(schema.measures[0]) for c in window):
            assert is_first or (not default_near and float(r["us"]) == best), r
            continue
        second = schema.measures[0]
        trades = [c for c in window if core.second_trade(first, c, second)]  # worth their loss on us
        if is_first:
            assert not trades, r
        else:  # the fastest of them on the second measure
            assert core.second_trade(first, r, second) and float(r[second]) == min(float(c[second]) for c in trades), r
