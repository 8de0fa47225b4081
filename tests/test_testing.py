"""Tests of hipkern.testing: checkAllclose, poison, run_perftest/perftest, BenchTable (CPU), and what
run_perftest's stream hold and L2 flush do on a GPU."""
import time

import math
import re
import warnings

import pandas as pd
import pytest
import torch

from hipkern.testing import BenchTable, checkAllclose, l2_bytes, perftest, poison, rows_scaled, run_perftest


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _check(capsys, a, b, **kw):
    """Run checkAllclose; return (its result, what it printed)."""
    res = checkAllclose(a, b, **kw)
    return res, capsys.readouterr().out


def _max_delta(out):
    return float(re.search(r"max abs delta:(\S+),", out).group(1))


def _perturbed(b, k, delta=0.5):
    """A copy of `b` with `k` random elements moved by `delta` (one of them by 3*delta)."""
    a = b.clone()
    idx = torch.randperm(b.numel())[:k]
    a.view(-1)[idx] += delta
    a.view(-1)[idx[0]] += 2 * delta
    return a


# ---------------------------------------------------------------- checkAllclose
def test_rows_scaled_tightens_atol_for_small_rows_only(capsys):
    """Rows of size ~0.004 (attention at 131072 tokens): a 30 % error passes a plain atol of 8e-3 but not
    the row-scaled one; a row of size >= 1 keeps the plain tolerance; NaN and a nonzero element against
    an all-zero reference row fail."""
    ref = torch.randn(3, 128, dtype=torch.float64)
    ref[0] *= 0.004 / ref[0].abs().max()
    ref[1] *= 3 / ref[1].abs().max()
    ref[2] = 0
    got = ref.clone()
    got[0] *= 1.3
    assert _check(capsys, got, ref, atol=8e-3, rtol=8e-3)[0] == 0
    assert _check(capsys, *rows_scaled(got, ref), atol=8e-3, rtol=8e-3)[0] > 0
    ok = ref.clone()
    ok[1] += 7e-3  # under the plain atol on a row of size 3
    ok[0] += 1e-5  # 0.25 % of the row's size
    assert _check(capsys, *rows_scaled(ok, ref), atol=8e-3, rtol=8e-3)[0] == 0
    for bad in (math.nan, 1e-9):
        wrong = ref.clone()
        wrong[2, 5] = bad
        assert _check(capsys, *rows_scaled(wrong, ref), atol=8e-3, rtol=8e-3)[0] > 0


def test_rows_scaled_keeps_errors_in_a_row_whose_reference_has_a_nan_or_inf(capsys):
    """A NaN in a reference row made the row's scale NaN, so the whole row compared NaN against NaN (equal) and
    every error in it passed; an infinity made the scale the cap, as any large element does."""
    for bad in (math.nan, math.inf):
        ref = torch.randn(2, 4, dtype=torch.float64)
        ref[0, 0] = bad
        got = ref.clone()
        assert _check(capsys, *rows_scaled(got, ref))[0] == 0  # the same non-finite value on both sides
        got[0, 1:] += 100
        assert _check(capsys, *rows_scaled(got, ref))[0] == pytest.approx(3 / 8)


def test_identical_passes_with_msg_prefix(capsys):
    b = torch.randn(64, 33)
    res, out = _check(capsys, b.clone(), b, atol=1e-3, rtol=1e-4, msg="layer7 q_proj ")
    assert res == 0.0
    assert out == "layer7 q_proj [checkAllclose atol=0.001 rtol=0.0001 passed~]\n"


@pytest.mark.parametrize("tol, word", [(0.0, "failed!"), (0.036, "failed!"),
                                       (0.037, "warning!"), (0.05, "warning!")])  # share is 0.037
def test_known_share_of_mismatches(capsys, tol, word):
    b = torch.randn(1000, dtype=torch.float64)
    a = _perturbed(b, 37)
    res, out = _check(capsys, a, b, tol_err_ratio=tol)
    assert res == 37 / 1000
    assert f"{word}]" in out and out.count("!") == 1
    assert "3.70% (37 of 1000)" in out
    assert _max_delta(out) == pytest.approx(float((a - b).abs().max()), rel=1e-5) == 1.5


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_where_reference_finite_fails(capsys, bad):
    b = torch.randn(100)
    a = b.clone()
    a[17] = bad
    res, out = _check(capsys, a, b, tol_err_ratio=0.5)
    assert res == 1.0
    assert "failed!" in out and "non-finite" in out


@pytest.mark.parametrize("a_bad, b_bad", [(-math.inf, math.inf), (math.nan, math.inf), (math.inf, math.nan)])
def test_nonfinite_mismatch_on_either_side_fails(capsys, a_bad, b_bad):
    b = torch.randn(100)
    a = b.clone()
    a[5], b[5] = a_bad, b_bad
    res, out = _check(capsys, a, b, tol_err_ratio=0.5)
    assert res == 1.0 and "failed!" in out


def test_complex_compares_both_parts(capsys):
    b = torch.tensor([1 + 0j, 2 - 1j], dtype=torch.complex64)
    res, out = _check(capsys, torch.tensor([1 + 5j, 2 - 1j], dtype=torch.complex64), b, tol_err_ratio=0.9)
    assert res == 0.25 and "warning!" in out  # one of four parts differs
    assert _check(capsys, b.clone(), b)[0] == 0.0


def test_integers_past_2_pow_53_compare_exactly(capsys):
    b = torch.tensor([2**60, 7], dtype=torch.int64)
    res, out = _check(capsys, torch.tensor([2**60 + 1, 7]), b, atol=0, rtol=0)
    assert res == 0.5 and "max abs delta:1," in out  # float64 would round them equal (and print a delta of 0)
    assert _check(capsys, torch.tensor([2**60 + 1, 7]), b, atol=1, rtol=0)[0] == 0.0
    assert _check(capsys, b.clone(), b, atol=0, rtol=0)[0] == 0.0
    assert _check(capsys, torch.tensor([5, 7], dtype=torch.int32), torch.tensor([5, 8], dtype=torch.int32),
                  atol=0, rtol=0)[0] == 0.5
    # a poisoned int64 (its most negative value) against values whose difference leaves int64: never close
    low = torch.full((3,), torch.iinfo(torch.int64).min)
    assert _check(capsys, low, torch.tensor([0, 5, 2**62]), atol=0, rtol=0)[0] == 1.0
    assert _check(capsys, low, low.clone(), atol=0, rtol=0)[0] == 0.0


def test_integers_compare_exactly_by_default(capsys):
    ids = torch.tensor([1000, 3, 7], dtype=torch.int32)
    res, out = _check(capsys, torch.tensor([1010, 3, 7], dtype=torch.int32), ids)
    assert res == pytest.approx(1 / 3) and "atol=0 rtol=0 failed!" in out  # 1e-2 of 1000 would have passed it
    assert _check(capsys, torch.tensor([1010, 3, 7], dtype=torch.int32), ids, rtol=1e-2)[0] == 0.0  # asked for
    assert _check(capsys, ids.clone(), ids)[0] == 0.0
    # a float on either side keeps the float defaults (1e-2)
    res, out = _check(capsys, torch.tensor([1005.0, 3.0, 7.0]), ids)
    assert res == 0.0 and "atol=0.01 rtol=0.01 passed" in out


def test_inputs_are_rotated_past_the_last_level_cache(monkeypatch):
    """On gfx942 (MI300: 4 MB of L2 an XCD, reported for one XCD of up to 8, a 256 MB Infinity Cache
    behind it) run_perftest's rotation target covers every XCD's L2 and the Infinity Cache; elsewhere it
    is L2."""
    from hipkern import testing

    class Props:
        def __init__(self, arch, l2):
            self.gcnArchName, self.L2_cache_size = arch, l2

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for arch, l2, want in (("gfx942:sramecc+:xnack-", 4 << 20, (32 << 20) + (256 << 20)), ("", 50 << 20, 50 << 20)):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d, p=Props(arch, l2): p)
        assert testing.l2_bytes() == want


def _nan_in_both():
    b = torch.randn(50)
    b[3] = math.nan
    return b.clone(), b


def _bf16_vs_fp32():  # mixed dtypes are compared too
    b = torch.randn(256)
    return b.to(torch.bfloat16), b


@pytest.mark.parametrize("make", [_nan_in_both, _bf16_vs_fp32, lambda: (torch.empty(0, 3),) * 2],
                         ids=["nan_in_both", "bf16_vs_fp32", "empty"])
def test_passes(capsys, make):
    res, out = _check(capsys, *make())
    assert res == 0.0 and "passed~" in out


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="shapes differ"):
        checkAllclose(torch.randn(4, 5), torch.randn(5, 4))


@pytest.mark.parametrize("dtype, x, y, exact", [
    (torch.float16, 60000.0, -60000.0, 120000.0),  # a - b overflows fp16
    (torch.bfloat16, 256.0, -1.0, 257.0),          # a - b rounds to 256 in bf16
])
def test_low_precision_compared_in_float64(capsys, dtype, x, y, exact):
    a = torch.tensor([x, 1.0], dtype=dtype)
    b = torch.tensor([y, 1.0], dtype=dtype)
    assert (a - b)[0].item() != exact  # the low-precision difference would be wrong
    res, out = _check(capsys, a, b)
    assert res == 0.5
    assert _max_delta(out) == exact


@pytest.mark.parametrize("a, b, atol, rtol, ok", [
    (2.5, 2.0, 0.25, 0.125, True),              # |a-b| == atol + rtol*|b| exactly
    (2.5 + 2 ** -20, 2.0, 0.25, 0.125, False),  # just beyond
    (1.5, 2.0, 0.25, 0.125, True),              # other side, on the boundary
    (2.0, 4.0, 0.0, 0.5, True),                 # rtol scales |b|, the reference ...
    (4.0, 2.0, 0.0, 0.5, False),                # ... not |a|
    (1.0 + 2 ** -10, 1.0, 2 ** -10, 0.0, True),  # atol alone, on the boundary
    (1.0 + 2 ** -9, 1.0, 2 ** -10, 0.0, False),
])
def test_atol_rtol_boundary(capsys, a, b, atol, rtol, ok):
    ta, tb = (torch.tensor([v], dtype=torch.float64) for v in (a, b))
    res, out = _check(capsys, ta, tb, atol=atol, rtol=rtol)
    assert res == (0.0 if ok else 1.0)
    assert ("passed~" in out) == ok


def test_max_delta_ignores_matching_nonfinite(capsys):
    a = torch.tensor([math.nan, math.inf, 1.0, 0.5])
    b = torch.tensor([math.nan, math.inf, 2.0, 0.5])
    res, out = _check(capsys, a, b)
    assert res == 0.25
    assert _max_delta(out) == 1.0


# ---------------------------------------------------------------- poison
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.uint8])
def test_poison(dtype):
    t = (torch.randn(7, 9) * 100).to(dtype)
    assert poison(t) is t
    want = {torch.int32: -2 ** 31, torch.uint8: 255}  # never 0: a value an unwritten element could hold
    assert (t == want[dtype]).all() if dtype in want else torch.isnan(t).all()


@pytest.mark.gpu
def test_poison_next_alloc_hands_the_poisoned_block_back():
    """The next allocation of a given size (an op's own output) reads NaN, not a freed block's old values."""
    from hipkern.testing import poison_next_alloc

    for n in (7, 12345, 1 << 20):  # both of the allocator's pools
        old = torch.zeros(n, device="cuda")
        del old  # a freed block of zeros, as a previous call's output would be
        poison_next_alloc("cuda", ((n,), torch.float32))
        assert bool(torch.empty(n, device="cuda").isnan().all()), n


@pytest.mark.gpu
def test_poison_free_memory_poisons_every_buffer_an_op_makes_next():
    """Several buffers of other sizes in a row (a workspace, sorting outputs, then an intermediate, as fused_moe
    makes them) all read NaN, whichever free block each lands in."""
    from hipkern.testing import poison_free_memory

    olds = [torch.zeros(n, device="cuda") for n in (5760, 128, 25, 32000, 1 << 21)]
    del olds
    poison_free_memory("cuda")
    bufs = [torch.empty(n, device="cuda") for n in (5760, 1000, 64, 32000, 300_000, 1 << 21)]  # all alive at once
    # 16-bit buffers (fused_moe's bf16 / fp16 intermediate) too: every element, not every other one
    bufs += [torch.empty(n, dtype=dt, device="cuda") for n, dt in ((4096, torch.bfloat16), (70_001, torch.float16))]
    for b in bufs:
        assert bool(b.isnan().all()), (b.numel(), b.dtype)


def test_the_free_memory_poison_is_nan_in_every_float_type():
    """poison_free_memory's word reads NaN as float32, as both bfloat16 / float16 halves and as every float8 byte
    (a float32 NaN reads 0.0 in every other 16-bit element), and as no small integer."""
    from hipkern.testing import NAN_WORD, _nan_words

    w = _nan_words(8, "cpu")
    assert (w == NAN_WORD).all()
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
        assert bool(w.view(dt).float().isnan().all()), dt
    assert int(w.view(torch.int16).min()) == 32767 and int(w[0]) == 2**31 - 32769


def test_poison_refuses_bool():
    with pytest.raises(TypeError, match="bool has no out-of-range value"):
        poison(torch.zeros(3, dtype=torch.bool))


# ---------------------------------------------------------------- run_perftest / perftest
def _recorder():
    """A function that records each tensor argument it sees and returns x * scale."""
    seen = []

    def f(x, scale=2.0):
        seen.append(x)
        return x * scale

    return f, seen


def test_run_perftest_output_median_and_call_count():
    f, seen = _recorder()
    x = torch.randn(32, 32)
    out, us = run_perftest(f, x, num_iters=7, num_warmup=3)
    assert torch.equal(out, x * 2.0) and isinstance(us, float) and us > 0
    assert len(seen) == 3 + 7


@pytest.mark.parametrize("rotate_bytes, max_copies, buffers", [
    (4 * 4096, 64, 4),   # 4 KiB tensor, 16 KiB to cover: 4 buffers
    (1 << 20, 5, 5),     # capped by max_copies
    (1024, 64, 1),       # tensor larger than rotate_bytes: no clones
])
def test_run_perftest_rotates_over_clones(rotate_bytes, max_copies, buffers):
    f, seen = _recorder()
    x = torch.randn(1024)  # 4096 bytes
    run_perftest(f, x, num_iters=12, num_warmup=2, rotate_bytes=rotate_bytes, max_copies=max_copies)
    assert len({t.data_ptr() for t in seen}) == buffers
    assert seen[0] is x
    assert all(torch.equal(t, x) for t in seen)


def _copy_order(seen, x):
    """Each call's copy as an index in order of first use (0: x itself)."""
    first = {}
    return [first.setdefault(t.data_ptr(), len(first)) for t in seen]


def test_run_perftest_cycles_over_the_copies_across_warm_up_and_timing():
    """Warm-up and timed calls take the copies in one cycle: a copy comes back only after every other one."""
    f, seen = _recorder()
    x = torch.randn(1024)  # 4096 bytes: 4 copies for 16 KiB
    run_perftest(f, x, num_iters=6, num_warmup=3, rotate_bytes=4 * 4096)
    assert _copy_order(seen, x) == [i % 4 for i in range(9)]


@pytest.mark.gpu
def test_run_perftest_cycles_over_the_copies_across_its_passes_on_a_gpu():
    """On a GPU the calls run in three passes (warm-up, a dry pass that times the host, the timed pass). With
    fewer timed calls than copies, each pass used to start over at the first copy, so a timed call read the
    copy its dry twin had just left in L2; one cycle over all passes keeps every reuse len(copies) calls apart."""
    f, seen = _recorder()
    x = torch.randn(1024, device="cuda")
    run_perftest(f, x, num_iters=3, num_warmup=2, rotate_bytes=16 * 4096)
    assert _copy_order(seen, x) == list(range(2 + 3 + 3))  # 16 copies: none used twice


@pytest.mark.gpu
def test_run_perftest_times_the_device_not_the_host():
    """The stream is held while the host enqueues, so each call's events bracket its kernel alone: a call
    that sleeps 300 us on the host before a tiny kernel still times as a few microseconds."""
    x = torch.randn(1024, device="cuda")

    def slow_host(v):
        time.sleep(300e-6)
        return v.add(1)

    out, us = run_perftest(slow_host, x, num_iters=20, num_warmup=2, rotate_bytes=0)
    assert torch.equal(out, x + 1)
    assert us < 60, f"{us:.1f} us: the events measured the host's sleep"


@pytest.mark.gpu
def test_run_perftest_flush_times_reads_from_memory_not_l2():
    """With one copy of an input of a quarter of the cache (l2_bytes: 12.5 MB of the H100's / H200's 50 MB
    L2), no rotation leaves it cached between calls; max_copies=1 with the default target flushes the
    cache before each call instead, so the same read takes longer (H100 / H200 memory at 3.0 / 4.8 TB/s
    against L2's several; the H200 measured > 1.15x)."""
    x = torch.ones(l2_bytes() // 16, device="cuda")
    _, warm = run_perftest(torch.sum, x, num_iters=50, num_warmup=5, rotate_bytes=0)
    _, flushed = run_perftest(torch.sum, x, num_iters=50, num_warmup=5, max_copies=1)
    assert flushed > 1.1 * warm, f"flushed {flushed:.2f} us against warm {warm:.2f} us"


def test_run_perftest_copies_keep_strides_alignment_and_shared_memory():
    """Each rotated copy is laid out as the original: a strided view stays strided (not made contiguous), the
    address keeps its remainder modulo 256 bytes, and arguments that shared memory (two views of one buffer, an
    output that is an input) share the copy. Values are the originals'."""
    seen = []

    def f(x, kv_k, kv_v, out):
        seen.append((x, kv_k, kv_v, out))
        return out

    x = torch.randn(64, 64)[:, ::2]  # strided
    kv = torch.randn(2, 3, 256)[:, :, 4:]  # two views of one buffer, rows padded, offset 16 bytes
    k, v = kv[0], kv[1]
    run_perftest(f, x, k, v, out=x, num_iters=4, num_warmup=1, rotate_bytes=1 << 18)
    assert len({c[0].data_ptr() for c in seen}) > 1
    for cx, ck, cv, cout in seen:
        assert cx.stride() == x.stride() and ck.stride() == k.stride() and cv.stride() == v.stride()
        assert torch.equal(cx, x) and torch.equal(ck, k) and torch.equal(cv, v)
        assert cout.data_ptr() == cx.data_ptr() and cout.stride() == cx.stride()
        assert cv.data_ptr() - ck.data_ptr() == v.data_ptr() - k.data_ptr()
        assert ck.data_ptr() % 256 == k.data_ptr() % 256


def test_run_perftest_counts_memory_not_elements():
    """The rotation counts the bytes the inputs occupy: an expanded tensor its base (16 KiB, not its 16 MiB of
    elements), views of one buffer once. Copies of an expanded input stay expanded."""
    f, seen = _recorder()
    x = torch.randn(1, 4096).expand(1024, 4096)  # 16 KiB of memory, 16 MiB of elements
    run_perftest(f, x, num_iters=6, num_warmup=2, rotate_bytes=4 * 4096 * 4)
    assert len({t.data_ptr() for t in seen}) == 4
    assert all(t.stride() == (0, 1) and torch.equal(t, x) for t in seen)
    from hipkern.testing import _input_bytes
    kv = torch.randn(2, 1024)
    assert _input_bytes([kv[0], kv[1], kv]) == 2 * 1024 * 4
    # a slice of every row reads those slices, not the rows between: counted by its elements (more copies), not
    # its span (too few copies to cycle past the cache)
    assert _input_bytes([torch.randn(8, 8)[:, :2]]) == 16 * 4
    assert _input_bytes([torch.randn(1024, 1024)[:, :256]]) == 1 << 20
    sparse = torch.eye(4096).to_sparse()  # 4096 values and 2 x 4096 indices, not 4096^2 elements
    assert _input_bytes([sparse]) == 4096 * 4 + 2 * 4096 * 8


def test_copies_keep_an_expanded_tensor_expanded_and_compact():
    """A row broadcast from a column of a large matrix (16 KB of elements over a 64 MB span, left out of the byte
    copies): each copy holds its distinct elements once and stays expanded, where clone() wrote out 64 MB."""
    from hipkern.testing import _clone, _input_bytes
    y = torch.randn(4096, 4096)[:, :1].expand(4096, 4096)
    assert _input_bytes([y]) == 4096 * 4
    c = _clone(y)
    assert torch.equal(c, y) and c.stride()[1] == 0 and c.untyped_storage().nbytes() == 4096 * 4


def test_copies_keep_an_argument_passed_twice_one_tensor():
    """An output that is an input stays one tensor in every copy, also where the copy is a clone (a column spread
    thin over its buffer; autograd history)."""
    for x in (torch.randn(1024, 1024)[:, 0], torch.randn(1000, requires_grad=True) * 1):
        seen = []
        run_perftest(lambda a, out: seen.append((a, out)), x, out=x, num_iters=4, num_warmup=1,
                     rotate_bytes=1 << 20)
        assert len({a.data_ptr() for a, _ in seen}) > 1 and all(a is out for a, out in seen)


def test_copies_keep_namedtuples_and_prefix_views():
    """A namedtuple argument is rebuilt field by field; a DLPack view of a buffer's prefix (a storage of its own
    at the buffer's address) and the buffer share their copy."""
    import collections
    from hipkern.testing import _clone
    P = collections.namedtuple("P", "a b")
    p = P(torch.randn(4), torch.randn(4))
    out, _ = run_perftest(lambda q: q.a + q.b, p, num_iters=2, num_warmup=1, rotate_bytes=1 << 10)
    assert torch.equal(out, p.a + p.b)
    c = _clone(p)
    assert type(c) is P and torch.equal(c.a, p.a) and c.a.data_ptr() != p.a.data_ptr()
    t = torch.randn(100)
    u = torch.from_dlpack(t[:4])
    cu, ct = _clone((u, t))
    assert torch.equal(ct, t) and torch.equal(cu, u) and cu.data_ptr() == ct.data_ptr() != t.data_ptr()


def test_unsigned_64_bit_integers_compare_exactly(capsys):
    """uint64 past int64's range: a poisoned output (2^64 - 1) must not read as -1 (which passed against 0 with
    atol 1), and two large uint64 values compare by their true difference."""
    zero = torch.zeros(3, dtype=torch.uint64)
    res, out = _check(capsys, poison(torch.zeros(3, dtype=torch.uint64)), zero, atol=1, rtol=0)
    assert res == 1.0 and "failed!" in out
    big = torch.tensor([2**64 - 1, 2**63 + 5, 7], dtype=torch.uint64)
    assert _check(capsys, big.clone(), big)[0] == 0.0
    near = torch.tensor([2**64 - 2, 2**63 + 5, 7], dtype=torch.uint64)
    res, out = _check(capsys, near, big)
    assert res == pytest.approx(1 / 3) and "max abs delta:1," in out
    assert _check(capsys, near, big, atol=1)[0] == 0.0
    # against a signed side: a uint64 value past int64 matches nothing; the others compare as numbers
    res, _ = _check(capsys, big, torch.tensor([-1, -9223372036854775803, 7]))
    assert res == pytest.approx(2 / 3)
    assert _check(capsys, torch.tensor([5, 0], dtype=torch.uint64), torch.tensor([5, 0]))[0] == 0.0


def test_rows_scaled_takes_empty_rows():
    got, ref = rows_scaled(torch.empty(3, 0), torch.empty(3, 0))
    assert got.shape == ref.shape == (3, 0) and checkAllclose(got, ref, printLog=False) == 0.0


def test_run_perftest_copies_other_layouts_with_clone():
    """A sparse argument (no strides to copy as bytes) and a conjugate view are still copied, by clone()."""
    seen = []

    def f(a, d):
        seen.append(a)
        return d

    a = torch.eye(64).to_sparse()
    run_perftest(f, a, torch.randn(64), num_iters=3, num_warmup=1, rotate_bytes=1 << 16)
    assert len(seen) == 4 and all(torch.equal(t.to_dense(), torch.eye(64)) for t in seen)
    assert len({id(t) for t in seen}) == 4 and seen[1] is not a
    # a lazily conjugated view: its bytes are not its values, so clone() (which applies the bit) copies it
    seen.clear()
    z = torch.randn(256, dtype=torch.complex64).conj()
    run_perftest(f, z, torch.randn(64), num_iters=3, num_warmup=1, rotate_bytes=1 << 16)
    assert len({t.data_ptr() for t in seen}) > 1 and all(torch.equal(t, z) for t in seen)


def test_run_perftest_copies_what_bytes_cannot_carry_with_clone():
    """Arguments whose bytes a layout-keeping copy cannot carry take clone(), as before: one with autograd history
    (a byte copy would be a leaf, and an in-place call on it an error), one at an address not aligned to its
    elements, and one spread thin over its buffer (a column of a matrix: copied compactly, and counted by its
    elements, so that the calls still cycle over enough copies)."""
    f, seen = _recorder()
    x = torch.randn(1000, requires_grad=True) * 2  # not a leaf
    run_perftest(lambda t: seen.append(t) or t.add_(1), x, num_iters=3, num_warmup=1, rotate_bytes=1 << 16)
    assert len({t.data_ptr() for t in seen}) > 1 and all(t.grad_fn is not None for t in seen)
    seen.clear()
    odd = torch.frombuffer(bytearray(range(64)), dtype=torch.float32, offset=1, count=8)
    run_perftest(f, odd, num_iters=3, num_warmup=1, rotate_bytes=1 << 10)
    assert len({t.data_ptr() for t in seen}) > 1 and all(torch.equal(t, odd) for t in seen)
    seen.clear()
    col = torch.randn(1024, 1024)[:, 0]  # 4 KB of elements over a 4 MB span
    run_perftest(f, col, num_iters=6, num_warmup=2, rotate_bytes=4 * 4096)
    assert len({t.data_ptr() for t in seen}) == 4 and all(torch.equal(t, col) for t in seen[1:])


def test_run_perftest_rejects_no_iters():
    f, seen = _recorder()
    with pytest.raises(ValueError, match="num_iters"):
        run_perftest(f, torch.randn(4), num_iters=0)
    assert seen == []


def test_run_perftest_passes_tensor_kwargs():
    f, seen = _recorder()
    x, scale = torch.randn(16), torch.randn(16)
    out, us = run_perftest(f, x, scale=scale, num_iters=4, num_warmup=1, rotate_bytes=1 << 12)
    assert torch.equal(out, x * scale) and us > 0
    assert len(seen) == 5


def test_perftest_decorator():
    calls = []

    @perftest(num_iters=5, num_warmup=2, rotate_bytes=1)
    def add(x, y):
        calls.append(1)
        return x + y

    x, y = torch.randn(8), torch.randn(8)
    out, us = add(x, y)
    assert torch.equal(out, x + y) and us > 0
    assert len(calls) == 7 and add.__name__ == "add"


# ---------------------------------------------------------------- BenchTable
def _table():
    t = BenchTable(["M", "N", "us", "TFLOPS"], title="gemm bf16")
    t.add(M=128, N=256, us=12.3456, TFLOPS=1.0)
    t.add(M=4096, N=8192, us=250.0, TFLOPS=345.678)
    return t


def test_benchtable_add_requires_all_columns():
    t = _table()
    with pytest.raises(ValueError, match="TFLOPS"):
        t.add(M=1, N=2, us=3.0)
    assert len(t.rows) == 2


def test_benchtable_render():
    lines = _table().render().splitlines()
    assert len(lines) == 4 and lines[:2] == ["gemm bf16", "Timestamp,M,N,us,TFLOPS"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,128,256,12\.35,1\.00", lines[2])
    assert lines[3].endswith(",4096,8192,250.00,345.68")


def test_benchtable_prints_the_bars_rates_to_their_decimals():
    """A rate of 2.795 TB/s against a 2.8 bar printed as 2.80 at the default 2 decimals."""
    t = BenchTable(["us", "TBps"], decimals={"TBps": 3})
    t.add(us=96.4, TBps=2.7953)
    assert t.render().splitlines()[-1].endswith(",96.40,2.795")


def test_benchtable_to_csv_roundtrip(tmp_path):
    df = pd.read_csv(_table().to_csv(tmp_path / "sub" / "bench.csv"))
    assert list(df.columns) == ["Timestamp", "M", "N", "us", "TFLOPS"] and len(df) == 2
    assert df["M"].tolist() == [128, 4096]
    assert df["us"].tolist() == pytest.approx([12.3456, 250.0])


@pytest.mark.gpu
def test_run_graphtest_replays_one_call_per_rotated_copy():
    from hipkern.testing import run_graphtest

    x = torch.randn(1 << 20, device="cuda")  # 4 MB
    seen = []

    def f(t):
        seen.append(t.data_ptr())
        return t * 2

    out, us = run_graphtest(f, x, num_iters=3, rotate_bytes=16 << 20)
    assert len(set(seen)) == 4  # 16 MB of rotation over 4 MB inputs: 4 distinct copies, each called
    assert us > 0 and math.isfinite(us)
    assert torch.equal(out, x * 2)  # the last captured call's output, written by the replays
    with pytest.raises(ValueError, match="num_iters must be >= 1"):
        run_graphtest(f, x, num_iters=0)


@pytest.mark.gpu
def test_run_graphtest_rotates_small_inputs_over_several_graphs():
    from hipkern.testing import run_graphtest

    x = torch.randn(1 << 14, device="cuda")  # 64 KB: 256 copies for 16 MB, in 3 graphs of at most 100 calls
    seen = []

    def f(t):
        seen.append(t.data_ptr())
        return t + t.data_ptr() % 997  # each copy's output its own

    out, us = run_graphtest(f, x, num_iters=2, rotate_bytes=16 << 20, max_copies=100)
    # every copy called once in the warm-up and once in its graph's capture, the last copy last
    assert len(set(seen)) == 256 and len(seen) == 2 * 256 and seen[-1] == seen[255]
    assert us > 0 and math.isfinite(us)
    assert torch.equal(out, x + seen[-1] % 997)  # the last graph's last call, written by its replays
    with pytest.warns(UserWarning, match="part of the inputs stays in L2"):
        run_graphtest(f, x, num_iters=1, rotate_bytes=16 << 20, max_copies=64, max_graphs=2)
    y = torch.zeros(4, device="cuda")
    with warnings.catch_warnings():  # no tensor arguments: func rotates its own inputs, nothing to warn of
        warnings.simplefilter("error")
        run_graphtest(lambda: y.add_(1), num_iters=1, max_copies=8)
    assert y[0].item() == 3 * 8  # 8 calls warmed up, then the graph of 8 replayed once before timing, once timed


@pytest.mark.gpu
def test_bench_device_line_names_the_unit_its_copy_rate_and_a_calls_floor():
    from hipkern.bench import device_line

    line = device_line()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    assert props.name in line and str(props.uuid) in line
    rate = float(re.search(r"copy_ of 1 GiB here ([0-9.]+) TB/s", line).group(1))
    assert 0.05 < rate < 20  # any real GPU's copy rate; a zero, negative or absurd timing fails
    floor = float(re.search(r"a one-element call here ([0-9.]+) us", line).group(1))
    assert 0.5 < floor < 100  # a launch and two events: never free, never a millisecond
