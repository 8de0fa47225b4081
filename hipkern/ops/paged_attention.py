"""Paged-attention decode: ``paged_attention_decode(query, key_cache, value_cache, block_tables,
context_lens, *, scale=None, kv_layout="NHD", out=None, return_lse=False, variant=None)``.

Variants are policies over two kernels (csrc_hip/paged_attention/): "simt" (CUDA cores, lane-per-
token QK^T, up to 8 query heads per block: v3, v9) and "mma" (matrix cores, up to the whole GQA group
per block, K/V pipelined through shared memory: v16, v5, and in small blocks v6); a variant picks a
kernel, its block size and how the context is split across the grid (uniform partitions planned on
the host, or per sequence on the GPU for v5). v4 and v7 are names for v16 (ALIASES). Every variant
accepts every input the op accepts, except: v5 at most 4096 sequences; v16/v5 head size 256 on CDNA.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import inspect
import math

import torch

from .. import jit, tuning_db
from ._common import (DTYPE_NAMES, as_bool, as_float, check_aligned, check_bool, check_device, check_no_overlap,
                      check_tensor, choice_inputs, gpu_name, impl_checked, is_float32, lib, memo, module_for, on_device,
                      raw_stream, sm_count, validated)

__all__ = ["paged_attention_decode", "VARIANTS", "ALIASES", "HEAD_SIZES", "KV_LAYOUTS", "MAX_GQA", "MAX_BLOCK_SIZE"]

HEAD_SIZES = (64, 128, 256)
KV_LAYOUTS = ("NHD", "HND")  # [blocks, block_size, kv_heads, D] / [blocks, kv_heads, block_size, D]
MAX_GQA = 64
MAX_BLOCK_SIZE = 1024  # the cache's block size: a power of two up to this
MAX_TOKENS = 2**30 - 1  # per block-table row: keeps the kernel's 32-bit token sums below 2^31
MAX_PARTITIONS = 65535  # grid z
# HIP runs a grid of 2^32 threads or more wrongly (launch.h threads_fit; the launcher refuses it): on 64-lane
# waves (CDNA) a split keeps its decode grid under this many blocks of up to 1024 threads. CUDA's grid
# limits are per dimension (MAX_PARTITIONS, 65535 sequences).
HIP_MAX_GRID_BLOCKS = (2**32 - 1) // 1024
DTYPES = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class Kernel:
    code: int  # the module's `kernel` argument
    tile: callable  # wave size -> tokens a block takes per step (partitions are whole tiles)
    heads_per_block: callable  # GQA group -> query heads per block (the default)
    block_heads: tuple  # the heads-per-block instantiations the module has


KERNELS = {
    "simt": Kernel(0, lambda wave: 4 * wave, lambda group: min(8, 1 << (group - 1).bit_length()),
                   (1, 2, 4, 8)),  # decode_simt.h
    "mma": Kernel(1, lambda wave: 64, lambda group: min(64, max(16, 1 << (group - 1).bit_length())),
                  (16, 32, 64)),  # decode_mma.h
    "mma_small": Kernel(2, lambda wave: 32, lambda group: 16, (16,)),  # decode_mma.h, 2 waves, 32-token tiles
}


@dataclasses.dataclass(frozen=True)
class Plan:
    num_partitions: int  # per_sequence: the split target (see _plan_per_sequence)
    partition_size: int  # tokens (per_sequence: 0, the GPU sizes partitions)
    per_sequence: bool = False

    def grid_blocks(self, blocks: int, num_seqs: int) -> int:
        """Decode blocks a launch runs, given Shape.blocks (one partition's) and the sequences: a uniform split
        runs every partition of every sequence; a per-sequence one an item a sequence plus its split target's
        items, each of blocks / num_seqs blocks."""
        if self.per_sequence:
            return (num_seqs + self.num_partitions) * (blocks // num_seqs)
        return blocks * self.num_partitions


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    idea: str
    plan: callable  # (Shape, **params) -> Plan; params: partition_size (the largest partition)
    kernel: str = "simt"  # a key of KERNELS
    max_seqs: int = 65535  # the most sequences it takes (the op's own limit by default)


@dataclasses.dataclass(frozen=True)
class Shape:
    num_seqs: int
    num_kv_heads: int
    group: int
    max_tokens: int  # what a block-table row addresses: an upper bound of every context length
    sm_count: int
    tile: int  # tokens a block takes per step
    heads_per_block: int
    resident: int = 1  # blocks of the kernel one SM holds at once
    max_grid_blocks: int = 0  # > 0: the most blocks a split's decode grid may have (HIP_MAX_GRID_BLOCKS)

    @property
    def blocks(self) -> int:  # thread blocks of one partition
        return self.num_seqs * self.num_kv_heads * math.ceil(self.group / self.heads_per_block)


def heads_per_block(variant: Variant, group: int, params: dict) -> int:
    """Query heads one block takes: the `heads_per_block` parameter if given (a size the kernel has,
    at most its default for this group: a smaller one splits the group over several blocks, each
    reading the group's K/V), else the kernel's default for the group."""
    kernel = KERNELS[variant.kernel]
    default = kernel.heads_per_block(group)
    want = params.get("heads_per_block")
    if want is None:
        return default
    allowed = [h for h in kernel.block_heads if h <= default]
    if want not in allowed:
        raise ValueError(f"heads_per_block for variant {variant.name} with GQA group {group} must be one of "
                         f"{allowed}, got {want}")
    return want


def with_heads(variant: Variant, params: dict, num_seqs: int, num_q_heads: int, num_kv_heads: int, max_tokens: int,
               sm_count: int) -> dict:
    """`params` with heads_per_block chosen when not given: the matrix-core kernel splits a large GQA
    group (> 16 heads) over several blocks when the work is too small to give every SM a block of the
    whole group (measured on the H100, head 256, group 64: 16-head blocks are 1.2-1.7x faster up to
    ~1 tile per SM, 32-head blocks up to ~2, whole groups beyond)."""
    group = num_q_heads // num_kv_heads
    if "heads_per_block" in params or variant.kernel != "mma" or group <= 16:
        return params
    units = num_seqs * num_kv_heads * math.ceil(max_tokens / KERNELS["mma"].tile(32))  # 64-token tiles
    default = KERNELS["mma"].heads_per_block(group)
    hpb = 16 if units <= sm_count else 32 if units <= 2 * sm_count else default
    return {**params, "heads_per_block": min(hpb, default)}


def make_shape(variant: Variant, num_seqs, num_q_heads, num_kv_heads, max_tokens, sm_count, wave_size,
               resident=1, params=None) -> Shape:
    """The launch geometry `variant`'s plan sees (for the op, the tuner and the benchmark)."""
    kernel = KERNELS[variant.kernel]
    group = num_q_heads // num_kv_heads
    return Shape(num_seqs, num_kv_heads, group, max_tokens, sm_count, kernel.tile(wave_size),
                 heads_per_block(variant, group, params or {}), resident, HIP_MAX_GRID_BLOCKS if wave_size == 64 else 0)


def resident_for(dtype: str, head_size: int, variant: str, group: int, device: int, params=None) -> int:
    """resident_blocks of `variant`'s kernel for a shape (builds/loads its module)."""
    var = VARIANTS[variant]
    mod = module_for("paged_attention", device, dtype=dtype, head_size=head_size)
    return resident_blocks(mod, var.kernel, heads_per_block(var, group, params or {}), device)


def plan_of(variant: Variant, shape: Shape, params: dict) -> "Plan":
    """The variant's plan for `shape` (heads_per_block, already in the shape, is no plan parameter)."""
    return variant.plan(shape, **{k: v for k, v in params.items() if k != "heads_per_block"})


@functools.lru_cache(maxsize=None)
def resident_blocks(mod, kernel: str, heads_per_block: int, device: int) -> int:
    """Blocks of one kernel instantiation an SM holds at once on `device` (the module asks the runtime)."""
    n = ctypes.c_int(0)
    rc = mod.hk_paged_attention_resident_blocks(KERNELS[kernel].code, heads_per_block, device, ctypes.addressof(n))
    if rc:
        mod.check(rc, "paged_attention_decode (occupancy)")
    return max(1, n.value)


def merges_in_clusters(mod, kernel: str, heads_per_block: int, num_partitions: int, blocks: int, device: int) -> bool:
    """Whether a uniform split of `num_partitions` partitions over `blocks` blocks of a kernel merges
    inside thread-block clusters (sm_90: no partials, no merge kernel) rather than through the merge
    kernel. The launcher decides; this asks it the same question (for tests and the benchmark)."""
    n = ctypes.c_int(0)
    rc = mod.hk_paged_attention_cluster_merge(KERNELS[kernel].code, heads_per_block, num_partitions, blocks, device,
                                              ctypes.addressof(n))
    if rc:
        mod.check(rc, "paged_attention_decode (cluster merge)")
    return bool(n.value)


def _split(shape: Shape, partition_size: int) -> Plan:
    # Whole tiles: the tensor-map kernels load a tile's rows in boxes from the cache block of its first
    # token, so a partition starting inside a box (a database row's 100 tokens) would read zeros.
    partition_size = max(1, math.ceil(partition_size / shape.tile)) * shape.tile
    parts = max(1, math.ceil(shape.max_tokens / partition_size))
    most = MAX_PARTITIONS
    if shape.max_grid_blocks:
        most = min(most, max(1, shape.max_grid_blocks // shape.blocks))
    if parts > most:  # larger partitions, whole tiles, within the grid
        partition_size = math.ceil(shape.max_tokens / most / shape.tile) * shape.tile
        parts = math.ceil(shape.max_tokens / partition_size)
    return Plan(1, shape.max_tokens) if parts == 1 else Plan(parts, partition_size)


def _plan_hybrid(shape: Shape, partition_size: int = 512, blocks_per_sm: int = 4) -> Plan:
    """v3: split each context into partitions of whole block tiles, at most `partition_size` tokens
    each (512: the best fixed size measured on the H100), and smaller when the batch alone gives fewer
    than ~`blocks_per_sm` blocks per SM; one pass when a single partition covers the context."""
    want = max(math.ceil(blocks_per_sm * shape.sm_count / shape.blocks), math.ceil(shape.max_tokens / partition_size))
    return _split(shape, math.ceil(shape.max_tokens / want / shape.tile) * shape.tile)


# Blocks that, streaming at once, take the memory's whole rate, as measured on the H100 for 16-head blocks of
# head size 128: one streams ~33 GB/s alone, the H100 ~3 TB/s (NOTES.md, 2026-11-27 (11) and 2026-11-28 (3)).
# Other blocks and GPUs differ (an H200 streams ~4.8 TB/s); the database's measured rows decide where it has them.
SATURATE_BLOCKS = 96


def _plan_balanced(shape: Shape, partition_size: int = 0, block_cost: int = 64, merge_cost: int = 192) -> Plan:
    """v16: partitions of `partition_size` tokens if given; else one pass where the unsplit grid is one
    wave that already streams at the memory's rate (its blocks' tokens take the memory longer, at
    SATURATE_BLOCKS block-tokens a step, than the wave takes its blocks: a split would add only its
    merge; a grid of more waves ends on a partial wave that does not, so it keeps the cost below); else
    the count that minimises a cost in token-steps (a step: one token of one block running alone): waves
    of blocks over the SMs' slots (sm_count x resident) x (tokens per partition + `block_cost`), plus
    `merge_cost` when split (the merge launch). One pass when nothing is gained."""
    if partition_size:
        return _split(shape, partition_size)
    tiles = math.ceil(shape.max_tokens / shape.tile)
    slots = shape.sm_count * shape.resident
    stream = shape.blocks * tiles * shape.tile / SATURATE_BLOCKS  # the memory's time for the whole grid
    if shape.blocks <= slots and stream >= tiles * shape.tile + block_cost:
        return _split(shape, tiles * shape.tile)
    most = min(tiles, MAX_PARTITIONS, max(1, math.ceil(2 * slots / shape.blocks)))
    best = None
    for parts in range(1, most + 1):
        size = math.ceil(tiles / parts) * shape.tile
        cost = math.ceil(shape.blocks * parts / slots) * (size + block_cost) + (merge_cost if parts > 1 else 0)
        if best is None or cost < best[0]:
            best = (cost, size)
    return _split(shape, best[1])


MAX_PER_SEQUENCE_SEQS = 4096  # v5: every block scans all context lengths for its plan


def _plan_per_sequence(shape: Shape, blocks_per_slot: int = 1, partition_size: int = 128) -> Plan:
    """v5: the split is made on the GPU from the context lengths. Every sequence's partitions hold
    c = ceil(all tiles / T) tiles, T = `blocks_per_slot` x the SMs' slots / blocks per item (KV heads x
    head groups), and at least `partition_size` tokens: a long sequence among short ones is split, the
    short ones are not, and the launch has about blocks_per_slot x slots blocks of equal work whatever
    the lengths."""
    per_item = shape.blocks // shape.num_seqs
    target = max(1, math.ceil(blocks_per_slot * shape.sm_count * shape.resident / per_item))
    most = 65535 - shape.num_seqs  # grid y: num_seqs + target items
    if shape.max_grid_blocks:  # (HIP) per_item x items blocks
        most = min(most, max(1, shape.max_grid_blocks // per_item - shape.num_seqs))
    smallest = min(MAX_TOKENS, max(1, math.ceil(partition_size / shape.tile)) * shape.tile)
    return Plan(min(target, most), smallest, per_sequence=True)


VARIANTS = {
    "v3": Variant("v3", "hybrid split-K: flash-decoding partitions of <= 512 tokens, smaller for small "
                  "batches (~4 blocks per SM), merged by LSE; a single pass when one covers the context",
                  _plan_hybrid),
    "v9": Variant("v9", "multi-warp GQA block over fixed partitions, 512 tokens by default (always split-K)",
                  lambda shape, partition_size=512: _split(shape, partition_size)),
    "v16": Variant("v16", "matrix cores: the whole GQA group (16-row tiles) against K/V tiles of 64 tokens "
                   "pipelined through shared memory; partitions from a cost model of the SMs' slots "
                   "(_plan_balanced)", _plan_balanced, kernel="mma"),
    "v6": Variant("v6", "occupancy: v16's kernel in small blocks (2 waves, 16 query heads, 32-token tiles, 2 "
                  "stages: about a third of the shared memory, 2-3x the blocks per SM) for large batches; "
                  "partitions as v16 (_plan_balanced)", _plan_balanced, kernel="mma_small"),
    "v5": Variant("v5", "v16's kernel, split per sequence on the GPU: partitions of equal work sized from "
                  "the batch's context lengths, so long sequences are split and short ones are not "
                  "(_plan_per_sequence)", _plan_per_sequence, kernel="mma", max_seqs=MAX_PER_SEQUENCE_SEQS),
}


def _block_size_ok(bs: int) -> bool:
    """Whether the op takes caches of `bs` tokens a block: a power of two up to MAX_BLOCK_SIZE."""
    return 1 <= bs <= MAX_BLOCK_SIZE and not bs & (bs - 1)


def _row_problem(row: dict) -> str | None:
    """Why the op could not run a tuning-database row (tuning_db.Schema.check), or None: a shape the op does
    not take or names otherwise (dtype, layout, head size, block size, GQA group: such a row would never
    match), a parameter its variant's plan does not take, a heads_per_block its kernel lacks for the row's
    GQA group, or a head size its kernel does not run on the row's arch."""
    why = tuning_db.positive_ints(row, ("head_size", "block_size", "num_q_heads", "num_kv_heads"))
    if why:
        return why
    dtypes = sorted(DTYPE_NAMES[t] for t in DTYPES)
    if row["dtype"] not in dtypes:
        return f"dtype {row['dtype']!r} is not one of {dtypes}"
    if row["kv_layout"] not in KV_LAYOUTS:
        return f"kv_layout {row['kv_layout']!r} is not one of {KV_LAYOUTS}"
    d, bs, q, kv = (int(row[k]) for k in ("head_size", "block_size", "num_q_heads", "num_kv_heads"))
    if d not in HEAD_SIZES:
        return f"head_size {d} is not one of {HEAD_SIZES}"
    if not _block_size_ok(bs):
        return f"block_size {bs} is not a power of two up to {MAX_BLOCK_SIZE}"
    if q % kv or q // kv > MAX_GQA:
        return f"{q} query heads over {kv} KV heads is no GQA group the op takes"
    var = VARIANTS[row["variant"]]
    takes = (set(inspect.signature(var.plan).parameters) - {"shape"}) | {"heads_per_block"}
    extra = sorted(set(row["params"]) - takes)
    if extra:
        return f"variant {var.name} takes no {', '.join(extra)}"
    try:
        heads_per_block(var, q // kv, row["params"])
    except ValueError as e:
        return str(e)
    if not kernel_runs(var, d, jit.wave_size_of(row["arch"])):
        return f"variant {var.name} does not run head size {d} on {row['arch']} (use v3 or v9 there)"
    return None


# Tuning-database schema (hipkern/tuning_db.py): the batch and context buckets are powers of two;
# the context bucket is what the block table addresses (max_blocks_per_seq * block_size), known
# without reading context_lens from the GPU.
tuning_db.register(tuning_db.Schema(
    op="paged_attention",
    exact_keys=("dtype", "head_size", "block_size", "num_q_heads", "num_kv_heads", "kv_layout"),
    bucket_keys=("batch", "context"),
    param_keys=("partition_size", "heads_per_block", "blocks_per_slot"),
    variants=frozenset(VARIANTS),
    param_ranges={"partition_size": (1, MAX_TOKENS), "heads_per_block": (1, MAX_GQA), "blocks_per_slot": (1, 64)},
    check=_row_problem))
# Names of the design that measured as v16 itself (NOTES.md, version 11), kept so that they run:
#   v4 (a fast path for full tiles without bounds checks, a safe one for the tail): v16 copies full and
#      partial tiles with the same cp.async (masked rows zero-filled by it at no cost) and masks scores
#      per tile; compiled without the mask it ran within 0.3 us (< 1 %) of itself on full-length shapes;
#   v7 (16-byte loads for every head size through one lane mapping): v16's staging is exactly that.
ALIASES = {"v4": "v16", "v7": "v16"}


def _strides(t) -> list:
    """t's strides with those of one-element dimensions as 0 (see _cache_dims)."""
    return [0 if n == 1 else x for n, x in zip(t.shape, t.stride())]


def _cache_dims(kv_layout, cache):
    """(blocks, block size, KV heads, head size, block / token / head strides). A dimension of one element
    has no stride that matters, and torch allows any there (2^40 elements, say, which the tensor maps
    refuse): it reads as 0, as an expanded dimension's."""
    st = _strides(cache)
    if kv_layout == "NHD":
        nb, bs, hkv, d = cache.shape
        return nb, bs, hkv, d, st[0], st[1], st[2]
    nb, hkv, bs, d = cache.shape
    return nb, bs, hkv, d, st[0], st[2], st[1]


def _validate(query, key_cache, value_cache, block_tables, context_lens, scale, kv_layout, out, return_lse,
              variant):
    check_tensor("query", query, ndim=3, dtypes=DTYPES, contiguous=False, gpu=False)
    if query.stride(-1) != 1:
        raise ValueError("query must have a contiguous last (head) dimension")
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        check_tensor(name, c, ndim=4, dtypes=(query.dtype,), contiguous=False, gpu=False)
        if c.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last (head) dimension")
    if value_cache.shape != key_cache.shape or _strides(value_cache) != _strides(key_cache):
        raise ValueError(f"value_cache must have the shape and strides of key_cache (but on dimensions of one "
                         f"element), got "
                         f"{tuple(value_cache.shape)}/{value_cache.stride()} vs {tuple(key_cache.shape)}/{key_cache.stride()}")
    num_seqs, num_q_heads, head_size = query.shape
    nb, bs, hkv, d, sb, st, sh = _cache_dims(kv_layout, key_cache)
    if head_size not in HEAD_SIZES:
        raise ValueError(f"query head size must be one of {HEAD_SIZES}, got {head_size}")
    if d != head_size:
        raise ValueError(f"key_cache head size {d} (layout {kv_layout}) differs from query's {head_size}")
    if not _block_size_ok(bs):
        raise ValueError(f"key_cache block size must be a power of two up to {MAX_BLOCK_SIZE} (layout {kv_layout}), "
                         f"got {bs}")
    if num_q_heads < 1:
        raise ValueError(f"query must have at least one head, got shape {tuple(query.shape)}")
    if hkv < 1 or num_q_heads % hkv:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of key_cache's KV heads ({hkv}, "
                         f"layout {kv_layout})")
    if num_q_heads // hkv > MAX_GQA:
        raise ValueError(f"GQA ratio query heads / KV heads must be at most {MAX_GQA}, got {num_q_heads // hkv}")
    if sb % 8 or st % 8 or sh % 8:
        raise ValueError(f"key_cache/value_cache rows must be 16-byte aligned: strides must be multiples of 8 "
                         f"elements, got {key_cache.stride()}")
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,), contiguous=False, gpu=False)
    # (a one-column table's column stride is never used: torch allows any there)
    if (block_tables.shape[0] != num_seqs or (block_tables.stride(-1) != 1 and block_tables.shape[1] > 1)
            or block_tables.shape[1] < 1):
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_blocks_per_seq >= 1] with a contiguous "
                         f"last dimension, got {tuple(block_tables.shape)} strides {block_tables.stride()}")
    if block_tables.shape[1] * bs > MAX_TOKENS:
        raise ValueError(f"block_tables addresses {block_tables.shape[1] * bs} tokens per sequence "
                         f"(max_blocks_per_seq * block_size); at most {MAX_TOKENS}")
    if nb < 1:
        raise ValueError("key_cache must hold at least one block")
    check_tensor("context_lens", context_lens, dtypes=(torch.int32,), shape=(num_seqs,), gpu=False)
    if not 1 <= num_seqs <= 65535:
        raise ValueError(f"query must hold 1..65535 sequences, got {num_seqs}")
    # the kernels scale scores by scale * log2(e) in float32 (exp2): that product must be finite too
    if scale is not None and not (is_float32(scale) and is_float32(scale * math.log2(math.e))):
        raise ValueError(f"scale must be a float with scale * log2(e) finite in float32 (the kernels' type; "
                         f"|scale| < 2.3e38) or None, got {scale!r}")
    check_bool("return_lse", return_lse)
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"variant must be None or one of {sorted(VARIANTS) + sorted(ALIASES)}, got {variant!r}")
    if variant is not None and query.shape[0] > VARIANTS[variant].max_seqs:
        raise ValueError(f"variant {variant} supports at most {VARIANTS[variant].max_seqs} sequences, query has "
                         f"{query.shape[0]}: use v16")
    if out is not None:
        check_tensor("out", out, dtypes=(query.dtype,), shape=tuple(query.shape), gpu=False)
    dev = query.device
    tensors = {"query": query, "key_cache": key_cache, "value_cache": value_cache, "block_tables": block_tables,
               "context_lens": context_lens}
    if out is not None:
        tensors["out"] = out
    check_tensor("query", query, contiguous=False)
    check_device(dev, **tensors)


def _check_variant_runs(query, variant) -> None:
    """A variant asked for must run query's head size on the arch the op builds for: checked before any allocation
    or build (and while tracing; not in _validate, whose memo does not key on the arch). Where no arch can be known
    yet (fake tensors without a GPU) or HIPKERN_ARCH names one the GPU cannot run, the launch's module load says so."""
    var, head_size = VARIANTS.get(variant), query.shape[-1]
    if var and not all(kernel_runs(var, head_size, wave) for wave in (32, 64)):  # the arch decides: ask it
        try:
            arch = jit.platform.load_arch(query.get_device())
        except jit.JitError:
            return
        _check_runs(var, head_size, jit.wave_size_of(arch))


def _check_runs(var: Variant, head_size: int, wave_size: int) -> None:
    if not kernel_runs(var, head_size, wave_size):
        raise ValueError(f"variant {var.name} supports head sizes 64 and 128 on this GPU (CDNA: its K/V tiles of head "
                         f"size 256 do not fit 64 KB of LDS); got head size 256: use variant v3, v9 or v6")


_VALID: dict = {}  # argument sets that passed _validate (_common.validated)


# variant "" lets the launch choose (tuning database, else heuristic): the lookup reads files, so
# it runs in the op's implementation, never inside a traced graph.
lib.define("paged_attention_decode(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
           "Tensor context_lens, float scale, str kv_layout, str variant, Tensor(a!) out, Tensor(b!) lse) -> ()")


def _launch(query, key_cache, value_cache, block_tables, context_lens, scale, kv_layout, variant, out, lse):
    on_device(query.get_device(), _launch_here, query, key_cache, value_cache, block_tables, context_lens, scale,
              kv_layout, variant, out, lse)


def _launch_here(query, key_cache, value_cache, block_tables, context_lens, scale, kv_layout, variant, out, lse):
    num_seqs, num_q_heads, head_size = query.shape
    nb, bs, hkv, _, sb, st, sh = _cache_dims(kv_layout, key_cache)
    # here, not in _validate: data pointers do not exist while tracing; out is written 4 elements at a time
    check_aligned(16, key_cache=key_cache, value_cache=value_cache)
    check_aligned(4 * out.element_size(), out=out)
    check_aligned(query=query, block_tables=block_tables, context_lens=context_lens, lse=lse if lse.numel() else None)
    # Blocks write their heads' output rows while others still read: out may be query itself, nothing else;
    # lse (when asked for) overlaps nothing.
    check_no_overlap("out", out, "query", query=query, key_cache=key_cache, value_cache=value_cache,
                     block_tables=block_tables, context_lens=context_lens)
    if lse.numel():
        check_no_overlap("lse", lse, query=query, key_cache=key_cache, value_cache=value_cache,
                         block_tables=block_tables, context_lens=context_lens, out=out)
    nb = min(nb, 2**31 - 1)  # block ids are int32: blocks past that cannot be named (an expanded cache)
    dev = query.get_device()
    mod = module_for("paged_attention", dev, dtype=DTYPE_NAMES[query.dtype], head_size=head_size)
    kernel_code, hpb, plan = _launch_plan(dev, mod, query, head_size, bs, hkv, kv_layout, block_tables.shape[1],
                                          variant)
    part_o = part_ml = seq_parts = None
    if plan.per_sequence:  # sized from shapes only: capturable in a CUDA graph
        items = num_seqs + plan.num_partitions
        part_o = torch.empty((items, num_q_heads, head_size), dtype=torch.float32, device=query.device)
        part_ml = torch.empty((items, num_q_heads, 2), dtype=torch.float32, device=query.device)
        seq_parts = torch.empty((num_seqs, 2), dtype=torch.int32, device=query.device)
    elif plan.num_partitions > 1:
        part_o = torch.empty((num_seqs, num_q_heads, plan.num_partitions, head_size), dtype=torch.float32,
                             device=query.device)
        part_ml = torch.empty((num_seqs, num_q_heads, plan.num_partitions, 2), dtype=torch.float32,
                              device=query.device)
    rc = mod.hk_paged_attention_decode(
        query.data_ptr(), query.stride(0), query.stride(1), key_cache.data_ptr(), value_cache.data_ptr(), sb, st, sh,
        block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(), out.data_ptr(),
        lse.data_ptr() if lse.numel() else None, part_o.data_ptr() if part_o is not None else None,
        part_ml.data_ptr() if part_ml is not None else None, num_seqs, num_q_heads, hkv, bs.bit_length() - 1,
        block_tables.shape[1], nb, 1 if plan.per_sequence else plan.num_partitions, plan.partition_size,
        plan.num_partitions if plan.per_sequence else 0, seq_parts.data_ptr() if seq_parts is not None else None,
        kernel_code, hpb, scale, dev, raw_stream(dev))
    if rc:
        mod.check(rc, "paged_attention_decode")


_NO_LSE: dict = {}


def _no_lse(device) -> torch.Tensor:
    """An empty float32 tensor on `device` standing for "no LSE" (the launcher's lse.numel() == 0), made once."""
    t = _NO_LSE.get(device)
    if t is None:
        t = _NO_LSE[device] = torch.empty(0, dtype=torch.float32, device=device)
    return t


# What a call launches, by what it depends on: the module, the shapes, the variant asked for, and what the lookup
# reads (the database's generation, HIPKERN_ARCH, the lookup function itself: the tuner pins candidates by
# replacing it). An eager call spent ~15 us of host time deriving it (H200 host, NOTES.md 2026-11-28 (13)).
_PLANS: dict = {}


def _launch_plan(dev, mod, query, head_size, bs, hkv, kv_layout, max_blocks, variant) -> tuple:
    """(kernel code, heads per block, Plan) of a call, memoised in _PLANS."""
    num_seqs, num_q_heads = query.shape[0], query.shape[1]
    key = (dev, mod, query.dtype, num_seqs, num_q_heads, head_size, bs, hkv, kv_layout, max_blocks, variant,
           _lookup, *choice_inputs())
    return memo(_PLANS, key, lambda: _derive_plan(dev, mod, query, head_size, bs, hkv, kv_layout, max_blocks, variant))


def _derive_plan(dev, mod, query, head_size, bs, hkv, kv_layout, max_blocks, variant) -> tuple:
    num_seqs, num_q_heads = query.shape[0], query.shape[1]
    params = {}
    max_tokens = max_blocks * bs
    if not variant:
        variant, params = _chosen(dev, query, head_size, bs, hkv, kv_layout, max_tokens)
    var = VARIANTS[variant]
    _check_runs(var, head_size, mod.wave_size())  # (validation checked a variant asked for; this, the module's)
    group = num_q_heads // hkv
    params = with_heads(var, params, num_seqs, num_q_heads, hkv, max_tokens, sm_count(dev))
    shape = make_shape(var, num_seqs, num_q_heads, hkv, max_tokens, sm_count(dev), mod.wave_size(),
                       resident_blocks(mod, var.kernel, heads_per_block(var, group, params), dev), params)
    return KERNELS[var.kernel].code, shape.heads_per_block, _plan(variant, shape, tuple(sorted(params.items())))


def _check_direct(query, key_cache, value_cache, block_tables, context_lens, scale, kv_layout, variant, out,
                  lse) -> str:
    """The registered op's arguments checked as the Python function checks them (its lse too); returns
    the variant with its alias mapped."""
    variant = ALIASES.get(variant, variant)
    _validate(query, key_cache, value_cache, block_tables, context_lens, scale, kv_layout, out, True, variant or None)
    _check_variant_runs(query, variant)
    if lse.numel():
        check_tensor("lse", lse, dtypes=(torch.float32,), shape=tuple(query.shape[:2]))
        check_device(query.device, lse=lse)
    return variant


def _checked_launch(query, key_cache, value_cache, block_tables, context_lens, scale, kv_layout, variant, out, lse):
    """torch.ops.hipkern.paged_attention_decode called directly (or from a compiled graph): its arguments
    are validated as the Python function validates them before it launches."""
    variant = _check_direct(query, key_cache, value_cache, block_tables, context_lens, scale, kv_layout, variant, out,
                            lse)
    _launch(query, key_cache, value_cache, block_tables, context_lens, scale, kv_layout, variant, out, lse)


impl_checked("paged_attention_decode", _checked_launch)


@torch.library.register_fake("hipkern::paged_attention_decode")
def _fake(query, key_cache, value_cache, block_tables, context_lens, scale, kv_layout, variant, out, lse):
    _check_direct(query, key_cache, value_cache, block_tables, context_lens, scale, kv_layout, variant, out, lse)
    return None


@functools.lru_cache(maxsize=4096)
def _plan(variant: str, shape: Shape, params: tuple) -> Plan:
    return plan_of(VARIANTS[variant], shape, dict(params))


# The default without a tuning-database row: v16 (fastest or within a few us of the best on every
# benchmark shape on the H100/H200, NOTES.md), except where it cannot run: head size 256 on CDNA.
HEURISTIC_VARIANT = "v16"


def heuristic_variant(head_size: int, arch: str) -> str:
    return HEURISTIC_VARIANT if kernel_runs(VARIANTS[HEURISTIC_VARIANT], head_size, jit.wave_size_of(arch)) else "v3"


def kernel_runs(variant: Variant, head_size: int, wave_size: int) -> bool:
    """Whether a variant's kernel runs this head size on GPUs of this wave size: the matrix-core kernel's
    K/V tiles of head size 256 do not fit CDNA's 64 KB of LDS (64-lane waves)."""
    return not (variant.kernel == "mma" and head_size == 256 and wave_size == 64)


def runs_here(variant: str, head_size: int) -> bool:
    """kernel_runs for a variant's name (or alias) on the arch the op builds for here (jit.current_arch())."""
    return kernel_runs(VARIANTS[ALIASES.get(variant, variant)], head_size, jit.wave_size_of(jit.current_arch()))


def choose_variant(query, key_cache, block_tables, kv_layout) -> tuple:
    """(variant, params) for variant=None: the tuning database's row for this shape (exact, else
    nearest), else the heuristic default (heuristic_variant) with its default parameters; v16 where the
    row's variant takes fewer sequences than the call has (what the op runs then)."""
    _, bs, hkv, d, *_ = _cache_dims(kv_layout, key_cache)
    return _chosen(query.get_device(), query, d, bs, hkv, kv_layout, block_tables.shape[1] * bs)


def _lookup(dev, query, head_size, block_size, num_kv_heads, kv_layout, max_tokens) -> tuple:
    arch = jit.current_arch(dev)
    choice = tuning_db.lookup(
        "paged_attention", arch, sm_count(dev), device_name=gpu_name(dev), dtype=DTYPE_NAMES[query.dtype],
        head_size=head_size, block_size=block_size, num_q_heads=query.shape[1], num_kv_heads=num_kv_heads,
        kv_layout=kv_layout, batch=tuning_db.bucket(query.shape[0]), context=tuning_db.bucket(max_tokens))
    return (choice.variant, choice.params) if choice else (heuristic_variant(head_size, arch), {})


def _chosen(dev, query, head_size, block_size, num_kv_heads, kv_layout, max_tokens) -> tuple:
    """_lookup's (variant, params), or v16's default where that variant takes fewer sequences than the call
    has (a nearest row's choice: v5 at most MAX_PER_SEQUENCE_SEQS)."""
    variant, params = _lookup(dev, query, head_size, block_size, num_kv_heads, kv_layout, max_tokens)
    return ("v16", {}) if query.shape[0] > VARIANTS[variant].max_seqs else (variant, params)


def paged_attention_decode(query, key_cache, value_cache, block_tables, context_lens, *, scale=None,
                           kv_layout="NHD", out=None, return_lse=False, variant=None):
    """Attention of one new query token per sequence over its paged KV cache.

    Args:
        query: [num_seqs, num_q_heads, head_size] float16/bfloat16 (head dim contiguous), head_size
            64, 128 or 256; 1 <= num_seqs <= 65535.
        key_cache, value_cache: same dtype, same shape and strides; "NHD": [num_blocks, block_size,
            num_kv_heads, head_size], "HND": [num_blocks, num_kv_heads, block_size, head_size]; block_size
            a power of two <= 1024; rows 16-byte aligned. Any number of blocks (offsets are 64-bit).
        block_tables: int32 [num_seqs, max_blocks_per_seq]: physical block of each logical block (blocks
            may be shared); max_blocks_per_seq * block_size <= 2^30 - 1. Tokens whose id lies outside
            [0, num_blocks) are masked: never read.
        context_lens: contiguous int32 [num_seqs]; 0 gives a zero output row and an LSE of -inf. Lengths are
            clamped to [0, max_blocks_per_seq * block_size].
        scale: softmax scale, default 1/sqrt(head_size).
        out: optional contiguous output [num_seqs, num_q_heads, head_size] (query's dtype), written in place.
        return_lse: also return the natural-log LSE of each (sequence, head), float32.
        variant: None (the tuning database's choice for this shape, else the heuristic default) or
            one of VARIANTS (with its default parameters), or a name of ALIASES (the variant it is).

    Returns out, or (out, lse). fp32 accumulation; num_q_heads / num_kv_heads from 1 to 64. No host
    sync and workspaces sized from shapes only: safe under CUDA-graph capture and torch.compile.
    """
    if variant is not None and not isinstance(variant, str):
        raise ValueError(f"variant must be None or a str, got {type(variant).__name__}")
    variant = ALIASES.get(variant, variant)
    scale, return_lse = as_float(scale), as_bool(return_lse)
    validated(_VALID, _validate, (query, key_cache, value_cache, block_tables, context_lens, out),
              (scale, kv_layout, return_lse, variant), query, key_cache, value_cache, block_tables, context_lens,
              scale, kv_layout, out, return_lse, variant)
    _check_variant_runs(query, variant)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    variant = variant or ""
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if torch.compiler.is_compiling():
        lse = torch.empty(query.shape[:2] if return_lse else (0,), dtype=torch.float32, device=query.device)
        torch.ops.hipkern.paged_attention_decode.default(query, key_cache, value_cache, block_tables, context_lens,
                                                         scale, kv_layout, variant, out, lse)
    else:
        lse = (torch.empty(query.shape[:2], dtype=torch.float32, device=query.device) if return_lse
               else _no_lse(query.device))
        _launch(query, key_cache, value_cache, block_tables, context_lens, scale, kv_layout, variant, out, lse)
    return (out, lse) if return_lse else out
