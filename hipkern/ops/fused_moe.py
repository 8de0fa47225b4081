"""Fused MoE: ``fused_moe(hidden_states, w1, w2, topk_weights, topk_ids) -> [T, D]``, the routed
experts' gated MLPs weighted and summed per token, in one call (moe_sorting + two grouped GEMMs + a
deterministic combine, or for at most 256 routed pairs the GEMMs grouping the pairs themselves; see
csrc_hip/fused_moe/)."""
from __future__ import annotations

import ctypes
import threading

import torch

from .. import jit, tuning_db
from . import moe_sorting as _sorting
from ._common import (DTYPE_NAMES, as_bool, as_int, check_aligned, check_bool, check_device, check_int,
                      check_no_overlap, check_tensor, choice_inputs, gpu_name, impl_checked, lib, memo, module_for,
                      on_device, raw_stream, sm_count, validated)

__all__ = ["fused_moe", "ACTIVATIONS", "BLOCK_MS", "DECODE_MAX_PAIRS", "GEMV_MAX_DOWN_UNITS", "GEMV_MAX_GATED_BLOCKS",
           "GEMV_MAX_PAIRS", "GEMV_VARIANTS", "ROUTE_MAX_PAIRS", "VARIANT", "VARIANTS", "block_ms_for", "choose_block_m",
           "choose_config", "choose_variant", "decode_fits", "default_block_m", "gemv_fits", "gemv_variants",
           "launch_choice"]

ACTIVATIONS = {"silu": 0, "gelu": 1}  # gelu: the exact (erf) form, torch's default
BLOCK_MS = (8, 16, 32, 64, 128)
VARIANT = "grouped"  # moe_sorting, then the two grouped GEMMs and the combine: four launches (three where
# the GEMM blocks group at most _block_route_pairs() pairs by expert themselves)
# "decode": the same GEMMs with the routing and the combine in one launch, for at most
# DECODE_MAX_PAIRS routed pairs (csrc_hip/fused_moe/decode.h).
# "gemv": matrix-vector products streaming the weights into registers, for at most GEMV_MAX_PAIRS
# routed pairs; two launches, no sorting; block_m only names the module (csrc_hip/fused_moe/gemv.h).
# "gemv_mma" (float16 / bfloat16): "gemv" with each expert's pairs computed together on matrix cores in
# both launches (a pair alone on its expert keeps gemv's gated row): under routings that pile pairs onto
# experts faster (H100: DeepSeek-like 4 tokens all on the same 8 experts, 64 -> 40 us), under uniform
# routing slower (DeepSeek-like 1-4 tokens by 2-4 us, Mixtral 8x7B 1 token by 3 %); the tuner chooses
# between them per shape.
VARIANTS = (VARIANT, "decode", "gemv", "gemv_mma")
GEMV_VARIANTS = ("gemv", "gemv_mma")
DECODE_MAX_PAIRS = 32
DECODE_MAX_BLOCK_M = 64
GEMV_MAX_PAIRS = 32
# gemv's grids (gemv.h launch_gemv): a gated block of 256 threads a (pair, inter_dim row), a down block of
# 256 threads a kDownThreads / wave tokens x model_dim units. HIP runs a grid of 2^32 threads or more
# wrongly (csrc_hip/include/hipkern/launch.h threads_fit), so gemv takes calls under both bounds (at 64-lane
# waves) on every platform.
GEMV_MAX_GATED_BLOCKS = 1 << 24
GEMV_MAX_DOWN_UNITS = 1 << 26
ROUTE_MAX_PAIRS = 256  # the grouped GEMMs route in their blocks up to this many pairs (route.h kRoutePairs)
_VARIANT_CODES = {VARIANT: 0, "decode": 1, "gemv": 2, "gemv_mma": 3}

# Tuning-database schema (hipkern/tuning_db.py): the token count is the bucket; E is the routed
# expert count (expert_map's length when given). skewed_us: the same call with every token routed to
# the same experts (the tuner's second objective: hipkern/tune/fused_moe.py).
def block_ms_for(dtype) -> tuple:
    """The block_m values of a dtype (float32 keeps its accumulators in registers up to 64)."""
    return BLOCK_MS if dtype != torch.float32 else tuple(b for b in BLOCK_MS if b <= 64)


def _row_elems(dtype) -> int:
    """Elements of a 16-byte chunk of `dtype`: the kernels' rows come in such chunks, so model_dim and inter_dim
    must be multiples of it."""
    return 16 // dtype.itemsize


def _row_problem(row: dict) -> str | None:
    """Why the op could not run a tuning-database row (tuning_db.Schema.check), or None: a dtype it does
    not take, a size that is no positive integer as the op names it or off its 16-byte rows (such a row
    would never match), a block_m off the dtype's grid, a gemv variant the dtype lacks."""
    dtype = next((d for d, name in DTYPE_NAMES.items() if name == row["dtype"]), None)
    if dtype is None:
        return f"dtype {row['dtype']!r} is not one of {sorted(DTYPE_NAMES.values())}"
    why = tuning_db.positive_ints(row, ("model_dim", "inter_dim", "num_experts", "topk"))
    if why:
        return why
    vec = _row_elems(dtype)
    if int(row["model_dim"]) % vec or int(row["inter_dim"]) % vec:
        return f"model_dim {row['model_dim']} or inter_dim {row['inter_dim']} is no multiple of {vec} ({row['dtype']})"
    bm = row["params"].get("block_m")
    if bm is not None and bm not in block_ms_for(dtype):
        return f"block_m={bm} is not one of {block_ms_for(dtype)} for {row['dtype']}"
    if row["variant"] in GEMV_VARIANTS and row["variant"] not in gemv_variants(dtype):
        return f"variant {row['variant']} does not run {row['dtype']}"
    return None


tuning_db.register(tuning_db.Schema(
    op="fused_moe", exact_keys=("dtype", "model_dim", "inter_dim", "num_experts", "topk"),
    bucket_keys=("tokens",), param_keys=("block_m",), variants=frozenset(VARIANTS),
    param_ranges={"block_m": (min(BLOCK_MS), max(BLOCK_MS))}, measures=("skewed_us",), check=_row_problem))


lib.define("fused_moe(Tensor hidden_states, Tensor w1, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
           "str activation='silu', Tensor? expert_map=None, int block_m=0, str variant='') -> Tensor")
lib.define("fused_moe_out(Tensor hidden_states, Tensor w1, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
           "str activation, Tensor? expert_map, int block_m, str variant, Tensor(a!) out) -> ()")


def default_block_m(num_tokens: int, topk: int, num_experts: int, dtype=torch.bfloat16) -> int:
    """Rows per expert block when the caller gives none (measured on the H100, see
    csrc_hip/fused_moe/NOTES.md): twice the mean pairs per routed expert (room for the routing's
    spread, so an expert's tokens mostly fit one block and its weights stream once), rounded up to a
    power of two in [8, 64]. float32 takes 32 (its 32-row tiles were the fastest at every size)."""
    if dtype == torch.float32:
        return 32
    pairs = num_tokens * topk
    want = -(-2 * pairs // max(1, min(num_experts, pairs)))
    bm = 8
    while bm < want and bm < 64:
        bm *= 2
    return bm


def decode_fits(num_tokens: int, topk: int, block_m: int, dim: int = 0, inter_dim: int = 0) -> bool:
    """Whether the decode variant can run this call: at most DECODE_MAX_PAIRS routed pairs, block_m <=
    DECODE_MAX_BLOCK_M, and its work items in int32 (its launcher counts DECODE_MAX_PAIRS m-blocks by the
    narrowest column tiles, 8; dims of 0: not checked)."""
    return (num_tokens * topk <= DECODE_MAX_PAIRS and block_m <= DECODE_MAX_BLOCK_M
            and DECODE_MAX_PAIRS * -(-max(dim, inter_dim) // 8) < 2**30)


def gemv_variants(dtype) -> tuple:
    """The gemv variants a dtype runs: "gemv_mma" needs matrix cores, so float16 / bfloat16 only."""
    return GEMV_VARIANTS if dtype != torch.float32 else ("gemv",)


def gemv_fits(num_tokens: int, topk: int, dim: int = 0, inter_dim: int = 0) -> bool:
    """Whether the gemv variants can run this call: at most GEMV_MAX_PAIRS routed pairs, and grids under
    HIP's limit (pairs x inter_dim < GEMV_MAX_GATED_BLOCKS, tokens x model_dim < GEMV_MAX_DOWN_UNITS;
    dims of 0: not checked)."""
    pairs = num_tokens * topk
    return (pairs <= GEMV_MAX_PAIRS and pairs * inter_dim < GEMV_MAX_GATED_BLOCKS
            and num_tokens * dim < GEMV_MAX_DOWN_UNITS)


def choose_config(arch: str, cu_count: int, num_tokens: int, dim: int, inter_dim: int, num_experts: int,
                  topk: int, dtype, device_name: str = "") -> tuple:
    """(variant, block_m) for variant=None and block_m=None on a GPU of `arch`, `cu_count` and name
    `device_name` (tuning_db.lookup; "": unknown, so only rows without a device are exact, and of the named
    rows of a shape the newest is the nearest): the tuning database's row for this shape (exact, else nearest
    by the token bucket), its variant kept where it can run these tokens (a nearest row's "decode" may not:
    then choose_variant's); without a row, default_block_m and choose_variant. The op passes its GPU's name."""
    choice = tuning_db.lookup("fused_moe", arch, cu_count, device_name=device_name, dtype=DTYPE_NAMES[dtype],
                              model_dim=dim, inter_dim=inter_dim, num_experts=num_experts, topk=topk,
                              tokens=tuning_db.bucket(num_tokens))
    if choice is None:
        bm = default_block_m(num_tokens, topk, num_experts, dtype)
        return choose_variant(num_tokens, topk, dtype, bm, num_experts, dim, inter_dim), bm
    # An empty block_m is the variant's default (the loader has checked any other against the dtype).
    bm = choice.params.get("block_m") or default_block_m(num_tokens, topk, num_experts, dtype)
    if choice.variant == "decode" and not decode_fits(num_tokens, topk, bm, dim, inter_dim):
        return VARIANT, bm
    if choice.variant in GEMV_VARIANTS and not gemv_fits(num_tokens, topk, dim, inter_dim):  # a gemv row's block_m only
        return VARIANT, default_block_m(num_tokens, topk, num_experts, dtype)  # names its module
    return choice.variant, bm


def choose_block_m(arch: str, cu_count: int, num_tokens: int, dim: int, inter_dim: int, num_experts: int,
                   topk: int, dtype, device_name: str = "") -> int:
    """block_m for block_m=None: choose_config's."""
    return choose_config(arch, cu_count, num_tokens, dim, inter_dim, num_experts, topk, dtype, device_name)[1]


def choose_variant(num_tokens: int, topk: int, dtype=torch.bfloat16, block_m: int = 8,
                   num_experts: int | None = None, dim: int = 0, inter_dim: int = 0) -> str:
    """The variant for variant=None without a database row (or with block_m given). Measured on the
    H100 (csrc_hip/fused_moe/NOTES.md): "gemv" where it fits and the pairs are at most half the
    experts (most experts then get one pair: 1 token x top-8 of 256, 37 us against decode's 46; but 8
    tokens x top-2 of 8, where each expert's rows are read by two pairs, 1440 against 820-875); else
    "decode" for 16-bit types where it fits (decode_fits), else "grouped" (float32 was faster grouped
    than decode: 107 against 120 us). Without num_experts (launch_choice when the caller gives
    block_m, a parameter of the tiled GEMMs) never "gemv"; dim / inter_dim as gemv_fits takes them."""
    if gemv_fits(num_tokens, topk, dim, inter_dim) and num_experts is not None and 2 * num_tokens * topk <= num_experts:
        return "gemv"
    return "decode" if decode_fits(num_tokens, topk, block_m, dim, inter_dim) and dtype != torch.float32 else VARIANT


def launch_choice(device_index: int, num_tokens: int, dim: int, inter_dim: int, num_experts: int, topk: int, dtype,
                  block_m: int = 0, variant: str = "") -> tuple:
    """(variant, block_m) the op runs on GPU `device_index` for these arguments (0 / "": not given):
    without block_m the database's choice (choose_config), its variant too unless one is given;
    with block_m, choose_variant's variant unless one is given."""
    if not block_m:
        chosen, block_m = choose_config(jit.current_arch(device_index), sm_count(device_index), num_tokens, dim,
                                        inter_dim, num_experts, topk, dtype, gpu_name(device_index))
        if variant == "decode" and block_m > DECODE_MAX_BLOCK_M:
            block_m = DECODE_MAX_BLOCK_M
        variant = variant or chosen
    return variant or choose_variant(num_tokens, topk, dtype, block_m, None, dim, inter_dim), block_m


_VALID: dict = {}  # argument sets that passed _validate (_common.validated)


def _validate(hidden_states, w1, w2, topk_weights, topk_ids, activation, expert_map, block_m, out=None,
              variant=None) -> None:
    # Device checks last, so that every other argument error shows on any device.
    check_tensor("hidden_states", hidden_states, ndim=2, dtypes=tuple(DTYPE_NAMES), gpu=False)
    dtype = hidden_states.dtype
    num_tokens, dim = hidden_states.shape
    check_tensor("w1", w1, ndim=3, dtypes=(dtype,), gpu=False)
    e_local, two_i, w1_dim = w1.shape
    if w1_dim != dim or two_i % 2 or two_i == 0:
        raise ValueError(f"w1 must have shape [E, 2 * inter_dim, {dim}] (gate rows then up rows, model_dim "
                         f"{dim} from hidden_states), got {tuple(w1.shape)}")
    inter = two_i // 2
    check_tensor("w2", w2, dtypes=(dtype,), shape=(e_local, dim, inter), gpu=False)
    if e_local < 1:
        raise ValueError("w1 must hold at least one expert")
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32,), gpu=False)
    if topk_ids.shape[0] != num_tokens or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must have shape [{num_tokens}, topk >= 1] (one row per token of hidden_states), "
                         f"got {tuple(topk_ids.shape)}")
    topk = topk_ids.shape[1]
    check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), shape=(num_tokens, topk), gpu=False)
    vec = _row_elems(hidden_states.dtype)
    if dim < 1:
        raise ValueError(f"hidden_states must have at least one column (model_dim), got shape {tuple(hidden_states.shape)}")
    # the kernels' int32 sizes and row indices (2 x inter_dim rows of w1), and the tile counts rounded up from them
    if dim >= 2**30 or two_i >= 2**31:
        raise ValueError(f"model_dim ({dim}) must be below 2^30 and w1's 2 x inter_dim rows ({two_i}) below 2^31")
    if dim % vec or inter % vec:
        raise ValueError(f"model_dim ({dim}, hidden_states' columns) and inter_dim ({inter}, half of w1's rows) must "
                         f"be multiples of {vec} for {DTYPE_NAMES[dtype]} (16-byte rows)")
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if block_m is not None:
        check_int("block_m", block_m, 8, 128)
        allowed = block_ms_for(dtype)
        if block_m not in allowed:
            raise ValueError(f"block_m must be one of {allowed} or None for {DTYPE_NAMES[dtype]}, got {block_m}")
    if variant is not None:
        if not isinstance(variant, str) or variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS} or None, got {variant!r}")
        if variant == "decode" and not decode_fits(num_tokens, topk, 0, dim, inter):
            raise ValueError(f"variant='decode' takes at most {DECODE_MAX_PAIRS} routed pairs (tokens x topk) and "
                             f"model_dim / inter_dim under {2**30 // DECODE_MAX_PAIRS * 8}, got {num_tokens} x {topk} "
                             f"pairs, model_dim {dim}, inter_dim {inter}; use variant='grouped' or None")
        if variant == "decode" and block_m is not None and block_m > DECODE_MAX_BLOCK_M:
            raise ValueError(f"variant='decode' takes block_m up to {DECODE_MAX_BLOCK_M}, got {block_m}")
        if variant in GEMV_VARIANTS and not gemv_fits(num_tokens, topk, dim, inter):
            raise ValueError(f"variant={variant!r} takes at most {GEMV_MAX_PAIRS} routed pairs (tokens x topk), fewer "
                             f"than {GEMV_MAX_GATED_BLOCKS} pairs x inter_dim and {GEMV_MAX_DOWN_UNITS} tokens x "
                             f"model_dim, got {num_tokens} x {topk} pairs, inter_dim {inter}, model_dim {dim}; use "
                             "variant='grouped' or None")
        if variant in GEMV_VARIANTS and variant not in gemv_variants(dtype):
            raise ValueError(f"variant={variant!r} takes float16 or bfloat16 (matrix cores), got float32; use "
                             "variant='gemv' or None")
    if expert_map is not None:
        check_tensor("expert_map", expert_map, ndim=1, dtypes=(torch.int32,), gpu=False)
        num_experts = expert_map.shape[0]
    else:
        num_experts = e_local
    if not 1 <= num_experts <= _sorting.MAX_EXPERTS:
        raise ValueError(f"the number of experts ({num_experts}: expert_map's length, else w1's first dim) must be "
                         f"in [1, {_sorting.MAX_EXPERTS}]")
    if num_tokens * topk + num_experts * 128 + 4096 >= 2**30:
        raise ValueError(f"topk_ids has too many entries ({num_tokens * topk}) for int32 indices")
    if out is not None:
        check_tensor("out", out, dtypes=(dtype,), shape=(num_tokens, dim), gpu=False)
    check_tensor("hidden_states", hidden_states)
    others = {"w1": w1, "w2": w2, "topk_weights": topk_weights, "topk_ids": topk_ids}
    if expert_map is not None:
        others["expert_map"] = expert_map
    if out is not None:
        others["out"] = out
    check_device(hidden_states.device, **others)


def _routed_experts(w1, expert_map) -> int:
    """E, the experts topk_ids index: expert_map's length when given, else w1's."""
    return w1.shape[0] if expert_map is None else expert_map.shape[0]


_counters: dict = {}  # (device, stream, ints) -> address of zeroed ints from hk_alloc_zeroed, kept for the process
_counters_lock = threading.Lock()


def _workspace(mod, dev: int, device: torch.device):
    """(floats of split-K partials, arrival counters): the partials' size, the same for every call of the module
    on `dev` (the caller allocates them, fresh per call: graph-safe); the counters zero on entry, left zero by
    every call, so kept per (device, stream), as an address. A call being captured into a CUDA graph gets its own
    zeroed counters, a tensor made inside the graph. The kept ones come from the runtime (hk_alloc_zeroed), not
    torch's allocator: made by torch, the first eager call's counters landed in a graph's private pool where
    torch.compile's "reduce-overhead" warm-up routes allocations, which it then refused as a live allocation it
    does not track."""
    sizes = mod.__dict__.setdefault("_workspace_sizes", {})  # the module's sizes on a device, asked once
    if dev not in sizes:
        floats, ints = ctypes.c_int64(), ctypes.c_int64()
        rc = mod.hk_fused_moe_workspace(dev, ctypes.byref(floats), ctypes.byref(ints))
        if rc:
            mod.check(rc, "fused_moe workspace")
        sizes[dev] = (floats.value, ints.value)
    floats, ints = sizes[dev]
    if torch.cuda.is_current_stream_capturing():  # never the stream's eager counters: a graph may replay
        return floats, torch.zeros((ints,), dtype=torch.int32, device=device)  # on any stream
    stream = raw_stream(dev)
    key = (dev, stream, ints)
    counters = _counters.get(key)
    if counters is None:
        with _counters_lock:  # threads' first calls on one stream at once: one allocation, not one lost per thread
            counters = _counters.get(key)
            if counters is None:
                counters = _counters[key] = _alloc_counters(mod, dev, ints, stream)
    return floats, counters


def _alloc_counters(mod, dev: int, ints: int, stream: int) -> int:
    addr = ctypes.c_void_p()
    rc = mod.hk_alloc_zeroed(dev, 4 * ints, stream, ctypes.byref(addr))
    if rc:  # (out of memory outside torch's cache, say: torch's allocator would have freed its cached blocks)
        torch.cuda.empty_cache()
        rc = mod.hk_alloc_zeroed(dev, 4 * ints, stream, ctypes.byref(addr))
    if rc:
        mod.check(rc, "fused_moe counters")
    return addr.value


def _block_route_pairs(mod, dev: int) -> int:
    """The most routed pairs (tokens x topk) for which the grouped variant's GEMMs group the pairs by
    expert in their own blocks (csrc_hip/fused_moe/route.h) instead of after a moe_sorting launch: on the
    H100 that launch and the wait for it were ~4-5 us of a decode-sized call (NOTES.md, 2026-11-28).
    0 where the module's tiles, or GPU `dev`'s shared memory per block, have no room for the table."""
    cache = mod.__dict__.setdefault("_route_pairs", {})
    if dev not in cache:
        cache[dev] = int(mod.hk_fused_moe_route_pairs(dev))
    return cache[dev]


def _ptr(t):
    """The address the launcher takes: a tensor's, an address as it is (_workspace's kept counters), or None."""
    return t.data_ptr() if isinstance(t, torch.Tensor) else t


# What a call launches, by what it depends on, in two memos: the variant and block_m (launch_choice) by the shapes,
# the block_m and variant asked for and what the choice reads (the database's generation, HIPKERN_ARCH,
# launch_choice itself); then, by the module (module_for per call: module_override swaps it) and _block_route_pairs
# itself (tests replace it), whether the GEMMs route the pairs themselves and the intermediate's bytes. Deriving them
# cost an eager call ~6 us of host time (launch_choice ~4 us, a ctypes query), and its three allocations ~3 us each
# where one now serves (H200 host, csrc_hip/fused_moe/NOTES.md 2026-11-28 (14)).
_CHOICES: dict = {}
_PLANS: dict = {}


def _choice(dev, dtype, num_tokens, dim, inter, num_experts, topk, block_m, variant) -> tuple:
    """(variant, block_m) of a call on GPU `dev`, its int32 work-item count checked; memoised in _CHOICES."""
    def make():
        v, bm = launch_choice(dev, num_tokens, dim, inter, num_experts, topk, dtype, block_m, variant)
        if v == VARIANT:  # the GEMMs count their work items (m-blocks x column tiles) in int32
            pairs = num_tokens * topk
            # at most one partial block an expert; routing in the blocks counts a block a pair (decode's own
            # count, DECODE_MAX_PAIRS m-blocks whatever the call, is decode_fits', which every path that gives
            # "decode" has asked)
            mblocks = max(min(pairs, ROUTE_MAX_PAIRS), -(-pairs // bm) + num_experts)
            if mblocks * -(-max(dim, inter) // 8) >= 2**30:
                raise ValueError(f"fused_moe: {pairs} routed pairs over {num_experts} experts (up to {mblocks} "
                                 f"blocks of {bm} rows) x model_dim {dim} / inter_dim {inter} are more work items "
                                 f"than int32 indexing allows; split the tokens over calls, or the experts")
        return v, bm
    key = (dev, dtype, num_tokens, dim, inter, num_experts, topk, block_m, variant, launch_choice, *choice_inputs())
    return memo(_CHOICES, key, make)


def _plan(mod, dev, num_tokens, dim, inter, topk, variant) -> tuple:
    """(whether the kernels route the pairs themselves, the intermediate's bytes) of a call of `mod` on GPU `dev`;
    memoised in _PLANS."""
    def make():
        routed = variant != VARIANT or num_tokens * topk <= _block_route_pairs(mod, dev)
        nbytes = ctypes.c_int64()  # the intermediate (and, for some tiles, the tokens as split rows)
        rc = mod.hk_fused_moe_inter_bytes(num_tokens, topk, dim, inter, _VARIANT_CODES[variant],
                                          ctypes.byref(nbytes))
        if rc:
            mod.check(rc, "fused_moe inter_bytes")
        return routed, nbytes.value
    return memo(_PLANS, (mod, dev, num_tokens, dim, inter, topk, variant, _block_route_pairs), make)


def _launch_here(hidden_states, w1, w2, topk_weights, topk_ids, activation, expert_map, block_m, variant,
                 out) -> None:
    num_tokens, dim = hidden_states.shape
    topk = topk_ids.shape[1]
    e_local, inter = w1.shape[0], w1.shape[1] // 2
    num_experts = _routed_experts(w1, expert_map)
    dev = hidden_states.get_device()
    variant, block_m = _choice(dev, hidden_states.dtype, num_tokens, dim, inter, num_experts, topk, block_m, variant)
    mod = module_for("fused_moe", dev, dtype=DTYPE_NAMES[hidden_states.dtype], block_m=block_m)
    routed, nbytes = _plan(mod, dev, num_tokens, dim, inter, topk, variant)
    if routed:
        sorting = (None, None, None)
        max_padded = 0
    else:
        sorted_ids, expert_ids, num_post = _sorting._outputs(topk_ids, num_experts, block_m)
        _sorting._launch_here(topk_ids, num_experts, block_m, expert_map, sorted_ids, expert_ids, num_post)
        sorting = (sorted_ids.data_ptr(), expert_ids.data_ptr(), num_post.data_ptr())
        max_padded = sorted_ids.numel()
    # One allocation (each costs ~3 us of host time): the intermediate, then, but for the gemv variants (sums in
    # registers), y (fp32 [T * topk][D]) and the split-K partials, each 256-byte aligned.
    if variant in GEMV_VARIANTS:
        ws = torch.empty((nbytes,), dtype=torch.uint8, device=hidden_states.device)
        y = partials = counters = None
    else:
        floats, counters = _workspace(mod, dev, hidden_states.device)  # (counters: kept alive to the launch)
        y_at = -(-nbytes // 256) * 256
        partials_at = y_at + -(-num_tokens * topk * dim * 4 // 256) * 256
        ws = torch.empty((partials_at + 4 * floats,), dtype=torch.uint8, device=hidden_states.device)
        y, partials = ws.data_ptr() + y_at, ws.data_ptr() + partials_at
    rc = mod.hk_fused_moe(hidden_states.data_ptr(), w1.data_ptr(), w2.data_ptr(), topk_weights.data_ptr(),
                          topk_ids.data_ptr(), _ptr(expert_map), *sorting, ws.data_ptr(), y, partials,
                          _ptr(counters), out.data_ptr(), num_tokens, topk, num_experts, e_local, dim, inter,
                          max_padded, ACTIVATIONS[activation], _VARIANT_CODES[variant], dev, raw_stream(dev))
    if rc:
        mod.check(rc, "fused_moe")


def _launch(hidden_states, w1, w2, topk_weights, topk_ids, activation, expert_map, block_m, variant, out) -> None:
    if hidden_states.shape[0] == 0:
        return
    check_aligned(16, hidden_states=hidden_states, w1=w1, w2=w2, out=out)  # (16-byte vector loads)
    check_aligned(topk_weights=topk_weights, topk_ids=topk_ids, expert_map=expert_map)
    # Blocks write out while others still read the inputs: out may be hidden_states itself (every variant
    # has read all of it before the first output is written), nothing else.
    inputs = dict(w1=w1, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    check_no_overlap("out", out, "hidden_states", hidden_states=hidden_states, **inputs,
                     **({} if expert_map is None else {"expert_map": expert_map}))
    on_device(hidden_states.get_device(), _launch_here, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              expert_map, block_m, variant, out)


def _gpu_impl(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu", expert_map=None, block_m=0,
              variant=""):
    out = torch.empty_like(hidden_states)
    _launch(hidden_states, w1, w2, topk_weights, topk_ids, activation, expert_map, block_m, variant, out)
    return out


@torch.library.register_fake("hipkern::fused_moe")
def _fake(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu", expert_map=None, block_m=0, variant=""):
    _validate(hidden_states, w1, w2, topk_weights, topk_ids, activation, expert_map, block_m or None,
              variant=variant or None)
    return torch.empty_like(hidden_states)


@torch.library.register_fake("hipkern::fused_moe_out")
def _fake_out(hidden_states, w1, w2, topk_weights, topk_ids, activation, expert_map, block_m, variant, out):
    _validate(hidden_states, w1, w2, topk_weights, topk_ids, activation, expert_map, block_m or None, out,
              variant or None)


# The registered implementations validate too: torch.ops.hipkern.* called directly (or from a compiled
# graph) gets the Python function's checks before any launch.
def _checked_impl(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu", expert_map=None, block_m=0,
                  variant=""):
    _validate(hidden_states, w1, w2, topk_weights, topk_ids, activation, expert_map, block_m or None,
              variant=variant or None)
    return _gpu_impl(hidden_states, w1, w2, topk_weights, topk_ids, activation, expert_map, block_m, variant)


def _checked_out(hidden_states, w1, w2, topk_weights, topk_ids, activation, expert_map, block_m, variant, out):
    _fake_out(hidden_states, w1, w2, topk_weights, topk_ids, activation, expert_map, block_m, variant,
              out)  # the checks of trace time
    _launch(hidden_states, w1, w2, topk_weights, topk_ids, activation, expert_map, block_m, variant, out)


impl_checked("fused_moe", _checked_impl)
impl_checked("fused_moe_out", _checked_out)


def fused_moe(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, activation: str = "silu", expert_map: torch.Tensor | None = None,
              out: torch.Tensor | None = None, allow_tf32: bool = False, validate: bool = False,
              block_m: int | None = None, variant: str | None = None) -> torch.Tensor:
    """The routed experts' gated MLPs, weighted and summed per token:
    ``out[t] = sum_j topk_weights[t, j] * w2[e] @ (act(w1[e, :I] @ x_t) * (w1[e, I:] @ x_t))``,
    ``e = topk_ids[t, j]`` (through expert_map when given).

    Args:
        hidden_states: [T, D] float32, bfloat16 or float16, contiguous on the GPU (T may be 0).
        w1: [E, 2 * I, D], the gate rows then the up rows of each expert; same dtype, contiguous.
        w2: [E, D, I]; same dtype, contiguous. D and I must be multiples of 8 (16-bit) or 4 (float32); D < 2^30.
        topk_weights: float32 [T, k]. topk_ids: int32 [T, k] (both contiguous), ids in [0, E) (E: expert_map's length
            when given, else w1's first dim; 1 <= E <= 1024). Ids outside it are dropped without validate
            (undefined but in-bounds). T x k + 128 E must stay under about 2^30 (int32 indices), and the
            grouped GEMMs' work items too (m-blocks of up to T x k / block_m + E, times max(D, I) / 8):
            a call past either is refused, naming both.
        activation: "silu" or "gelu" (exact erf form).
        expert_map: optional contiguous int32 [E_global] for expert parallelism: each expert's index into w1/w2
            (whose first dim is then the local expert count), or -1 for experts on other GPUs, whose
            pairs contribute nothing here (nor do pairs mapped past w1's experts, undefined without
            validate: their weights are never read).
        out: optional contiguous [T, D] tensor of the input dtype, written in place (every element) and returned;
            it may be hidden_states itself, but must share no memory with any other input (ValueError).
        allow_tf32: permission to use TF32 for float32 inputs; the kernels keep float32 accuracy
            either way (no TF32 path yet): FMAs, or at block_m 64 on sm_90 exactly scaled two-term
            fp16 splits on the tensor cores, whose error against float64 is no larger than FMAs'
            (csrc_hip/fused_moe/NOTES.md). An infinite float32 input gives NaN there, and so may weights of
            magnitude 2^108 (~3e32) or more: a stage's sum is scaled by the weight row's power of two before
            the token's, and that product overflows (a known limit, no real model's weights come near it).
        validate: check the ids and expert_map values first (syncs with the device).
        block_m: rows per expert block of the GEMMs (8, 16, 32, 64 or 128; float32 up to 64); None:
            the tuning database's choice for this shape (choose_config), else default_block_m.
        variant: "grouped" (moe_sorting, two grouped GEMMs, a combine; up to 256 routed pairs the GEMMs
            group the pairs by expert themselves, no moe_sorting launch), "decode" (the same in one
            launch; at most DECODE_MAX_PAIRS routed pairs, block_m up to 64), "gemv" (two matrix-vector launches that
            stream the weights into registers; at most GEMV_MAX_PAIRS routed pairs, pairs x inter_dim
            under GEMV_MAX_GATED_BLOCKS and tokens x model_dim under GEMV_MAX_DOWN_UNITS (gemv_fits);
            block_m does not change it), "gemv_mma" (the same with each expert's pairs computed together on matrix
            cores; float16 / bfloat16) or None: with block_m=None the tuning database's choice
            (choose_config), else choose_variant's.

    Accumulation is fp32; for bf16/fp16 the intermediate act(gate) * up is rounded to the input dtype
    before the second product, as vLLM does (vLLM also rounds gate, up and each slot's product to the input
    dtype; here they stay fp32). The result is bitwise deterministic (no float atomics),
    and nothing syncs with the host (CUDA-graph capturable) unless validate=True.
    """
    allow_tf32, validate = as_bool(allow_tf32), as_bool(validate)
    check_bool("allow_tf32", allow_tf32)
    check_bool("validate", validate)
    block_m = as_int(block_m)
    validated(_VALID, _validate, (hidden_states, w1, w2, topk_weights, topk_ids, expert_map, out),
              (activation, block_m, variant), hidden_states, w1, w2, topk_weights, topk_ids, activation, expert_map,
              block_m, out, variant)
    if validate:
        # moe_sorting's checks, with expert_map's local indices below w1's experts (syncs with the device)
        _sorting._check_values(topk_ids, _routed_experts(w1, expert_map), expert_map, w1.shape[0], "w1's first dim",
                               "expert_map's length" if expert_map is not None else "w1's first dim")
    bm = block_m or 0
    if torch.compiler.is_compiling():  # traced: the registered ops (eager skips the dispatcher)
        if out is None:
            return torch.ops.hipkern.fused_moe.default(hidden_states, w1, w2, topk_weights, topk_ids, activation,
                                                       expert_map, bm, variant or "")
        torch.ops.hipkern.fused_moe_out.default(hidden_states, w1, w2, topk_weights, topk_ids, activation,
                                                expert_map, bm, variant or "", out)
        return out
    if out is None:
        return _gpu_impl(hidden_states, w1, w2, topk_weights, topk_ids, activation, expert_map, bm, variant or "")
    _launch(hidden_states, w1, w2, topk_weights, topk_ids, activation, expert_map, bm, variant or "", out)
    return out
