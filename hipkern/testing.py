"""Test and benchmark helpers in aiter's conventions, made strict.

* ``checkAllclose(a, b, rtol, atol, tol_err_ratio, msg)``: prints ``[checkAllclose atol=.. rtol=..
  passed~]``, or a ``failed!`` line (a ``warning!`` one when the mismatches' share is within
  `tol_err_ratio`) with the max abs delta and the share of mismatched elements, and returns that share. A
  mismatch involving NaN or Inf on either side is always a failure.
* ``run_perftest`` / ``@perftest``: device-event timing after warm-up, median of many runs, inputs
  rotated over more than the L2 size (or L2 flushed between runs when that would take too many
  copies), with the launch queue primed so that host overhead does not leak into device time.
* ``run_graphtest``: the same calls, back to back in CUDA graphs over rotated inputs, per call.
* ``BenchTable``: prints a benchmark table in the reference logs' CSV style and writes it as CSV.
* ``poison`` (NaN, or an out-of-range integer, in an output before the call, so an unwritten element
  fails), ``poison_next_alloc`` (the next allocations of given sizes, e.g. an op's own outputs) and
  ``poison_free_memory`` (all the memory the allocator hands out next, e.g. an op's internal buffers).
"""
from __future__ import annotations

import datetime
import functools
import itertools
import math
import statistics
import time
import warnings
from pathlib import Path

import torch

from .ops._common import _byte_span, _lazy

__all__ = ["checkAllclose", "rows_scaled", "run_perftest", "run_graphtest", "perftest", "BenchTable", "poison",
           "poison_next_alloc", "poison_free_memory", "l2_bytes"]


def _fmt(x: float) -> str:
    return f"{x:g}"


def checkAllclose(a: torch.Tensor, b: torch.Tensor, rtol: float | None = None, atol: float | None = None,
                  tol_err_ratio: float = 0.0, msg: str = "", printLog: bool = True) -> float:
    """Compare `a` (tested) with `b` (reference): |a - b| <= atol + rtol * |b| elementwise.

    rtol and atol default to 1e-2, but to 0 when both tensors are integer (ids, counts, offsets compare
    exactly unless a tolerance is given: 1e-2 of an id of 1000 would have let 1010 pass).

    Returns the share of mismatched elements (0.0 when all match). It passes when that share is at
    most `tol_err_ratio`, except that any mismatch where either side is not finite (a NaN or an infinity
    of `a` against a finite `b`, -inf against +inf, ...) fails outright, and then 1.0 is returned
    whatever the share, so ``assert checkAllclose(...) <= tol`` catches it. Complex values compare their
    real and imaginary parts; two integer tensors compare exactly in int64 (float64 would round values
    past 2^53).
    """
    if a.shape != b.shape:
        raise ValueError(f"checkAllclose: shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    a, b = a.detach(), b.detach()
    integers = not (a.is_floating_point() or b.is_floating_point() or a.is_complex() or b.is_complex())
    exact = 0.0 if integers else 1e-2
    rtol, atol = (exact if rtol is None else rtol), (exact if atol is None else atol)
    if a.is_complex() or b.is_complex():
        a, b = torch.view_as_real(a.to(torch.complex128)), torch.view_as_real(b.to(torch.complex128))
    x = a.to(torch.float64)
    y = b.to(torch.float64)
    head = f"{msg}[checkAllclose atol={_fmt(atol)} rtol={_fmt(rtol)}"
    if x.numel() == 0:
        if printLog:
            print(f"{head} passed~]")
        return 0.0
    if integers:  # a - b exactly (in int64), against the tolerance in float64
        ai, bi, far = _as_int64(a, b)
        d = ai - bi  # wraps where the true difference leaves int64 (a poisoned INT64_MIN against a positive value)
        diff = torch.where((ai < bi) != (d < 0), math.inf, d.to(torch.float64).abs())
        if far is not None:
            diff = torch.where(far, math.inf, diff)
        close = diff <= atol + rtol * y.abs()
    else:
        close = torch.isclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
    bad_nonfinite = int((~close & ~(torch.isfinite(x) & torch.isfinite(y))).sum())
    n_bad = int((~close).sum())
    share = n_bad / x.numel()
    if n_bad == 0:
        if printLog:
            print(f"{head} passed~]")
        return 0.0
    delta = (diff if integers else (x - y).abs())[~close]  # over the mismatches only: matching NaN/Inf pairs are no delta
    delta = torch.where(torch.isnan(delta), torch.full_like(delta, math.inf), delta)
    failed = bad_nonfinite > 0 or share > tol_err_ratio
    if printLog:
        word = "failed!" if failed else "warning!"
        extra = f", {bad_nonfinite} of them non-finite (NaN or inf on either side)" if bad_nonfinite else ""
        print(f"{head} {word}]\n    -->max abs delta:{float(delta.max()):.6g}, delta details: "
              f"{share:.2%} ({n_bad} of {x.numel()}) elements{extra}")
    return 1.0 if bad_nonfinite else share


def _as_int64(a: torch.Tensor, b: torch.Tensor):
    """Integer a and b as int64 whose difference is the true one (where it fits), and a mask of the elements that
    can match nothing on the other side (or None). uint64 values past int64 would wrap (a poisoned 2^64 - 1 read as
    -1): two uint64 sides both move down by 2^63 (the sign bit flipped: differences and order kept); against a
    signed side, a uint64 value past int64 is marked."""
    if a.dtype == b.dtype == torch.uint64:
        return a.view(torch.int64) ^ -2**63, b.view(torch.int64) ^ -2**63, None
    far = None
    if a.dtype == torch.uint64:
        a = a.view(torch.int64)
        far = a < 0
    if b.dtype == torch.uint64:
        b = b.view(torch.int64)
        far = b < 0 if far is None else far | (b < 0)
    return a.to(torch.int64), b.to(torch.int64), far


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill `t` with NaN (floating) or an out-of-range sentinel (integer: the most negative value, the largest
    for unsigned types), so unwritten elements show. bool has no sentinel: a TypeError."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return t.fill_(math.nan)
    if t.dtype == torch.bool:
        raise TypeError("poison: bool has no out-of-range value to mark unwritten elements")
    info = torch.iinfo(t.dtype)
    return t.fill_(info.min if info.min < 0 else info.max)


def poison_next_alloc(device, *specs, fill=poison) -> None:
    """Make torch's next allocations of `specs`, (shape, dtype) pairs on `device` (an op's own outputs,
    e.g. the LSE or a functional call's results), most likely come back poisoned (by `fill`): the cached free
    blocks are released, then poisoned blocks of those sizes are freed for the allocator to hand out again
    (best fit). An element the op leaves unwritten then shows, instead of a previous call's correct value
    in a reused block."""
    torch.cuda.empty_cache()
    junk = [fill(torch.empty(shape, dtype=dtype, device=device)) for shape, dtype in specs]
    del junk


def poison_free_memory(device, small_mb: int = 16, large_mb: int = 64) -> None:
    """Fill the memory torch's caching allocator will hand out next on `device` with NaN (NAN_WORD: NaN read as any
    float type, 32, 16 or 8 bits), whichever free block
    each of an op's next buffers lands in (a workspace, then an intermediate), unlike poison_next_alloc, which
    aims at given sizes. The cached segments no tensor uses are released; every free block left inside the
    others (beside live tensors) is claimed at its exact size (pieces of at most 1 MB in the pool for small
    allocations), filled and freed; then `small_mb` MB of 1 MB blocks and `large_mb` MB of 16 MB blocks in new
    segments likewise. For the current stream's allocations outside CUDA-graph capture: free blocks of
    another stream's segments or of a graph's private pool are not handed to it, nor poisoned here."""
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    dev = torch.device("cuda", index)
    torch.cuda.synchronize(index)
    torch.cuda.empty_cache()
    held = []
    for _ in range(4):  # a claim may split a larger free block: claim again what is left
        free = [(seg["segment_type"], blk["size"]) for seg in torch.cuda.memory_snapshot()
                if seg["device"] == index for blk in seg["blocks"] if blk["state"] == "inactive"]
        if not free:
            break
        for kind, size in sorted(free, key=lambda f: f[1]):  # smallest first: each the best fit for itself
            pieces = [size] if kind == "large" else [min(1 << 20, size - o) for o in range(0, size, 1 << 20)]
            held += [_nan_words(n // 4, dev) for n in pieces if n >= 4]
    held += [_nan_words(1 << 18, dev) for _ in range(small_mb)]
    held += [_nan_words(1 << 22, dev) for _ in range(large_mb // 16)]
    del held


# A 32-bit word that reads as NaN in every float type an op's buffer may have: float32 (0x7FFF7FFF), each half as
# bfloat16 and float16 (0x7FFF), each byte as float8 e4m3fn / e5m2 (0x7F, 0xFF); a float32 NaN (0x7FC00000) reads
# as 0.0, NaN, 0.0, ... in 16-bit halves. As int32 it is 2^31 - 32769, as int16 32767: no index an op takes.
NAN_WORD = 0x7FFF7FFF


def _nan_words(n: int, device) -> torch.Tensor:
    return torch.full((n,), NAN_WORD, dtype=torch.int32, device=device)


def rows_scaled(got: torch.Tensor, ref: torch.Tensor, cap: float = 1.0):
    """(got / s, ref / s) in float32 with s each last-dim row's largest |ref|, clamped to [2^-24, cap].

    For outputs that are weighted averages (attention): their size shrinks like 1/sqrt(terms), ~0.004 at
    131072 tokens of random data, so checkAllclose's atol on the scaled pair is atol x s there (an atol
    meant for O(1) outputs would pass rows read from the wrong memory), and unchanged where s = cap. The
    relative part is unchanged, a NaN stays a NaN, and a nonzero element of an all-zero reference row
    becomes huge."""
    # (a NaN or infinity in the reference does not set its row's scale: a NaN scale would make the whole row NaN on
    # both sides, which compares equal, and hide every error in it)
    if ref.numel() == 0:  # (no row to scale; amax cannot reduce an empty last dimension)
        return got.detach().float(), ref.detach().float()
    s = ref.detach().float().abs().nan_to_num(nan=0.0, posinf=cap).amax(dim=-1, keepdim=True)
    s = s.clamp(min=2.0**-24, max=cap)
    return got.detach().float() / s, ref.detach().float() / s


# Caches past L2 that hold a kernel's inputs between calls: MI300's 256 MB Infinity Cache. Inputs
# rotated over only 2x L2 would stay in it there.
_LAST_LEVEL_BYTES = {"gfx942": 256 << 20}
# GPUs whose reported L2 is one slice's: gfx942 reports an XCD's 4 MB, and MI300X / MI325X have 8 XCDs
# (fewer on MI300A / MI308X: rotating past 8 slices is then a little more than needed, never less).
_L2_SLICES = {"gfx942": 8}


def l2_bytes(device=None) -> int:
    """The bytes of cache that inputs must be rotated past (2x this) or flushed from to be read from
    memory: all of L2 (_L2_SLICES), plus a last-level cache where the GPU has one (_LAST_LEVEL_BYTES)."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
        arch = str(getattr(props, "gcnArchName", "") or "").split(":")[0]
        l2 = int(getattr(props, "L2_cache_size", 0) or 64 << 20) * _L2_SLICES.get(arch, 1)
        return l2 + _LAST_LEVEL_BYTES.get(arch, 0)
    return 64 << 20


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _cloneable(t: torch.Tensor) -> bool:
    """A plain strided tensor whose memory _clone can copy as bytes (else it takes t.clone()): its values are its
    bytes (no lazy conjugate or negation bit, not a zero tensor, not quantised), at an address aligned to its
    elements, and no autograd history to keep (a copy would be a leaf)."""
    return ((type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter)) and t.layout == torch.strided
            and not (t.is_nested or t.is_quantized or _lazy(t) or t.requires_grad)
            and t.device.type != "meta" and t.numel() > 0 and t.data_ptr() % t.element_size() == 0)


def _distinct_bytes(t: torch.Tensor) -> int:
    """Bytes of t's distinct elements: an expanded tensor's (stride-0 dimensions) once; a sparse COO tensor's values
    and indices."""
    if t.layout == torch.sparse_coo:
        return t._values().nbytes + t._indices().nbytes
    if t.layout != torch.strided or t.is_nested:
        return t.numel() * t.element_size()
    return math.prod(n for n, st in zip(t.shape, t.stride()) if st != 0) * t.element_size()


def _regions(tensors) -> dict:
    """The memory the tensors reach, per storage: {(device, storage address): [storage, first, end, distinct
    bytes]} in byte addresses (the largest storage met at that address: a DLPack view of a buffer's prefix has
    one of its own). An expanded tensor reaches its base only, views of one storage count once. A storage whose
    tensors are sparse in it (a column of a matrix, two views far apart: their span more than 4x their distinct
    elements' bytes and 64 KB) is left out: its tensors are copied compactly (_compact_clone)."""
    out: dict = {}
    for t in tensors:
        if not _cloneable(t):
            continue
        lo, hi = _byte_span(t)
        st = t.untyped_storage()
        r = out.setdefault((t.device, st.data_ptr()), [st, lo, hi, 0])
        if st.nbytes() > r[0].nbytes():
            r[0] = st
        r[1], r[2], r[3] = min(r[1], lo), max(r[2], hi), r[3] + _distinct_bytes(t)
    return {k: r for k, r in out.items() if r[2] - r[1] <= max(4 * r[3], 64 << 10)}


def _input_bytes(tensors) -> int:
    """Bytes a call reads at most, for the rotation's count of copies: per region its span, but no more than its
    tensors' distinct elements (a slice of every row of a matrix reads those rows' slices, not the rows between:
    counting the span would leave too few copies to cycle past the cache); the others' distinct elements."""
    tensors = list(tensors)
    regions = _regions(tensors)
    return (sum(min(hi - lo, n) for _, lo, hi, n in regions.values())
            + sum(_distinct_bytes(t) for t in tensors if not _in_region(t, regions)))


def _in_region(t: torch.Tensor, regions: dict) -> bool:
    return _cloneable(t) and (t.device, t.untyped_storage().data_ptr()) in regions


def _compact_clone(t: torch.Tensor) -> torch.Tensor:
    """t.clone(), but an expanded tensor stays expanded: its distinct elements are copied, then expanded again
    (clone() would write out every element: 64 MB for a row broadcast over 4096 rows of 16 KB)."""
    if t.layout != torch.strided or t.is_nested or 0 not in t.stride():
        return t.clone()
    return t[tuple(slice(0, 1) if st == 0 else slice(None) for st in t.stride())].clone().expand(t.shape)


_ALIGN = 256  # a copy's address keeps the original's remainder modulo this (16-byte checks, vector loads)


def _clone(obj):
    """`obj` with its tensors copied into fresh memory laid out as theirs: the same shapes and strides (a strided
    or expanded input stays so), the same address modulo 256 bytes, and tensors that shared memory share the
    copy (views of one buffer, an output that is an input). Other tensors (see _cloneable and _regions) take
    _compact_clone(), one copy per tensor object (one passed twice, as input and output, stays one)."""
    tensors = list(_tensors(obj))
    fresh = {}  # storage key -> (copy of the region, byte shift from an original address into it)
    for key, (st, lo, hi, _) in _regions(tensors).items():
        src = torch.empty(0, dtype=torch.uint8, device=key[0]).set_(st, lo - st.data_ptr(), (hi - lo,), (1,))
        buf = torch.empty(_ALIGN + hi - lo, dtype=torch.uint8, device=key[0])
        pad = (lo - buf.data_ptr()) % _ALIGN  # buf.data_ptr() + pad = lo (mod _ALIGN)
        buf[pad:pad + hi - lo].copy_(src)
        fresh[key] = (buf, pad - lo)
    return _rebuild(obj, fresh, {})


def _rebuild(obj, fresh: dict, cloned: dict):
    if isinstance(obj, torch.Tensor):
        if not _in_region(obj, fresh):
            if id(obj) not in cloned:
                cloned[id(obj)] = (obj, _compact_clone(obj))  # (obj kept: its id stays its own meanwhile)
            return cloned[id(obj)][1]
        buf, shift = fresh[(obj.device, obj.untyped_storage().data_ptr())]
        return torch.empty(0, dtype=obj.dtype, device=obj.device).set_(
            buf.untyped_storage(), (obj.data_ptr() + shift) // obj.element_size(), obj.shape, obj.stride())
    if isinstance(obj, (list, tuple)):
        vals = [_rebuild(o, fresh, cloned) for o in obj]
        return type(obj)(*vals) if hasattr(obj, "_fields") else type(obj)(vals)  # (a namedtuple takes fields)
    if isinstance(obj, dict):
        return {k: _rebuild(v, fresh, cloned) for k, v in obj.items()}
    return obj


def run_perftest(func, *args, num_iters: int = 100, num_warmup: int = 10, rotate_bytes: int | None = None,
                 max_copies: int = 64, **kwargs):
    """Time ``func(*args, **kwargs)``; returns (output of the last call, median microseconds).

    GPU inputs: each timed call gets its own device-event pair. Tensor arguments are copied (each copy laid
    out as they are: strides, alignment, shared memory) into enough copies that the calls cycle over more than
    `rotate_bytes` (default 2x L2) of the memory they occupy; when that would
    need more than `max_copies` copies, L2 is flushed before each call instead (outside the timed
    span). The stream is first held by a spin kernel long enough for all launches to queue, so the
    events measure device time, not Python's launch overhead. CPU inputs: host clock, same protocol.
    """
    if num_iters < 1:
        raise ValueError(f"num_iters must be >= 1, got {num_iters}")
    tensors = list(_tensors((args, kwargs)))
    on_gpu = any(t.is_cuda for t in tensors) or (not tensors and torch.cuda.is_available())
    nbytes = _input_bytes(tensors)
    target = rotate_bytes if rotate_bytes is not None else 2 * l2_bytes()
    copies = min(max_copies, max(1, math.ceil(target / max(nbytes, 1))))
    flush = on_gpu and copies * nbytes < target
    sets = [(args, kwargs)] + [_clone((args, kwargs)) for _ in range(copies - 1)]
    # One running count over the warm-up, the dry pass and the timed pass, so that any two calls on the same
    # copy are len(sets) - 1 calls apart, also across passes (restarting each pass at the first copy put a
    # timed call right after the dry call on its copy when num_iters < copies: read from L2).
    calls = itertools.count()

    def next_set():
        return sets[next(calls) % len(sets)]

    out = None
    for _ in range(num_warmup):
        a, k = next_set()
        out = func(*a, **k)
    if not on_gpu:
        times = []
        for _ in range(num_iters):
            a, k = next_set()
            t0 = time.perf_counter()
            out = func(*a, **k)
            times.append((time.perf_counter() - t0) * 1e6)
        return out, statistics.median(times)

    # Flushing reads a buffer larger than L2: writing one would leave dirty lines whose write-back
    # would then be billed to the timed call.
    scratch = torch.ones(target // 4, dtype=torch.int32, device="cuda") if flush else None
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(num_iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(num_iters)]

    def enqueue():
        nonlocal out
        for i in range(num_iters):
            a, k = next_set()
            if flush:
                scratch.sum()
            starts[i].record()
            out = func(*a, **k)
            ends[i].record()

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    enqueue()  # a dry pass measures how long the host takes to enqueue everything
    torch.cuda.synchronize()
    host_us = (time.perf_counter() - t0) * 1e6
    # Hold the stream while the host enqueues: ~2000 cycles per us is a safe upper clock, x2 margin.
    torch.cuda._sleep(int(min(host_us, 200_000) * 2000 * 2))
    enqueue()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    return out, statistics.median(times)


def run_graphtest(func, *args, num_iters: int = 20, rotate_bytes: int | None = None, max_copies: int = 256,
                  max_graphs: int = 16, **kwargs):
    """Time ``func(*args, **kwargs)`` as CUDA-graph replay (how serving engines run decode steps, and
    how the issue's peer figures were taken); returns (output of the last call, median us per call).

    Tensor arguments are cloned into enough copies that the calls cycle over more than `rotate_bytes`
    (default 2x L2). Each graph holds one call per copy for up to `max_copies` copies, back to back;
    more copies (small inputs) go into more graphs (at most `max_graphs`, replayed in turn), so that
    small inputs are not read from L2 either; where even those cannot cover `rotate_bytes`, a
    warning says so. Without tensor arguments (`func` rotates its own inputs) one graph of
    `max_copies` calls. Each timed replay's device time (events) is divided by its number of calls.
    Unlike run_perftest, no event or launch gap separates the calls, so this measures a kernel's own
    ramp and tail but not its launch latency.
    """
    if num_iters < 1:
        raise ValueError(f"num_iters must be >= 1, got {num_iters}")
    tensors = list(_tensors((args, kwargs)))
    nbytes = _input_bytes(tensors)
    target = rotate_bytes if rotate_bytes is not None else 2 * l2_bytes()
    need = max(1, math.ceil(target / nbytes)) if nbytes else max_copies
    copies = min(need, max_copies * max_graphs)
    if nbytes and copies * nbytes < target:
        warnings.warn(f"run_graphtest: {copies} copies of {nbytes} B cycle over {copies * nbytes} B, "
                      f"under the {target} B to rotate past: part of the inputs stays in L2", stacklevel=2)
    sets = [(args, kwargs)] + [_clone((args, kwargs)) for _ in range(copies - 1)]
    n = math.ceil(copies / max_copies)  # graphs whose calls differ by one at most: every replay weighs alike
    bounds = [i * copies // n for i in range(n + 1)]
    chunks = [sets[a:b] for a, b in zip(bounds, bounds[1:])]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture (module loads, allocator)
        for a, k in sets:
            func(*a, **k)
    torch.cuda.current_stream().wait_stream(side)
    graphs = []
    for chunk in chunks:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for a, k in chunk:
                out = func(*a, **k)
        graph.replay()
        graphs.append((graph, len(chunk)))
    timed = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), calls)
             for _ in range(num_iters) for _, calls in graphs]
    torch.cuda.synchronize()
    for i, (start, end, _) in enumerate(timed):
        start.record()
        graphs[i % len(graphs)][0].replay()
        end.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) * 1e3 / calls for s, e, calls in timed]
    del graphs
    return out, statistics.median(times)


def perftest(num_iters: int = 100, num_warmup: int = 10, rotate_bytes: int | None = None):
    """Decorator: the wrapped call returns (its output, median us), timed by run_perftest."""

    def deco(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            return run_perftest(func, *args, num_iters=num_iters, num_warmup=num_warmup,
                                rotate_bytes=rotate_bytes, **kwargs)

        return wrapper

    return deco


class BenchTable:
    """Rows of a benchmark: printed as 'Timestamp,<columns>' CSV lines (floats to 2 decimals, or to `decimals`
    [column] of them: a rate judged against a bar such as 2.8 TB/s must not print as 2.80 at 2.795) and written
    with pandas (4 decimals)."""

    def __init__(self, columns: list[str], title: str = "", decimals: dict | None = None):
        self.columns = ["Timestamp"] + list(columns)
        self.title = title
        self.decimals = decimals or {}
        self.rows: list[dict] = []

    def add(self, **row) -> dict:
        missing = [c for c in self.columns[1:] if c not in row]
        if missing:
            raise ValueError(f"BenchTable row lacks columns {missing}")
        row = {"Timestamp": datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S"), **row}
        self.rows.append(row)
        return row

    def _cell(self, column: str, v) -> str:
        return f"{v:.{self.decimals.get(column, 2)}f}" if isinstance(v, float) else str(v)

    def render(self) -> str:
        lines = [self.title] if self.title else []
        lines.append(",".join(self.columns))
        lines += [",".join(self._cell(c, r[c]) for c in self.columns) for r in self.rows]
        return "\n".join(lines)

    def print(self) -> None:
        print(self.render(), flush=True)

    def to_csv(self, path) -> Path:
        import pandas as pd

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(self.rows, columns=self.columns).to_csv(path, index=False, float_format="%.4f")
        return path
