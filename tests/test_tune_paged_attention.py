"""The tuner's paged-attention adapter: candidates and pruning, bytes, the shipped shape list and its time
estimate, database rows (CPU); and (GPU) small real tuning runs, in this process and in two workers."""
import csv
import math
from pathlib import Path

import pytest

from hipkern import tuning_db
from hipkern.tune import core, runner
from hipkern.tune.__main__ import main
from hipkern.tune.core import Candidate
from hipkern.tune.paged_attention import ADAPTER


def rows_of(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.fixture
def fresh(tuning_results):
    return tuning_results / "paged_attention.csv"


def test_paged_attention_row_round_trips(fresh, monkeypatch):
    shape = ADAPTER.parse_shape(dict(dtype="bfloat16", head_size="128", block_size="16", num_q_heads="32",
                                     num_kv_heads="8", kv_layout="NHD", batch="8", context="2048"))
    out, info = fresh, {"arch": "sm_90", "cu_count": 132}
    row = core.make_row(ADAPTER.schema, info, shape, Candidate.of("v9", partition_size=1024), "ok", 12.5,
                        ADAPTER.nbytes(shape), 0.0, "", {"date": "2026-11-21", "commit": "abc"})
    core.save(ADAPTER.schema, out, [row], {("sm_90", 132, "") + core.shape_key(ADAPTER.schema, shape)})
    monkeypatch.setenv("HIPKERN_TUNING_DB", str(out))
    tuning_db.reset()
    c = tuning_db.lookup("paged_attention", "sm_90", 132, dtype="bfloat16", head_size=128, block_size=16,
                         num_q_heads=32, num_kv_heads=8, kv_layout="NHD", batch=8, context=2048)
    assert (c.variant, c.params, c.source) == ("v9", {"partition_size": 1024}, "exact")
    assert rows_of(out)[0]["tbps"] == f"{(8 * 2048 * 8 * 128 * 2 + 2 * 8 * 32 * 128) * 2 / 12.5 / 1e6:.4f}"


def test_a_tuning_run_on_another_device_of_the_arch_keeps_the_first_device_s_rows(fresh, monkeypatch):
    """An H200 is sm_90 with 132 SMs, as an H100: its faster row of a shape joins the database beside the
    H100's instead of replacing it (fastest row per key), and each GPU looks up its own."""
    shape = ADAPTER.parse_shape(dict(dtype="bfloat16", head_size="128", block_size="16", num_q_heads="32",
                                     num_kv_heads="8", kv_layout="NHD", batch="8", context="2048"))
    for device, cand, us in (("NVIDIA H100 80GB HBM3", Candidate.of("v9", partition_size=1024), 30.0),
                             ("NVIDIA H200", Candidate.of("v16", partition_size=512), 24.0)):
        info = {"arch": "sm_90", "cu_count": 132, "device": device}
        row = core.make_row(ADAPTER.schema, info, shape, cand, "ok", us, ADAPTER.nbytes(shape), 0.0, "",
                            {"date": "2026-11-28", "commit": "abc"})
        core.save(ADAPTER.schema, fresh, [row], {core.gpu_kind(info) + core.shape_key(ADAPTER.schema, shape)})
    assert sorted((r["device"], r["variant"]) for r in rows_of(fresh)) == [("NVIDIA H100 80GB HBM3", "v9"),
                                                                           ("NVIDIA H200", "v16")]
    monkeypatch.setenv("HIPKERN_TUNING_DB", str(fresh))
    tuning_db.reset()
    for device, want in (("NVIDIA H100 80GB HBM3", "v9"), ("NVIDIA H200", "v16")):
        c = tuning_db.lookup("paged_attention", "sm_90", 132, device_name=device, dtype="bfloat16", head_size=128,
                             block_size=16, num_q_heads=32, num_kv_heads=8, kv_layout="NHD", batch=8, context=2048)
        assert (c.variant, c.source) == (want, "exact")


def pa_shape(batch, context, hq=32, hkv=8, d=128, dtype="bfloat16"):
    return ADAPTER.parse_shape(dict(dtype=dtype, head_size=d, block_size=16, num_q_heads=hq, num_kv_heads=hkv,
                                    kv_layout="NHD", batch=batch, context=context))


def test_paged_attention_grid_names_real_variants_and_params():
    from hipkern.ops.paged_attention import VARIANTS
    from hipkern.tune.paged_attention import PARAM_GRID

    assert set(PARAM_GRID) <= set(VARIANTS)
    assert all(set(g) <= set(ADAPTER.schema.param_keys) for g in PARAM_GRID.values())


@pytest.mark.parametrize("batch,context,hq,hkv", [(1, 128, 32, 8), (1, 65536, 32, 8), (8, 2048, 32, 8),
                                                  (256, 65536, 32, 8), (64, 65536, 64, 8), (64, 65536, 32, 32)])
def test_paged_attention_candidates_are_distinct_launches(batch, context, hq, hkv):
    from hipkern.ops import paged_attention as pa
    from hipkern.tune.paged_attention import FILL_BLOCKS_PER_SM
    info = ADAPTER.info_for("sm_90", 132)
    shape = pa_shape(batch, context, hq, hkv)
    pr = ADAPTER.candidates(shape, info)
    launches = {c.name: launch for c, launch, _ in ADAPTER._launches(shape, info)}
    assert pr.kept[0] == ADAPTER.heuristic(shape, info)
    kept = [launches[c.name] for c in pr.kept]
    assert len(set(kept)) == len(kept)  # no launch timed twice
    assert all(launches[a] == launches[b] and (b in {c.name for c in pr.kept} or b in pr.dominated)
               for a, b in pr.same.items())
    for v in pa.VARIANTS:  # every variant's default is timed, maybe under the name of the same launch
        assert pr.same.get(v, v) in {c.name for c in pr.kept}
    blocks = {c.name: n for c, _, n in ADAPTER._launches(shape, info)}
    for a, b in pr.dominated.items():  # by a coarser split of the same kernel and scheme that fills the GPU
        (ka, _, pa_), (kb, _, pb) = launches[a], launches[b]
        assert ka == kb and pa_.per_sequence == pb.per_sequence and pa_.num_partitions > pb.num_partitions
        assert pb.grid_blocks(blocks[b], batch) >= FILL_BLOCKS_PER_SM * 132
    assert len(pr.kept) + len(pr.same) + len(pr.dominated) == len(launches)


def test_paged_attention_pruning_cases():
    info = ADAPTER.info_for("sm_90", 132)
    small = ADAPTER.candidates(pa_shape(1, 128), info)
    assert small.same["v3[partition_size=65536]"] == "v3" and not small.dominated  # one pass either way
    big = ADAPTER.candidates(pa_shape(256, 65536, 32, 32), info)
    assert "v3[partition_size=256]" in big.dominated and "v3" in {c.name for c in big.kept}
    assert big.same.get("v9") == "v3"  # both: 512-token partitions of the simt kernel


def test_new_variants_are_tuned_with_their_defaults(monkeypatch):
    from hipkern.ops import paged_attention as pa
    monkeypatch.setitem(pa.VARIANTS, "v99", pa.Variant("v99", "test", lambda shape: pa.Plan(3, 128)))
    names = [c.name for c in ADAPTER.candidates(pa_shape(1, 1024), ADAPTER.info_for("sm_90", 132)).kept]
    assert "v99" in names and not [n for n in names if n.startswith("v99[")]


def test_paged_attention_bytes():
    assert ADAPTER.nbytes(pa_shape(2, 256, 64, 1, 256, "float16")) == 2 * (2 * 2 * 256 * 256 + 2 * 2 * 64 * 256)


def test_shipped_shape_list_covers_the_issue_and_the_benchmarks_and_fits_the_budget(capsys):
    from hipkern.bench.paged_attention import LARGE_GRID, REFERENCE_GRID
    got = core.read_shapes(ADAPTER)
    keys = {core.shape_key(ADAPTER.schema, s) for s in got}
    assert len(got) == 720 == 2 * 4 * 9 * 10
    for b, c, hq, hkv, d in REFERENCE_GRID + LARGE_GRID:
        assert core.shape_key(ADAPTER.schema, pa_shape(b, c, hq, hkv, d)) in keys
    _, s = runner.plan(ADAPTER, got, Path("/nonexistent/out.csv"), ADAPTER.info_for("sm_90", 132), skip_done=False)
    assert s.estimate_s < 15 * 60  # the issue's budget: well under an hour of H100 time
    assert main(["paged_attention", "--dry-run", "--arch", "sm_90", "--cu-count", "132", "--where",
                 "dtype=float16"]) == 0
    assert "360 shapes to tune" in capsys.readouterr().out


# ---- GPU: a small real tuning run --------------------------------------------------------------------

PA_SHAPES = ["dtype=bfloat16,head_size=128,block_size=16,num_q_heads=32,num_kv_heads=8,kv_layout=NHD,batch=4,"
             "context=2048", "dtype=float16,head_size=256,block_size=16,num_q_heads=64,num_kv_heads=1,kv_layout=NHD,"
             "batch=64,context=512"]


@pytest.mark.gpu
def test_tune_paged_attention_on_gpu(tmp_path, monkeypatch):
    import hipkern
    from hipkern.ops.paged_attention import choose_variant
    from hipkern.testing import checkAllclose
    from hipkern.tune.paged_attention import DTYPES, TOL

    out = tmp_path / "sm" / "paged_attention.csv"
    todo = core.read_shapes(ADAPTER, specs=PA_SHAPES)
    s = runner.tune(ADAPTER, todo, out, progress=False)
    assert len(s.done) == 2 and s.rejected == 0 and s.db_rows == 2
    assert all(r["status"] == "ok" and float(r["us"]) > 0 for r in rows_of(core.candidates_path(out)))
    monkeypatch.setenv("HIPKERN_TUNING_DB", str(out))
    tuning_db.reset()
    for shape, row in zip(todo, rows_of(out)):
        bench = ADAPTER.prepare(shape, ADAPTER.device_info(0), 0)
        params = ("partition_size", "heads_per_block", "blocks_per_slot")  # every tuned knob the row may set
        tuned = (row["variant"], {k: int(row[k]) for k in params if row.get(k)})
        assert choose_variant(bench.q, bench.k, bench.bt, "NHD") == tuned
        o = hipkern.paged_attention_decode(bench.q, bench.k, bench.v, bench.bt, bench.cl)
        assert checkAllclose(o[bench.idx], bench.ref, **TOL[shape["dtype"]]) == 0 and o.dtype == DTYPES[shape["dtype"]]
    tuning_db.reset()


@pytest.mark.gpu
def test_tune_paged_attention_two_workers_on_one_gpu(tmp_path):
    out = tmp_path / "paged_attention.csv"
    todo = core.read_shapes(ADAPTER, specs=PA_SHAPES + [PA_SHAPES[0].replace("batch=4", "batch=1")])
    s = runner.tune(ADAPTER, todo, out, spec="paged_attention", gpus=[0, 0], progress=False)
    assert len(s.done) == 3 and not s.crashes and not s.failed and len(rows_of(out)) == 3
    assert math.isfinite(sum(float(r["us"]) for r in rows_of(out)))


def test_batches_past_a_variants_limit_and_the_largest_bucket():
    """v5 takes at most 4096 sequences (the op runs v16 in its place past that): no v5 candidate there.
    The largest batch bucket (65536, what an untuned log writes for 32769..65535 sequences) parses and is
    timed with the op's 65535 sequences."""
    info = ADAPTER.info_for("sm_90", 132)
    names = lambda b: {c.variant for c in ADAPTER.candidates(pa_shape(b, 256), info).kept}
    assert "v5" in names(4096) and "v5" not in names(8192)
    big = pa_shape(65536, 256)
    assert big["batch"] == 65536  # the row's key stays the bucket
    assert ADAPTER.nbytes(big) == ADAPTER.nbytes(pa_shape(65535, 256))
    with pytest.raises(ValueError, match="batch must be at most 65536"):
        pa_shape(65537, 256)


def test_the_largest_context_bucket_is_timed_within_the_op_s_limit():
    """Context 2^30 (the bucket of tables up to the op's 2^30 - 1 tokens) is timed with the whole blocks below
    that limit, which the op takes: every candidate would be refused at 2^30 itself."""
    from hipkern.tune.paged_attention import _context
    info = ADAPTER.info_for("sm_90", 132)
    big = pa_shape(1, 2**30)
    assert big["context"] == 2**30 and _context(big) == 2**30 - 16 and tuning_db.bucket(_context(big)) == 2**30
    assert ADAPTER.nbytes(big) == ADAPTER.nbytes(pa_shape(1, 2**30 - 16))
    assert max(launch[2].num_partitions * launch[2].partition_size
               for _, launch, _ in ADAPTER._launches(big, info) if not launch[2].per_sequence) >= 2**30 - 16
    with pytest.raises(ValueError, match="context must be at most 1073741824"):
        pa_shape(1, 2**30 + 1)


def test_the_default_on_cdna_at_head_size_256_is_the_op_s():
    """The tuner's default (its 2 % margin, the report's "gain vs the default") is what the op runs untuned:
    v3 at head size 256 on CDNA, where the matrix-core kernels do not fit 64 KB of LDS; v16 elsewhere."""
    from hipkern.ops import paged_attention as pa
    for arch in ("gfx942", "sm_90"):
        info = ADAPTER.info_for(arch, 304 if arch == "gfx942" else 132)
        for head in (128, 256):
            shape = {**pa_shape(8, 2048), "head_size": head}
            assert ADAPTER.heuristic(shape, info).name == pa.heuristic_variant(head, arch)
    assert pa.heuristic_variant(256, "gfx942") == "v3" and pa.heuristic_variant(256, "sm_90") == "v16"


def test_cdna_head_size_256_offers_no_matrix_core_candidate_the_op_refuses():
    """On CDNA the op refuses v16 / v5 at head size 256 (their tiles exceed 64 KB of LDS; kernel_runs): the
    tuner does not plan them there (planning one asked the GPU for its occupancy, which raised), and keeps
    them elsewhere."""
    from hipkern.ops import paged_attention as pa
    for arch, head in (("gfx942", 256), ("gfx942", 128), ("sm_90", 256)):
        info = ADAPTER.info_for(arch, 304 if arch == "gfx942" else 132)
        names = {c.variant for c in ADAPTER.candidates({**pa_shape(8, 2048), "head_size": head}, info).kept}
        refused = {v for v in pa.VARIANTS if not pa.kernel_runs(pa.VARIANTS[v], head, info["wave"])}
        assert refused == ({"v16", "v5"} if (arch, head) == ("gfx942", 256) else set())
        assert names and not names & refused and "v3" in names
