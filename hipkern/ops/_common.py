"""What every op shares: the torch library, argument checks, and per-device module lookup."""
from __future__ import annotations

import contextlib
import functools

import torch

from .. import jit, tuning_db

__all__ = ["lib", "impl_checked", "as_int", "as_float", "as_bool", "check_tensor", "check_device", "check_bool",
           "check_int", "check_routing_out", "DTYPE_NAMES", "on_device", "raw_stream", "module_for", "module_override",
           "sm_count", "gpu_name", "memo", "choice_inputs"]

# torch.ops.hipkern.*: ops are registered here so they work under torch.compile and graph capture.
lib = torch.library.Library("hipkern", "DEF")


def impl_checked(name: str, fn) -> None:
    """Register `fn` (an op's checks, then its launch) as torch.ops.hipkern.<name> for GPU tensors, and for
    CPU tensors too: there its checks raise the Python function's error ("... must be on a GPU") rather
    than the dispatcher's "Could not run ... with arguments from the 'CPU' backend"."""
    for key in ("CUDA", "CPU"):
        lib.impl(name, fn, key)


DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """The GPU's SMs (CUs on AMD): the tuning database's cu_count, and the plans' grid sizes."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


MEMO_LIMIT = 4096  # entries of a launch-plan memo before it is cleared


def memo(cache: dict, key, make):
    """make()'s value for `key`, kept in `cache` (cleared once it holds MEMO_LIMIT entries): the ops' launch plans,
    each keyed by everything it depends on. A make() that raises stores nothing."""
    hit = cache.get(key)
    if hit is None:
        hit = make()
        if len(cache) >= MEMO_LIMIT:
            cache.clear()
        cache[key] = hit
    return hit


_PLAIN_SCALARS = (bool, int, float, str, type(None))


def validated(cache: dict, check, tensors: tuple, scalars: tuple, *args) -> None:
    """check(*args), an op's argument validation, skipped for arguments that have passed it before: the key is each
    of `tensors`' shape, strides, dtype and device (None stays None) and each of `scalars` with its type (True == 1
    == 1.0 as keys), which must be all that check reads. Other tensor types (subclasses, nested, sparse: a sparse
    tensor's strides read as a dense one's; lazily negated or zero views) or scalar types, and calls while compiling,
    are checked in full.
    Validation was ~11 us of an eager paged-attention call's host time (H200 host, csrc_hip/paged_attention/NOTES.md,
    2026-11-28 (13)); the key costs about a third of it."""
    key = None if torch.compiler.is_compiling() else _arguments_key(check, tensors, scalars)  # (traced: no memo)
    if key is None:
        check(*args)
    elif key not in cache:  # (a hit makes no closure)
        memo(cache, key, lambda: check(*args) or True)


def _arguments_key(check, tensors: tuple, scalars: tuple) -> tuple | None:
    """validated's key, or None where an argument is not a plain strided tensor (or None) or a plain scalar. A plain
    loop: generators cost ~1 us more a call."""
    key = [check]
    for t in tensors:
        if t is None:
            key.append(None)
        elif type(t) is torch.Tensor and not (t.is_nested or t.is_neg() or t._is_zerotensor()) and \
                t.layout is torch.strided:  # (a conjugate bit needs a complex dtype: refused, and in the key)
            key.append((t.shape, t.stride(), t.dtype, t.device))
        else:
            return None
    for s in scalars:
        if type(s) not in _PLAIN_SCALARS:
            return None
        key += (type(s), s)
    return tuple(key)


def choice_inputs() -> tuple:
    """What a tuning-database choice reads besides the call's shapes: the database's generation (bumped by
    tuning_db.reset()) and HIPKERN_ARCH; part of every memoised launch plan's key."""
    return tuning_db.generation(), jit.platform.arch_env()


@functools.lru_cache(maxsize=None)
def gpu_name(device_index: int) -> str:
    """The GPU's name as torch gives it ("NVIDIA H100 80GB HBM3"): the tuning database's device column."""
    return torch.cuda.get_device_properties(device_index).name


def check_tensor(name: str, t, *, ndim: int | None = None, dtypes=None, shape=None, contiguous: bool = True,
                 gpu: bool = True) -> None:
    """Raise ValueError naming `name` unless `t` is a tensor as described (`shape`: exact sizes)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_nested or t.layout is not torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got {'a nested' if t.is_nested else t.layout} "
                         f"tensor")
    # The kernels read bytes: such a view's bytes are not its values (a zero tensor has none). Not while dynamo
    # traces (it cannot ask these; the registered op's fake and real implementations check again, untraced).
    if not torch.compiler.is_compiling() and _lazy(t):
        raise ValueError(f"{name} must hold its values in memory, not be a lazily negated, conjugated or zero view: "
                         f"call .resolve_neg() / .resolve_conj() or .clone() first")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must be one of {allowed}, got {str(t.dtype).replace('torch.', '')}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if gpu and t.device.type != "cuda":
        raise ValueError(f"{name} must be on a GPU (a 'cuda' device in torch, also on ROCm), got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major); call .contiguous() first")


def plain_cuda(t) -> bool:
    """Whether `t` is a dense torch.Tensor on a GPU whose bytes are its values (no lazy bit): what the ops' argument
    fast paths take; anything else goes through check_tensor, which says what is wrong (the lazy bits are left to
    the untraced implementations while compiling, as there)."""
    return (type(t) is torch.Tensor and t.layout is torch.strided and not t.is_nested and t.is_cuda
            and (torch.compiler.is_compiling() or not _lazy(t)))


def _lazy(t: torch.Tensor) -> bool:
    """A view whose values are not its bytes: a lazy negation or conjugation bit, or a zero tensor."""
    return t.is_neg() or t.is_conj() or t._is_zerotensor()


HOST_CHECK_REASON = ("validate=True reads values on the host (a device sync), which a full graph cannot hold: under "
                     "torch.compile(fullgraph=True) pass validate=False (and validate outside the compiled region)")


def host_check(fn):
    """Mark a validate=True check, which reads tensor values on the host (a device sync). Dynamo cannot trace such a
    read: compiled code breaks the graph before the check and runs it eagerly, and torch.compile(fullgraph=True)
    refuses it with HOST_CHECK_REASON (before, it failed on a data-dependent guard deep in dynamo). A graph break
    with a message rather than torch.compiler.disable, which imports dynamo when applied: ~2 s more to import
    hipkern."""
    @functools.wraps(fn)
    def checked(*args):
        if torch.compiler.is_compiling():
            from torch._dynamo import graph_break  # (loaded: dynamo is tracing)
            graph_break(msg=HOST_CHECK_REASON)
        return fn(*args)
    return checked


def check_aligned(alignment: int | None = None, /, **tensors) -> None:
    """Raise ValueError naming the first of `tensors` (None ones skipped) whose address is not a multiple of
    `alignment` bytes (a kernel's vector loads), or with None of its element size (a view into a byte buffer at
    an odd offset, which no load or store can address). At launch only: fake tensors (torch.compile) have no
    address."""
    for name, t in tensors.items():
        if t is None:
            continue
        if alignment is None and t.data_ptr() % t.element_size():
            raise ValueError(f"{name} must start at an address aligned to its {t.element_size()}-byte elements")
        if alignment is not None and t.data_ptr() % alignment:
            raise ValueError(f"{name} must start at a {alignment}-byte aligned address")


def is_float32(v) -> bool:
    """Whether `v` is a real number (not a bool) that float32, the kernels' type, holds as a finite value."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return abs(float(v)) <= torch.finfo(torch.float32).max
    except OverflowError:  # an int past float64's range
        return False


def _byte_span(t: torch.Tensor) -> tuple:
    """[first, last) byte addresses that t's elements lie in (empty for no elements)."""
    n = t.numel()
    if n == 0:
        return 0, 0
    p = t.data_ptr()
    if t.is_contiguous():  # (the common case, without the strides' sum: checked on every eager call)
        return p, p + n * t.element_size()
    reach = sum((size - 1) * st for size, st in zip(t.shape, t.stride()) if st > 0)
    return p, p + (reach + 1) * t.element_size()


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same shape and the same strides where they matter (dimensions of more than one element)."""
    return a.shape == b.shape and all(n == 1 or sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()))


def check_no_overlap(name: str, out: torch.Tensor, alias_ok: str | None = None, /, **inputs) -> None:
    """Raise ValueError unless `out` shares no memory with any of `inputs`; the input named `alias_ok`
    may also be exactly `out` (same address, shape and strides, strides of one-element dimensions aside:
    an in-place call). Addresses only, so it runs at launch, never while tracing."""
    lo, hi = _byte_span(out)
    for other, t in inputs.items():
        if other == alias_ok and t.data_ptr() == out.data_ptr() and _same_layout(t, out):
            continue
        a, b = _byte_span(t)
        if lo < b and a < hi:
            how = " (only exactly the same tensor may be passed)" if other == alias_ok else ""
            raise ValueError(f"{name} must not overlap {other} in memory{how}")


def check_device(device, **tensors) -> None:
    """Raise ValueError naming the first of `tensors` that is not on `device`."""
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} must be on {device} (the device of the inputs), got {t.device}")


_NUMPY_KINDS = {**dict.fromkeys(("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "intc",
                                  "uintc", "longlong", "ulonglong"), "int"),
                **dict.fromkeys(("float16", "float32", "float64", "longdouble"), "float"),
                **dict.fromkeys(("bool", "bool_"), "bool")}


def _numpy_kind(v) -> str:
    """"int", "float" or "bool" for a numpy scalar, else "". By its type's module and name, not isinstance:
    torch.compile's tracer (graph breaks allowed) sees numpy scalars as its own arrays, whose isinstance
    checks fail. Under fullgraph=True it traces them as tensors, and they are refused: pass Python numbers."""
    t = type(v)
    return _NUMPY_KINDS.get(t.__name__, "") if t.__module__ == "numpy" else ""


def as_int(v):
    """A numpy integer scalar as a Python int; anything else as it is, for the checks to name. Public
    functions take their int arguments through it (torch.ops' schemas convert such scalars too)."""
    return int(v) if _numpy_kind(v) == "int" else v


def as_float(v):
    """A numpy integer or float scalar as a Python float; anything else as it is, for the checks to name."""
    return float(v) if _numpy_kind(v) in ("int", "float") else v


def as_bool(v):
    """A numpy bool as a Python bool; anything else as it is, for the checks to name."""
    return bool(v) if _numpy_kind(v) == "bool" else v


def check_bool(name: str, v) -> None:
    if not isinstance(v, bool):
        raise ValueError(f"{name} must be a bool, got {type(v).__name__}")


def check_int(name: str, v, lo: int, hi: int, why: str = "") -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an int, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}]{why}, got {v}")


def on_device(device_index: int, fn, *args):
    """fn(*args) with torch's current GPU set to `device_index`, the caller's restored afterwards.

    Launchers make the tensors' device current for their runtime (hk::use_device); entering it
    through torch first means they find it current already, so no launch ever leaves the caller on
    another GPU (on ROCm the module shares torch's runtime and its current device).
    """
    if device_index == torch.cuda.current_device():
        return fn(*args)
    with torch.cuda.device(device_index):
        return fn(*args)


def raw_stream(device_index: int) -> int:
    """The current torch stream of the device, as the raw handle a launcher takes."""
    return torch._C._cuda_getCurrentRawStream(device_index)


_modules: dict = {}


def _module_key(family: str, device_index: int, params: dict) -> tuple:
    # HIPKERN_ARCH picks the arch (load_arch): a module loaded under another value is another arch's
    return (family, device_index, jit.platform.arch_env(), *sorted(params.items()))


def module_for(family: str, device_index: int, **params) -> jit.Module:
    """The module of `family` with `params` for the arch of GPU `device_index` (built on first use)."""
    key = _module_key(family, device_index, params)
    mod = _modules.get(key)
    if mod is None:
        loaded = jit.load(jit.spec(family, **params), jit.platform.load_arch(device_index))
        mod = _modules.setdefault(key, loaded)  # (a module_override entered during the load stands)
    return mod


def check_routing_out(out, num_tokens: int, topk: int) -> dict:
    """Validate a routing op's `out=` pair (fp32 weights, int32 ids, both [num_tokens, topk]); returns
    {name: tensor} for check_device (empty when out is None)."""
    if out is None:
        return {}
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ValueError("out must be a pair (weights, ids)")
    check_tensor("out[0] (weights)", out[0], dtypes=(torch.float32,), shape=(num_tokens, topk), gpu=False)
    check_tensor("out[1] (ids)", out[1], dtypes=(torch.int32,), shape=(num_tokens, topk), gpu=False)
    return {"out[0] (weights)": out[0], "out[1] (ids)": out[1]}


def check_outputs_apart(outs: dict, **inputs) -> None:
    """Raise ValueError unless each of `outs` ({name: tensor}: an op's out= tensors) shares no memory with
    any of `inputs` nor with another of `outs`. Addresses only: at launch."""
    items = list(outs.items())
    for i, (name, t) in enumerate(items):
        check_no_overlap(name, t, **inputs, **dict(items[i + 1:]))


def check_routing_apart(weights, ids, **inputs) -> None:
    """A routing op's `out=` pair must share no memory with its inputs nor with each other (the kernels
    read the logits while other rows' weights and ids are written)."""
    check_outputs_apart({"out[0] (weights)": weights, "out[1] (ids)": ids}, **inputs)


@contextlib.contextmanager
def module_override(mod: jit.Module, family: str, device_index: int, **params):
    """Within the block, module_for(family, device_index, **params) returns `mod` (a diagnostic build of
    the same module, say); the module cached before, if any, is restored after it. Process-wide: every
    thread's calls see it, and overrides of one module in several threads must not overlap."""
    key = _module_key(family, device_index, params)
    before = _modules.get(key)
    _modules[key] = mod
    try:
        yield mod
    finally:
        if before is None:
            del _modules[key]
        else:
            _modules[key] = before
