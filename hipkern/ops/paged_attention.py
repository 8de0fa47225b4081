"""Paged-attention decode: ``paged_attention_decode(query, key_cache, value_cache, block_tables,
context_lens, *, scale=None, kv_layout="NHD", out=None, return_lse=False, variant=None)``.

Variants are policies over two kernels (csrc_hip/paged_attention/): "simt" (CUDA cores, lane-per-
token QK^T, up to 8 query heads per block) and "mma" (matrix cores, the whole GQA group per block,
K/V pipelined through shared memory); a variant picks a kernel and how the context is split across
the grid. Every variant built so far accepts every input the op accepts.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import math

import torch

from .. import jit, tuning_db
from ._common import DTYPE_NAMES, check_device, check_tensor, lib, module_for, on_device, raw_stream

__all__ = ["paged_attention_decode", "VARIANTS", "HEAD_SIZES", "KV_LAYOUTS", "MAX_GQA"]

HEAD_SIZES = (64, 128, 256)
KV_LAYOUTS = ("NHD", "HND")  # [blocks, block_size, kv_heads, D] / [blocks, kv_heads, block_size, D]
MAX_GQA = 64
MAX_TOKENS = 2**30 - 1  # per block-table row: keeps the kernel's 32-bit token sums below 2^31
MAX_PARTITIONS = 65535  # grid z
DTYPES = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class Kernel:
    code: int  # the module's `kernel` argument
    tile: callable  # wave size -> tokens a block takes per step (partitions are whole tiles)
    heads_per_block: callable  # GQA group -> query heads per block


KERNELS = {
    "simt": Kernel(0, lambda wave: 4 * wave, lambda group: min(8, 1 << (group - 1).bit_length())),  # decode_simt.h
    "mma": Kernel(1, lambda wave: 64, lambda group: min(64, max(16, 1 << (group - 1).bit_length()))),  # decode_mma.h
}


@dataclasses.dataclass(frozen=True)
class Plan:
    num_partitions: int
    partition_size: int  # tokens


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    idea: str
    plan: callable  # (Shape, **params) -> Plan; params: partition_size (the largest partition)
    kernel: str = "simt"  # a key of KERNELS


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

    @property
    def blocks(self) -> int:  # thread blocks of one partition
        return self.num_seqs * self.num_kv_heads * math.ceil(self.group / self.heads_per_block)


def make_shape(variant: Variant, num_seqs, num_q_heads, num_kv_heads, max_tokens, sm_count, wave_size,
               resident=1) -> Shape:
    """The launch geometry `variant`'s plan sees (for the op, the tuner and the benchmark)."""
    kernel = KERNELS[variant.kernel]
    group = num_q_heads // num_kv_heads
    return Shape(num_seqs, num_kv_heads, group, max_tokens, sm_count, kernel.tile(wave_size),
                 kernel.heads_per_block(group), resident)


def resident_for(dtype: str, head_size: int, variant: str, group: int, device: int) -> int:
    """resident_blocks of `variant`'s kernel for a shape (builds/loads its module)."""
    var = VARIANTS[variant]
    mod = module_for("paged_attention", device, dtype=dtype, head_size=head_size)
    return resident_blocks(mod, var.kernel, KERNELS[var.kernel].heads_per_block(group), device)


@functools.lru_cache(maxsize=None)
def resident_blocks(mod, kernel: str, heads_per_block: int, device: int) -> int:
    """Blocks of one kernel instantiation an SM holds at once on `device` (the module asks the runtime)."""
    n = ctypes.c_int(0)
    rc = mod.hk_paged_attention_resident_blocks(KERNELS[kernel].code, heads_per_block, device, ctypes.addressof(n))
    if rc:
        mod.check(rc, "paged_attention_decode (occupancy)")
    return max(1, n.value)


def _split(shape: Shape, partition_size: int) -> Plan:
    parts = max(1, math.ceil(shape.max_tokens / partition_size))
    if parts > MAX_PARTITIONS:  # larger partitions, whole tiles, within the grid
        partition_size = math.ceil(shape.max_tokens / MAX_PARTITIONS / shape.tile) * shape.tile
        parts = math.ceil(shape.max_tokens / partition_size)
    return Plan(1, shape.max_tokens) if parts == 1 else Plan(parts, partition_size)


def _plan_hybrid(shape: Shape, partition_size: int = 512, blocks_per_sm: int = 4) -> Plan:
    """v3: split each context into partitions of whole block tiles, at most `partition_size` tokens
    each (512: the best fixed size measured on the H100), and smaller when the batch alone gives fewer
    than ~`blocks_per_sm` blocks per SM; one pass when a single partition covers the context."""
    want = max(math.ceil(blocks_per_sm * shape.sm_count / shape.blocks), math.ceil(shape.max_tokens / partition_size))
    return _split(shape, math.ceil(shape.max_tokens / want / shape.tile) * shape.tile)


def _plan_balanced(shape: Shape, partition_size: int = 0, block_cost: int = 64, merge_cost: int = 192) -> Plan:
    """v16: partitions of `partition_size` tokens if given; else the count that minimises a cost in
    token-steps: waves of blocks over the SMs' slots (sm_count x resident) x (tokens per partition +
    `block_cost`), plus `merge_cost` when split (the merge launch). One pass when nothing is gained."""
    if partition_size:
        return _split(shape, partition_size)
    tiles = math.ceil(shape.max_tokens / shape.tile)
    slots = shape.sm_count * shape.resident
    most = min(tiles, MAX_PARTITIONS, max(1, math.ceil(2 * slots / shape.blocks)))
    best = None
    for parts in range(1, most + 1):
        size = math.ceil(tiles / parts) * shape.tile
        cost = math.ceil(shape.blocks * parts / slots) * (size + block_cost) + (merge_cost if parts > 1 else 0)
        if best is None or cost < best[0]:
            best = (cost, size)
    return _split(shape, best[1])


VARIANTS = {
    "v3": Variant("v3", "hybrid split-K: flash-decoding partitions of <= 512 tokens, smaller for small "
                  "batches (~4 blocks per SM), merged by LSE; a single pass when one covers the context",
                  _plan_hybrid),
    "v9": Variant("v9", "multi-warp GQA block over fixed partitions, 512 tokens by default (always split-K)",
                  lambda shape, partition_size=512: _split(shape, partition_size)),
    "v16": Variant("v16", "matrix cores: the whole GQA group (16-row tiles) against K/V tiles of 64 tokens "
                   "pipelined through shared memory; partitions from a cost model of the SMs' slots "
                   "(_plan_balanced)", _plan_balanced, kernel="mma"),
}

# Tuning-database schema (hipkern/tuning_db.py): the batch and context buckets are powers of two;
# the context bucket is what the block table addresses (max_blocks_per_seq * block_size), known
# without reading context_lens from the GPU.
tuning_db.register(tuning_db.Schema(
    op="paged_attention",
    exact_keys=("dtype", "head_size", "block_size", "num_q_heads", "num_kv_heads", "kv_layout"),
    bucket_keys=("batch", "context"),
    param_keys=("partition_size",),
    variants=frozenset(VARIANTS),
    param_ranges={"partition_size": (1, MAX_TOKENS)}))
PLANNED = ("v4", "v5", "v6", "v7")  # named by the design, not built yet


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _cache_dims(kv_layout, cache):
    if kv_layout == "NHD":
        nb, bs, hkv, d = cache.shape
        return nb, bs, hkv, d, cache.stride(0), cache.stride(1), cache.stride(2)
    nb, hkv, bs, d = cache.shape
    return nb, bs, hkv, d, cache.stride(0), cache.stride(2), cache.stride(1)


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
    if value_cache.shape != key_cache.shape or value_cache.stride() != key_cache.stride():
        raise ValueError(f"value_cache must have the shape and strides of key_cache, got "
                         f"{tuple(value_cache.shape)}/{value_cache.stride()} vs {tuple(key_cache.shape)}/{key_cache.stride()}")
    num_seqs, num_q_heads, head_size = query.shape
    nb, bs, hkv, d, sb, st, sh = _cache_dims(kv_layout, key_cache)
    if head_size not in HEAD_SIZES:
        raise ValueError(f"query head size must be one of {HEAD_SIZES}, got {head_size}")
    if d != head_size:
        raise ValueError(f"key_cache head size {d} (layout {kv_layout}) differs from query's {head_size}")
    if bs < 1 or bs & (bs - 1) or bs > 1024:
        raise ValueError(f"key_cache block size must be a power of two up to 1024 (layout {kv_layout}), got {bs}")
    if hkv < 1 or num_q_heads % hkv:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of key_cache's KV heads ({hkv}, "
                         f"layout {kv_layout})")
    if num_q_heads // hkv > MAX_GQA:
        raise ValueError(f"GQA ratio query heads / KV heads must be at most {MAX_GQA}, got {num_q_heads // hkv}")
    if sb % 8 or st % 8 or sh % 8:
        raise ValueError(f"key_cache/value_cache rows must be 16-byte aligned: strides must be multiples of 8 "
                         f"elements, got {key_cache.stride()}")
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,), contiguous=False, gpu=False)
    if block_tables.shape[0] != num_seqs or block_tables.stride(-1) != 1 or block_tables.shape[1] < 1:
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
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)):
        raise ValueError(f"scale must be a finite float or None, got {scale!r}")
    if not isinstance(return_lse, bool):
        raise ValueError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if variant is not None and variant not in VARIANTS:
        planned = f" ({variant} is designed but not built yet)" if variant in PLANNED else ""
        raise ValueError(f"variant must be None or one of {sorted(VARIANTS)}, got {variant!r}{planned}")
    if out is not None:
        check_tensor("out", out, dtypes=(query.dtype,), shape=tuple(query.shape), gpu=False)
    dev = query.device
    tensors = {"query": query, "key_cache": key_cache, "value_cache": value_cache, "block_tables": block_tables,
               "context_lens": context_lens}
    if out is not None:
        tensors["out"] = out
    check_tensor("query", query, contiguous=False)
    check_device(dev, **tensors)


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
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if c.data_ptr() % 16:  # here, not in _validate: data pointers do not exist while tracing
            raise ValueError(f"{name} must start at a 16-byte aligned address")
    dev = query.get_device()
    mod = module_for("paged_attention", dev, dtype=DTYPE_NAMES[query.dtype], head_size=head_size)
    params = {}
    if not variant:
        variant, params = _lookup(dev, query, head_size, bs, hkv, kv_layout, block_tables.shape[1] * bs)
    var = VARIANTS[variant]
    kernel = KERNELS[var.kernel]
    if var.kernel == "mma" and head_size == 256 and mod.wave_size() == 64:
        raise ValueError(f"variant {variant} supports head sizes 64 and 128 on this GPU (CDNA: its K/V tiles of head "
                         f"size 256 do not fit 64 KB of LDS); got head size 256: use variant v3 or v9")
    group = num_q_heads // hkv
    shape = make_shape(var, num_seqs, num_q_heads, hkv, block_tables.shape[1] * bs, _sm_count(dev), mod.wave_size(),
                       resident_blocks(mod, var.kernel, kernel.heads_per_block(group), dev))
    plan = _plan(variant, shape, tuple(sorted(params.items())))
    part_o = part_ml = None
    if plan.num_partitions > 1:  # sized from shapes only: capturable in a CUDA graph
        part_o = torch.empty((num_seqs, num_q_heads, plan.num_partitions, head_size), dtype=torch.float32,
                             device=query.device)
        part_ml = torch.empty((num_seqs, num_q_heads, plan.num_partitions, 2), dtype=torch.float32,
                              device=query.device)
    rc = mod.hk_paged_attention_decode(
        query.data_ptr(), query.stride(0), query.stride(1), key_cache.data_ptr(), value_cache.data_ptr(), sb, st, sh,
        block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(), out.data_ptr(),
        lse.data_ptr() if lse.numel() else None, part_o.data_ptr() if part_o is not None else None,
        part_ml.data_ptr() if part_ml is not None else None, num_seqs, num_q_heads, hkv, bs.bit_length() - 1,
        block_tables.shape[1], nb, plan.num_partitions, plan.partition_size, kernel.code, shape.heads_per_block,
        scale, dev, raw_stream(dev))
    if rc:
        mod.check(rc, "paged_attention_decode")


lib.impl("paged_attention_decode", _launch, "CUDA")


@torch.library.register_fake("hipkern::paged_attention_decode")
def _fake(query, key_cache, value_cache, block_tables, context_lens, scale, kv_layout, variant, out, lse):
    return None


@functools.lru_cache(maxsize=4096)
def _plan(variant: str, shape: Shape, params: tuple) -> Plan:
    return VARIANTS[variant].plan(shape, **dict(params))


# The default without a tuning-database row: v16 (fastest or within a few us of the best on every
# benchmark shape on the H100/H200, NOTES.md), except where it cannot run: head size 256 on CDNA.
HEURISTIC_VARIANT = "v16"


def heuristic_variant(head_size: int, arch: str) -> str:
    return "v3" if head_size == 256 and arch.startswith("gfx") else HEURISTIC_VARIANT


def choose_variant(query, key_cache, block_tables, kv_layout) -> tuple:
    """(variant, params) for variant=None: the tuning database's row for this shape (exact, else
    nearest), else the heuristic default (heuristic_variant) with its default parameters."""
    _, bs, hkv, d, *_ = _cache_dims(kv_layout, key_cache)
    return _lookup(query.get_device(), query, d, bs, hkv, kv_layout, block_tables.shape[1] * bs)


def _lookup(dev, query, head_size, block_size, num_kv_heads, kv_layout, max_tokens) -> tuple:
    arch = jit.current_arch(dev)
    choice = tuning_db.lookup(
        "paged_attention", arch, _sm_count(dev), dtype=DTYPE_NAMES[query.dtype],
        head_size=head_size, block_size=block_size, num_q_heads=query.shape[1], num_kv_heads=num_kv_heads,
        kv_layout=kv_layout, batch=tuning_db.bucket(query.shape[0]), context=tuning_db.bucket(max_tokens))
    return (choice.variant, choice.params) if choice else (heuristic_variant(head_size, arch), {})


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
        context_lens: int32 [num_seqs]; 0 gives a zero output row and an LSE of -inf. Lengths are
            clamped to [0, max_blocks_per_seq * block_size].
        scale: softmax scale, default 1/sqrt(head_size).
        out: optional output [num_seqs, num_q_heads, head_size] (query's dtype), written in place.
        return_lse: also return the natural-log LSE of each (sequence, head), float32.
        variant: None (the tuning database's choice for this shape, else the heuristic default) or
            one of VARIANTS (with its default parameters).

    Returns out, or (out, lse). fp32 accumulation; num_q_heads / num_kv_heads from 1 to 64. No host
    sync and workspaces sized from shapes only: safe under CUDA-graph capture and torch.compile.
    """
    _validate(query, key_cache, value_cache, block_tables, context_lens, scale, kv_layout, out, return_lse,
              variant)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    variant = variant or ""
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    lse = torch.empty(query.shape[:2] if return_lse else (0,), dtype=torch.float32, device=query.device)
    if torch.compiler.is_compiling():
        torch.ops.hipkern.paged_attention_decode.default(query, key_cache, value_cache, block_tables, context_lens,
                                                         scale, kv_layout, variant, out, lse)
    else:
        _launch(query, key_cache, value_cache, block_tables, context_lens, scale, kv_layout, variant, out, lse)
    return (out, lse) if return_lse else out
