"""paged_attention_decode's argument checks (on any device, before any launch), its registered op and fake impl,
its split plans within the grid, and the float32 reference itself."""
import math

import pytest
import torch

import hipkern
from hipkern.reference import paged_attention_ref
from hipkern.testing import poison

from pa_cases import VARIANT_NAMES, check_out, make_case, run_and_check


# ------------------------------------------------------------------------ validation (any device)
def _cpu_case(layout="NHD", **kw):
    s, hq, hkv, d, bs, nb = 2, 8, 2, 128, 16, 10
    shape = (nb, bs, hkv, d) if layout == "NHD" else (nb, hkv, bs, d)
    c = dict(query=torch.randn(s, hq, d, dtype=torch.bfloat16), key_cache=torch.randn(shape, dtype=torch.bfloat16),
             value_cache=torch.randn(shape, dtype=torch.bfloat16), block_tables=torch.zeros(s, 4, dtype=torch.int32),
             context_lens=torch.ones(s, dtype=torch.int32))
    c.update(kw)
    return c


def _call(c, **kw):
    args = [c.pop(n) for n in ("query", "key_cache", "value_cache", "block_tables", "context_lens")]
    return hipkern.paged_attention_decode(*args, **c, **kw)


@pytest.mark.parametrize("change,kw,match", [
    (dict(query=torch.randn(2, 8, 128)), {}, "query must be one of float16, bfloat16, got float32"),
    (dict(query=torch.randn(2, 8, 96, dtype=torch.bfloat16)), {}, "query head size must be one of"),
    (dict(query=torch.randn(2, 8, dtype=torch.bfloat16)), {}, "query must have 3 dimensions"),
    (dict(query=torch.randn(2, 128, 8, dtype=torch.bfloat16).transpose(1, 2)), {}, "query must have a contiguous last"),
    (dict(key_cache=torch.randn(10, 16, 2, 128, dtype=torch.bfloat16).transpose(2, 3).contiguous().transpose(2, 3),
          value_cache=torch.randn(10, 16, 2, 128, dtype=torch.bfloat16)), {}, "key_cache must have a contiguous last"),
    (dict(key_cache=torch.randn(10, 16, 2, 64, dtype=torch.bfloat16),
          value_cache=torch.randn(10, 16, 2, 64, dtype=torch.bfloat16)), {}, "key_cache head size 64 .* differs"),
    (dict(query=torch.randn(65536, 8, 128, dtype=torch.bfloat16), block_tables=torch.zeros(65536, 4, dtype=torch.int32),
          context_lens=torch.ones(65536, dtype=torch.int32)), {}, "query must hold 1..65535 sequences"),
    (dict(key_cache=torch.randn(10, 16, 2, 128, dtype=torch.float16)), {}, "key_cache must be one of bfloat16"),
    (dict(value_cache=torch.randn(10, 16, 2, 64, dtype=torch.bfloat16)), {}, "value_cache must have the shape"),
    (dict(value_cache=torch.randn(10, 2, 16, 128, dtype=torch.bfloat16).transpose(1, 2)), {},
     "value_cache must have the shape and strides of key_cache"),  # another layout: strides differ
    # one KV head: the head dimension's stride never matters, so both layouts' tensors pass as "NHD" caches
    (dict(key_cache=torch.randn(10, 16, 1, 128, dtype=torch.bfloat16),
          value_cache=torch.randn(10, 1, 16, 128, dtype=torch.bfloat16).transpose(1, 2),
          query=torch.randn(2, 4, 128, dtype=torch.bfloat16)), {}, "query must be on a GPU"),
    (dict(key_cache=torch.randn(10, 16, 2, 132, dtype=torch.bfloat16)[..., :128],
          value_cache=torch.randn(10, 16, 2, 132, dtype=torch.bfloat16)[..., :128]), {}, "key_cache/value_cache rows must be 16-byte aligned"),
    (dict(key_cache=torch.randn(10, 16, 3, 128, dtype=torch.bfloat16),
          value_cache=torch.randn(10, 16, 3, 128, dtype=torch.bfloat16)), {}, r"multiple of key_cache's KV heads"),
    (dict(key_cache=torch.randn(10, 12, 2, 128, dtype=torch.bfloat16),
          value_cache=torch.randn(10, 12, 2, 128, dtype=torch.bfloat16)), {}, "key_cache block size must be a power of two"),
    (dict(query=torch.randn(2, 9, 128, dtype=torch.bfloat16)), {}, "multiple of key_cache.s KV heads"),
    (dict(block_tables=torch.zeros(2, 4, dtype=torch.int64)), {}, "block_tables must be one of int32"),
    (dict(block_tables=torch.zeros(3, 4, dtype=torch.int32)), {}, r"block_tables must be \[num_seqs=2"),
    (dict(context_lens=torch.ones(3, dtype=torch.int32)), {}, r"context_lens must have shape \(2,\)"),
    (dict(context_lens=torch.ones(2, dtype=torch.int64)), {}, "context_lens must be one of int32"),
    ({}, dict(kv_layout="NDH"), "kv_layout must be one of"),
    ({}, dict(variant="v99"), "variant must be None or one of"),
    ({}, dict(variant="v8"), r"variant must be None or one of \['v16', 'v3', 'v5', 'v6', 'v9', 'v4', 'v7'\]"),
    (dict(query=torch.randn(4097, 8, 128, dtype=torch.bfloat16), block_tables=torch.zeros(4097, 4, dtype=torch.int32),
          context_lens=torch.ones(4097, dtype=torch.int32)), dict(variant="v5"), "v5 supports at most 4096 sequences"),
    ({}, dict(scale=float("nan")), r"scale must be a float with scale \* log2\(e\) finite in float32"),
    ({}, dict(scale=1e39), "scale must be a float with"),  # finite in float64, inf in the kernels
    ({}, dict(scale=10**400), "scale must be a float with"),
    ({}, dict(scale=3e38), "scale must be a float with"),  # finite in float32, but not times log2(e)
    ({}, dict(variant=["v3"]), "variant must be None or a str, got list"),
    (dict(query=torch.randn(2, 0, 128, dtype=torch.bfloat16)), {}, "query must have at least one head"),
    ({}, dict(return_lse=1), "return_lse must be a bool"),
    ({}, dict(out=torch.empty(2, 8, 64, dtype=torch.bfloat16)), r"out must have shape \(2, 8, 128\)"),
    ({}, {}, "query must be on a GPU"),
])
def test_bad_arguments_raise_value_error(change, kw, match):
    with pytest.raises(ValueError, match=match) as err:
        _call(_cpu_case(**change), **kw)
    if "GPU" not in match:  # the bad argument's own check fired, not the last one (CPU tensors' device check)
        assert "must be on a GPU" not in str(err.value), str(err.value)


def test_the_registered_op_s_fake_validates_too():
    """torch.ops.hipkern.paged_attention_decode traced (fake tensors, as torch.compile does) checks its
    arguments as the Python function does, and its lse, instead of tracing a call that fails later."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 8, 128, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(10, 16, 2, 128, dtype=torch.bfloat16, device="cuda")
        bt, cl = torch.empty(2, 4, dtype=torch.int32, device="cuda"), torch.empty(2, dtype=torch.int32, device="cuda")
        out, lse = torch.empty_like(q), torch.empty(2, 8, device="cuda")
        torch.ops.hipkern.paged_attention_decode(q, k, k, bt, cl, 0.1, "NHD", "v4", out, lse)
        with pytest.raises(ValueError, match=r"context_lens must have shape \(2,\)"):
            torch.ops.hipkern.paged_attention_decode(q, k, k, bt, torch.empty(1, dtype=torch.int32, device="cuda"),
                                                     0.1, "NHD", "", out, lse)
        with pytest.raises(ValueError, match=r"lse must have shape \(2, 8\)"):
            torch.ops.hipkern.paged_attention_decode(q, k, k, bt, cl, 0.1, "NHD", "", out,
                                                     torch.empty(1, 8, device="cuda"))
        with pytest.raises(ValueError, match="scale must be a float with"):
            torch.ops.hipkern.paged_attention_decode(q, k, k, bt, cl, 3e38, "NHD", "", out, lse)


def test_a_variant_that_cannot_run_the_head_size_is_refused_while_tracing(monkeypatch):
    """v16/v5 at head size 256 on CDNA: refused by the validation (so by the fake, as torch.compile traces), not
    only at the launch, after out was allocated and the module built."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from hipkern import jit

    gpu = ["gfx942"]  # the arch of "GPU 0"
    monkeypatch.setattr(jit.platform, "_device_arch", lambda index: gpu[0])
    monkeypatch.setenv("HIPKERN_ARCH", "gfx942")
    with FakeTensorMode():
        q = torch.empty(2, 8, 256, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(10, 16, 2, 256, dtype=torch.bfloat16, device="cuda")
        bt, cl = torch.empty(2, 4, dtype=torch.int32, device="cuda"), torch.empty(2, dtype=torch.int32, device="cuda")
        out, lse = torch.empty_like(q), torch.empty(2, 8, device="cuda")
        for variant in ("v16", "v4", "v5"):
            with pytest.raises(ValueError, match="supports head sizes 64 and 128 on this GPU"):
                torch.ops.hipkern.paged_attention_decode(q, k, k, bt, cl, 0.1, "NHD", variant, out, lse)
        for variant in ("v3", "v9", "v6", ""):  # these run it
            torch.ops.hipkern.paged_attention_decode(q, k, k, bt, cl, 0.1, "NHD", variant, out, lse)
        monkeypatch.delenv("HIPKERN_ARCH")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        for variant in ("v16", "v5"):  # the GPU's own arch, without HIPKERN_ARCH
            with pytest.raises(ValueError, match="supports head sizes 64 and 128 on this GPU"):
                torch.ops.hipkern.paged_attention_decode(q, k, k, bt, cl, 0.1, "NHD", variant, out, lse)
        gpu[0] = "sm_90"
        torch.ops.hipkern.paged_attention_decode(q, k, k, bt, cl, 0.1, "NHD", "v16", out, lse)
        monkeypatch.setenv("HIPKERN_ARCH", "gfx942")  # code this GPU cannot run: the module load says so, at launch
        torch.ops.hipkern.paged_attention_decode(q, k, k, bt, cl, 0.1, "NHD", "v16", out, lse)


def test_choose_variant_says_what_the_op_runs_past_a_variant_s_sequence_limit(monkeypatch):
    """A (nearest) database row choosing v5 for a call of more sequences than v5 takes: the op runs v16, and
    choose_variant (the benchmark's Variant column, the tests' expectations) says so."""
    from hipkern.ops import paged_attention as pa
    monkeypatch.setattr(pa, "_lookup", lambda *a: ("v5", {"blocks_per_slot": 2}))
    for seqs, want in ((pa.MAX_PER_SEQUENCE_SEQS, ("v5", {"blocks_per_slot": 2})),
                       (pa.MAX_PER_SEQUENCE_SEQS + 1, ("v16", {}))):
        c = _cpu_case(query=torch.randn(seqs, 8, 128, dtype=torch.bfloat16),
                      block_tables=torch.zeros(seqs, 4, dtype=torch.int32))
        assert pa.choose_variant(c["query"], c["key_cache"], c["block_tables"], "NHD") == want


def test_empty_cache_and_oversized_tables_rejected():
    c = _cpu_case(key_cache=torch.randn(0, 16, 2, 128, dtype=torch.bfloat16),
                  value_cache=torch.randn(0, 16, 2, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="key_cache must hold at least one block"):
        _call(c)
    wide = torch.empty(2, 2**26, dtype=torch.int32)  # never touched; 2^26 blocks x 16 tokens = 2^30 > 2^30 - 1
    with pytest.raises(ValueError, match=r"block_tables addresses 1073741824 tokens per sequence"):
        _call(_cpu_case(block_tables=wide))


def test_split_stays_within_the_grid():
    from hipkern.ops.paged_attention import MAX_PARTITIONS, Shape, _split

    for max_tokens, size in ((2**30 - 1, 512), (10**8, 1), (4096, 512), (100, 512)):
        shape = Shape(1, 1, 1, max_tokens, 132, 128, 1)
        plan = _split(shape, size)
        assert 1 <= plan.num_partitions <= MAX_PARTITIONS
        assert plan.num_partitions * plan.partition_size >= max_tokens
        assert plan.num_partitions == 1 or (plan.num_partitions - 1) * plan.partition_size < max_tokens
        assert plan.num_partitions == 1 or plan.partition_size % shape.tile == 0  # whole tiles
    assert _split(Shape(1, 1, 1, 4096, 132, 64, 1), 100) == _split(Shape(1, 1, 1, 4096, 132, 64, 1), 128)


def test_split_keeps_hip_grids_under_2_pow_32_threads():
    """On 64-lane waves (HIP, which runs a grid of 2^32 threads or more wrongly and whose launcher refuses
    one) a split's partitions grow until its decode grid has at most HIP_MAX_GRID_BLOCKS blocks: e.g. v3 at
    4096 sequences x 32 KV heads of a 2^17-token block table, 256 partitions of 512 tokens (2^25 blocks)."""
    from hipkern.ops.paged_attention import HIP_MAX_GRID_BLOCKS, MAX_PARTITIONS, VARIANTS, _split, make_shape

    for name, seqs, kv_heads, tokens in (("v3", 4096, 32, 2**17), ("v9", 4096, 8, 2**20), ("v9", 65535, 64, 2**17),
                                         ("v16", 4096, 32, 2**20)):
        var = VARIANTS[name]
        for wave in (32, 64):
            shape = make_shape(var, seqs, kv_heads * 8, kv_heads, tokens, 304, wave)
            assert shape.max_grid_blocks == (HIP_MAX_GRID_BLOCKS if wave == 64 else 0)
            for size in (64, 512, None):
                plan = _split(shape, size) if size else var.plan(shape)
                assert plan.num_partitions * plan.partition_size >= tokens
                assert plan.num_partitions == 1 or plan.partition_size % shape.tile == 0
                assert plan.num_partitions <= MAX_PARTITIONS
                if wave == 64 and shape.blocks <= HIP_MAX_GRID_BLOCKS:
                    assert shape.blocks * plan.num_partitions <= HIP_MAX_GRID_BLOCKS, (name, seqs, size, plan)
    # v5's per-sequence split: its num_seqs + split_target items of per-item blocks stay under the cap too
    for seqs, kv_heads, bps in ((4096, 64, 1), (4096, 128, 4096), (1, 1, 64)):  # (the second: capped)
        shape = make_shape(VARIANTS["v5"], seqs, kv_heads * 64, kv_heads, 2**17, 304, 64, resident=4)
        plan = VARIANTS["v5"].plan(shape, blocks_per_slot=bps)
        per_item = shape.blocks // seqs
        assert plan.per_sequence and 1 <= plan.num_partitions <= 65535 - seqs
        assert per_item * (seqs + plan.num_partitions) <= HIP_MAX_GRID_BLOCKS, (seqs, kv_heads, bps, plan)
    # a grid past the cap even unsplit (65535 x 65 KV heads) runs one pass (the launcher then judges it)
    shape = make_shape(VARIANTS["v9"], 65535, 65 * 4, 65, 2**17, 304, 64)
    assert shape.blocks > HIP_MAX_GRID_BLOCKS and _split(shape, 512).num_partitions == 1
    # 32-lane waves keep the partitions asked for
    shape = make_shape(VARIANTS["v9"], 4096, 256, 32, 2**20, 132, 32)
    assert _split(shape, 512).num_partitions == 2**11


def test_balanced_plan_splits_only_grids_short_of_the_memory_rate():
    from hipkern.ops.paged_attention import SATURATE_BLOCKS, Shape, _plan_balanced

    # (sequences, KV heads) x 2048 tokens of 16-head blocks, two an SM (head 128 on the H100): 128 blocks
    # already stream at the memory's rate, so a split would add only its merge (measured 2.5-3.5 % slower
    # at 16 x 2048 x 8 KV heads); 64 blocks do not, and are split (8 x 2048: 30.0 us in 2 partitions against
    # 34.7 unsplit).
    def plan(seqs, kv_heads, tokens=2048):
        return _plan_balanced(Shape(seqs, kv_heads, 8, tokens, 132, 64, 16, resident=2))

    assert 64 < SATURATE_BLOCKS < 128
    assert plan(16, 8).num_partitions == 1 and plan(16, 8, 65536).num_partitions == 1
    assert plan(8, 8).num_partitions > 1
    assert plan(32, 8).num_partitions == 1  # 256 blocks: one pass, as before
    assert plan(1, 8).num_partitions > 1  # 8 blocks: split for the SMs, as before
    # 288 blocks: a second wave of 24 would stream alone, far under the memory's rate: split, as before
    assert plan(36, 8).num_partitions > 1


def test_gqa_above_64_rejected():
    c = _cpu_case(query=torch.randn(2, 130, 128, dtype=torch.bfloat16),
                  key_cache=torch.randn(10, 16, 1, 128, dtype=torch.bfloat16),
                  value_cache=torch.randn(10, 16, 1, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="GQA ratio query heads / KV heads must be at most 64, got 130"):
        _call(c)


def _masked_loop(q, k, v, bt, cl, scale=None):
    """The op's documented handling of bad metadata (NHD), in float32, token by token (independent of the
    reference): a length clamped to [0, what the block-table row addresses]; a token whose block id is
    outside [0, num_blocks) is left out (masked), the sequence's other tokens attended as usual."""
    nb, bs, hkv, d = k.shape
    group = q.shape[1] // hkv
    scale = d ** -0.5 if scale is None else scale
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
    for s in range(q.shape[0]):
        n = max(0, min(int(cl[s]), bt.shape[1] * bs))
        t = torch.arange(n, device=q.device)
        blk = bt[s, t // bs].long()
        keep = (blk >= 0) & (blk < nb)
        t, blk = t[keep], blk[keep]
        if t.numel() == 0:
            continue
        kk, vv = k[blk, t % bs].float(), v[blk, t % bs].float()  # [tokens, hkv, d]
        scores = torch.einsum("hgd,nhd->hgn", q[s].float().view(hkv, group, d), kk) * scale
        lse[s] = torch.logsumexp(scores, dim=-1).reshape(-1)
        out[s] = torch.einsum("hgn,nhd->hgd", torch.softmax(scores, dim=-1), vv).reshape(-1, d)
    return out, lse


def test_reference_masks_bad_metadata_as_the_op_documents():
    """paged_attention_ref (the GPU tests' reference) on invalid block ids and lengths past the row or
    below 0, against a token-by-token loop."""
    g = torch.Generator().manual_seed(3)
    for bs in (1, 4, 16):
        k, v = torch.randn(20, bs, 2, 64, generator=g), torch.randn(20, bs, 2, 64, generator=g)
        q = torch.randn(3, 8, 64, generator=g)
        bt = torch.randint(-3, 23, (3, 6), generator=g, dtype=torch.int32)
        cl = torch.tensor([-5, 3 * bs + 1, 10**6], dtype=torch.int32)
        ref, ref_lse = paged_attention_ref(q, k, v, bt, cl)
        want, want_lse = _masked_loop(q, k, v, bt, cl)
        assert torch.allclose(ref, want, atol=1e-6, rtol=1e-5) and torch.allclose(ref_lse, want_lse, atol=1e-6)
        assert (ref[0] == 0).all() and (ref_lse[0] == -math.inf).all()


def test_reference_handles_both_layouts():
    c = _cpu_case()
    k_hnd, v_hnd = c["key_cache"].transpose(1, 2).contiguous(), c["value_cache"].transpose(1, 2).contiguous()
    c["block_tables"] = torch.tensor([[3, 1, 0, 2], [5, 6, 7, 8]], dtype=torch.int32)
    c["context_lens"] = torch.tensor([40, 0], dtype=torch.int32)
    a = paged_attention_ref(c["query"], c["key_cache"], c["value_cache"], c["block_tables"], c["context_lens"])
    b = paged_attention_ref(c["query"], k_hnd, v_hnd, c["block_tables"], c["context_lens"], kv_layout="HND")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert (a[0][1] == 0).all() and (a[1][1] == -math.inf).all()


def test_byte_spans_of_contiguous_tensors_take_the_short_way_to_the_same_answer():
    """_byte_span answers contiguous tensors from numel alone (every eager call checks overlaps): the same span
    as the strides give, also for size-1 dimensions with odd strides; other layouts by their strides."""
    from hipkern.ops._common import _byte_span

    def by_strides(t):
        reach = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if st > 0)
        return t.data_ptr(), t.data_ptr() + (reach + 1) * t.element_size()

    base = torch.randn(6, 8, 128)
    cases = [base, base[2:4], base[3], base.as_strided((1, 8, 128), (4096, 128, 1), 256),
             torch.randn(3, 5).half(), torch.ones(1)]
    for t in cases:
        assert t.is_contiguous() and _byte_span(t) == by_strides(t)
    for t in (base[:, ::2], base.transpose(0, 1), base[:, 2:5], base[:, :1]):  # not contiguous: the strides' reach
        assert not t.is_contiguous() and _byte_span(t) == by_strides(t)
    assert _byte_span(base[:0]) == (0, 0)


def test_out_overlapping_an_input_is_rejected_at_launch():
    """Blocks write their heads' output rows while other blocks still read query rows (and the cache):
    out may be query itself (in place), but share no other memory with an input. Checked at launch
    (addresses), so on a GPU; the check itself is exercised here on CPU tensors."""
    from hipkern.ops._common import check_no_overlap

    buf = torch.randn(4, 8, 128)
    q = buf[:2]
    check_no_overlap("out", q, "query", query=q)  # in place: allowed
    check_no_overlap("out", buf[2:], "query", query=q)  # disjoint
    with pytest.raises(ValueError, match=r"out must not overlap query in memory \(only exactly the same"):
        check_no_overlap("out", buf[1:3], "query", query=q)
    with pytest.raises(ValueError, match="out must not overlap key_cache in memory"):
        check_no_overlap("out", buf[:2], "query", query=torch.randn(2, 8, 128), key_cache=buf)
    strided = torch.randn(2, 16, 128)[:, :8]  # query's heads interleaved with other memory
    with pytest.raises(ValueError, match="out must not overlap query"):
        check_no_overlap("out", strided.as_strided((2, 8, 128), (1024, 128, 1), 1024), "query", query=strided)
    check_no_overlap("out", torch.empty(0, 8, 128), "query", query=q)  # nothing written
    one = torch.randn(1, 8, 128)  # one sequence: its stride is any (here 4096 against out's 1024), same memory
    check_no_overlap("out", one.as_strided((1, 8, 128), (1024, 128, 1)), "query",
                     query=one.as_strided((1, 8, 128), (4096, 128, 1)))
    with pytest.raises(ValueError, match="only exactly the same"):  # same start, another layout
        check_no_overlap("out", buf[:2].as_strided((2, 4, 128), (512, 128, 1)), "query",
                         query=buf[:2].as_strided((2, 4, 128), (1024, 128, 1)))


@pytest.mark.gpu
def test_out_overlapping_query_is_rejected_and_out_is_query_works():
    torch.manual_seed(5)
    s, hq, hkv, d, bs = 3, 8, 2, 128, 16
    k = torch.randn(8, bs, hkv, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    bt = torch.arange(6, dtype=torch.int32, device="cuda").view(3, 2)
    cl = torch.tensor([5, 32, 17], dtype=torch.int32, device="cuda")
    buf = torch.randn(s + 1, hq, d, dtype=torch.bfloat16, device="cuda")
    q = buf[:s]
    want = paged_attention_ref(q, k, v, bt, cl)[0]
    with pytest.raises(ValueError, match="out must not overlap query"):
        hipkern.paged_attention_decode(q, k, v, bt, cl, out=buf[1:])
    with pytest.raises(ValueError, match="out must not overlap key_cache"):
        hipkern.paged_attention_decode(q, k, v, bt, cl, out=k.view(-1)[: q.numel()].view(q.shape))
    res = hipkern.paged_attention_decode(q, k, v, bt, cl, out=q)  # in place
    assert res is q
    assert check_out(res, want) == 0


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_reference_against_sdpa_on_gathered_kv(layout):
    """paged_attention_ref (the tests' and the benchmark's reference) against torch's own attention on
    each sequence's gathered K/V, KV heads repeated over their query group (a GQA mapping or a scale
    convention shared by the kernels and the reference would show here), on the CPU (float64 inputs; the
    reference's scores and softmax are float32)."""
    torch.manual_seed(3)
    s, hkv, group, d, bs, nb = 3, 2, 4, 64, 16, 12
    lens = [37, 1, 64]
    q = torch.randn(s, hkv * group, d, dtype=torch.float64)
    k = torch.randn(nb, bs, hkv, d, dtype=torch.float64)
    v = torch.randn(nb, bs, hkv, d, dtype=torch.float64)
    bt = torch.randperm(nb)[: s * 4].view(s, 4).to(torch.int32)
    cl = torch.tensor(lens, dtype=torch.int32)
    kc, vc = (k, v) if layout == "NHD" else (k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous())
    out, lse = paged_attention_ref(q, kc, vc, bt, cl, scale=0.3, kv_layout=layout, compute_dtype=torch.float64)
    for i, n in enumerate(lens):
        kk = k[bt[i].long()].reshape(-1, hkv, d)[:n].transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, n, d]
        vv = v[bt[i].long()].reshape(-1, hkv, d)[:n].transpose(0, 1).repeat_interleave(group, dim=0)
        want = torch.nn.functional.scaled_dot_product_attention(q[i][:, None], kk, vv, scale=0.3)[:, 0]
        torch.testing.assert_close(out[i], want, rtol=1e-4, atol=1e-5)  # the reference's softmax is float32
        scores = (q[i][:, None] * kk).sum(-1) * 0.3  # [Hq, n]
        torch.testing.assert_close(lse[i].double(), scores.exp().sum(-1).log(), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_direct_op_calls_are_validated_before_any_launch():
    """torch.ops.hipkern.paged_attention_decode called directly gets the Python function's checks (a block
    table with fewer rows than sequences had been read past its end), and its lse's shape is checked."""
    q, k, v, bt, cl = make_case([40, 70])
    scale = q.shape[-1] ** -0.5
    out = poison(torch.empty_like(q))
    no_lse = torch.empty((0,), dtype=torch.float32, device="cuda")
    with pytest.raises(ValueError, match="block_tables must be"):
        torch.ops.hipkern.paged_attention_decode(q, k, v, bt[:1], cl, scale, "NHD", "", out, no_lse)
    with pytest.raises(ValueError, match=r"lse must have shape \(2, 8\)"):
        torch.ops.hipkern.paged_attention_decode(q, k, v, bt, cl, scale, "NHD", "",
                                                 out, torch.empty((1, 8), dtype=torch.float32, device="cuda"))
    with pytest.raises(ValueError, match="variant must be None or one of"):
        torch.ops.hipkern.paged_attention_decode(q, k, v, bt, cl, scale, "NHD", "v99", out, no_lse)
    torch.cuda.synchronize()
    assert bool(out.isnan().all())
    torch.ops.hipkern.paged_attention_decode(q, k, v, bt, cl, scale, "NHD", "v4", out, no_lse)  # an alias runs
    ref, _ = paged_attention_ref(q, k, v, bt, cl, scale=scale, kv_layout="NHD")
    assert check_out(out, ref, msg="direct call ") == 0


@pytest.mark.gpu
@pytest.mark.parametrize("v_stride", [2**40, 12345])
@pytest.mark.parametrize("dim", ["block", "head", "token"])
def test_any_stride_of_a_one_element_dimension(dim, v_stride):
    """torch allows any stride on a dimension of one element (here 2^40 elements, which the tensor maps
    refuse): it is read as 0, so every variant runs such a cache (the tensor-map ones had raised); and
    value_cache may have another stride there than key_cache (an MQA cache allocated in another layout)."""
    nb, bs, hkv = {"block": (1, 16, 2), "head": (4, 16, 1), "token": (40, 1, 2)}[dim]
    d, group = 128, 4
    base = torch.randn(2, nb * bs * hkv * d, device="cuda").to(torch.bfloat16)
    strides = [bs * hkv * d, hkv * d, d, 1]
    strides[{"block": 0, "token": 1, "head": 2}[dim]] = 2**40
    k = torch.as_strided(base[0], (nb, bs, hkv, d), strides)
    v_strides = list(strides)
    v_strides[{"block": 0, "token": 1, "head": 2}[dim]] = v_stride
    v = torch.as_strided(base[1], (nb, bs, hkv, d), v_strides)
    n = min(nb * bs, 37)
    bt = torch.arange(nb, dtype=torch.int32, device="cuda").flip(0).view(1, nb).repeat(2, 1).contiguous()
    cl = torch.tensor([n, max(1, n // 2)], dtype=torch.int32, device="cuda")
    q = torch.randn(2, hkv * group, d, device="cuda").to(torch.bfloat16)
    for variant in VARIANT_NAMES:
        run_and_check((q, k, v, bt, cl), variant=variant, msg=f"{variant} {dim} ")


@pytest.mark.gpu
def test_a_one_column_block_table_with_any_column_stride():
    """A [num_seqs, 1] table whose column stride is not 1 (a transposed [1, num_seqs] tensor): torch allows
    any stride on a one-element dimension and the kernels never use it."""
    q, k, v, bt, cl = make_case([16, 5, 1, 0], num_kv_heads=2, group=4, extra_blocks=0)
    assert bt.shape[1] == 1
    bt_t = bt.view(1, -1).clone().t()
    assert bt_t.stride() == (1, 4) and torch.equal(bt_t, bt)
    for variant in VARIANT_NAMES:
        run_and_check((q, k, v, bt_t, cl), variant=variant, msg=f"{variant} ")


@pytest.mark.gpu
def test_a_direct_call_s_lse_must_not_overlap():
    q, k, v, bt, cl = make_case([40, 70])
    out = poison(torch.empty_like(q))
    buf = torch.empty(q.numel() * 2, dtype=torch.float32, device="cuda")
    for lse, name in ((out.view(-1).view(torch.float32)[: 16].view(2, 8), "out"),
                      (q.view(-1).view(torch.float32)[: 16].view(2, 8), "query")):
        with pytest.raises(ValueError, match=f"lse must not overlap {name}"):
            torch.ops.hipkern.paged_attention_decode(q, k, v, bt, cl, 0.1, "NHD", "", out, lse)
    torch.ops.hipkern.paged_attention_decode(q, k, v, bt, cl, 0.1, "NHD", "", out, buf[:16].view(2, 8))
