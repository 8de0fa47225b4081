"""Module specs: what each JIT module is built from. Data only; the builder reads it.

A spec names its sources (relative to the csrc root), the preprocessor defines that pick its one
instantiation, and the C functions it exports with their ctypes signatures. Every module also gets
``common/module_api.hip`` (error reporting, ABI version). An op asks for ``spec(name, **params)``.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ._paths import csrc_root

__all__ = ["ModuleSpec", "spec", "all_specs", "MODULE_FAMILIES"]

# C types of launcher arguments, by short name (mapped to ctypes by the builder).
#   ptr: device pointer or stream (void*), i32: int, i64: int64_t.


@dataclasses.dataclass(frozen=True)
class ModuleSpec:
    name: str  # unique per instantiation, e.g. "topk_softmax_bfloat16"
    sources: tuple  # relative to root
    defines: tuple = ()  # ((NAME, value), ...)
    functions: tuple = ()  # ((c_name, restype, (argtypes...)), ...)
    root: Path = dataclasses.field(default_factory=csrc_root)

    @property
    def include_dir(self) -> Path:
        return self.root / "include"


# dtype name -> hk::DType value (csrc_hip/include/hipkern/dtype.h)
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}

MODULE_FAMILIES = {
    "topk_softmax": {
        "params": {"dtype": tuple(DTYPE_CODES)},
        "sources": ("topk_softmax/topk_softmax.hip",),
        "defines": lambda dtype: (("HK_DTYPE", DTYPE_CODES[dtype]),),
        "functions": (
            # logits, weights, ids, num_tokens, num_experts, topk, renormalize, device, stream
            ("hk_topk_softmax", "i32", ("ptr", "ptr", "ptr", "i64", "i32", "i32", "i32", "i32", "ptr")),
        ),
    },
    "paged_attention": {
        "params": {"dtype": ("float16", "bfloat16"), "head_size": (64, 128, 256)},
        "sources": ("paged_attention/paged_attention.hip",),  # + common.h, decode_simt.h, decode_mma.h
        "defines": lambda dtype, head_size: (("HK_DTYPE", DTYPE_CODES[dtype]), ("HK_HEAD_SIZE", head_size)),
        "functions": (
            # q, q_stride_s, q_stride_h, k, v, kv_stride_block, kv_stride_tok, kv_stride_head,
            # block_tables, bt_stride, context_lens, out, lse, part_o, part_ml, num_seqs, num_q_heads,
            # num_kv_heads, block_size_log2, max_blocks_per_seq, num_blocks, num_partitions,
            # partition_size, split_target, seq_parts, kernel, heads_per_block, scale, device, stream
            ("hk_paged_attention_decode", "i32",
             ("ptr", "i64", "i64", "ptr", "ptr", "i64", "i64", "i64", "ptr", "i64", "ptr", "ptr", "ptr", "ptr",
              "ptr", "i32", "i32", "i32", "i32", "i32", "i32", "i32", "i32", "i32", "ptr", "i32", "i32", "f32",
              "i32", "ptr")),
            # kernel, heads_per_block, device, int* blocks (out): resident blocks per SM/CU
            ("hk_paged_attention_resident_blocks", "i32", ("i32", "i32", "i32", "ptr")),
            # kernel, heads_per_block, num_partitions, blocks, device, int* out: 1 when that uniform split
            # merges inside thread-block clusters (sm_90), 0 through partials and the merge kernel
            ("hk_paged_attention_cluster_merge", "i32", ("i32", "i32", "i32", "i64", "i32", "ptr")),
        ),
    },
    "grouped_topk": {
        "params": {"dtype": tuple(DTYPE_CODES)},
        "sources": ("grouped_topk/grouped_topk.hip",),
        "defines": lambda dtype: (("HK_DTYPE", DTYPE_CODES[dtype]),),
        "functions": (
            # logits, bias, weights, ids, num_tokens, num_experts, topk, num_groups, topk_group, scoring,
            # group_scoring, renormalize, scale, device, stream
            ("hk_grouped_topk", "i32",
             ("ptr", "ptr", "ptr", "ptr", "i64", "i32", "i32", "i32", "i32", "i32", "i32", "i32", "f32", "i32",
              "ptr")),
        ),
    },
    "stream_read": {  # the benchmarks' read floor (hipkern.bench.floor.read_floor_us)
        "params": {},
        "sources": ("stream_read/stream_read.hip",),
        "defines": lambda: (),
        "functions": (
            # src, bytes, uint32* sink [grid], grid (the number of tiles of unroll x 4 KB), unroll, device, stream
            ("hk_stream_read", "i32", ("ptr", "i64", "ptr", "i64", "i32", "i32", "ptr")),
        ),
    },
    "moe_sorting": {
        "params": {},
        "sources": ("moe_sorting/moe_sorting.hip",),
        "defines": lambda: (),
        "functions": (
            # num_pairs, num_experts -> int32 elements of workspace
            ("hk_moe_sorting_workspace", "i64", ("i32", "i32")),
            # ids, expert_map, sorted, expert_ids, num_post, workspace, workspace_len, num_pairs,
            # num_experts, block_m, max_padded, device, stream
            ("hk_moe_sorting", "i32",
             ("ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "i64", "i32", "i32", "i32", "i32", "i32", "ptr")),
        ),
    },
    "fused_moe": {
        "params": {"dtype": tuple(DTYPE_CODES), "block_m": (8, 16, 32, 64, 128)},
        "sources": ("fused_moe/fused_moe.hip",),  # + gemm.h, math.h
        "valid": lambda dtype, block_m: dtype != "float32" or block_m <= 64,  # fp32 accumulators: 2 x block_m
        "defines": lambda dtype, block_m: (("HK_DTYPE", DTYPE_CODES[dtype]), ("HK_BLOCK_M", block_m)),
        "functions": (
            # device, int64* partial_floats, int64* counter_ints (out)
            ("hk_fused_moe_workspace", "i32", ("i32", "ptr", "ptr")),
            # device, bytes, stream, void** (out): zeroed memory outside torch's allocator (module_api.hip)
            ("hk_alloc_zeroed", "i32", ("i32", "i64", "ptr", "ptr")),
            # device, routed, int32* out [9] (out): grid, columns per item, cluster pairs of the 3 GEMMs, as
            # launched with sorting outputs (routed 0) or routing in their blocks (1) (tests)
            ("hk_fused_moe_gemms", "i32", ("i32", "i32", "ptr")),
            # device: the most pairs whose grouped GEMMs route in their own blocks there (0: none)
            ("hk_fused_moe_route_pairs", "i32", ("i32",)),
            # num_tokens, topk, dim, inter_dim, variant, int64* bytes (out): the size of hk_fused_moe's inter
            ("hk_fused_moe_inter_bytes", "i32", ("i32", "i32", "i32", "i32", "i32", "ptr")),
            # x, w1, w2, topk_weights, topk_ids, expert_map, sorted_ids, expert_ids, num_post, inter, y,
            # partials, counters, out, num_tokens, topk, num_experts, num_local_experts, dim, inter_dim,
            # max_padded, activation, variant, device, stream
            ("hk_fused_moe", "i32",
             ("ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "ptr",
              "i32", "i32", "i32", "i32", "i32", "i32", "i32", "i32", "i32", "i32", "ptr")),
        ),
    },
}


def spec(family: str, **params) -> ModuleSpec:
    fam = MODULE_FAMILIES[family]
    if set(params) != set(fam["params"]):
        raise ValueError(f"module {family} takes parameters {sorted(fam['params'])}, got {sorted(params)}")
    for k, v in params.items():
        if v not in fam["params"][k]:
            raise ValueError(f"module {family}: {k}={v!r} is not one of {fam['params'][k]}")
    if not fam.get("valid", lambda **_: True)(**params):
        raise ValueError(f"module {family} has no instantiation {params}")
    suffix = "".join(f"_{params[k]}" for k in fam["params"])
    return ModuleSpec(name=family + suffix, sources=fam["sources"], defines=fam["defines"](**params),
                      functions=fam["functions"])


def all_specs() -> list[ModuleSpec]:
    """Every instantiation of every family (what `python -m hipkern.build` prebuilds)."""
    out = []
    for family, fam in MODULE_FAMILIES.items():
        keys = list(fam["params"])
        combos = [{}]
        for k in keys:
            combos = [dict(c, **{k: v}) for c in combos for v in fam["params"][k]]
        valid = fam.get("valid", lambda **_: True)
        out += [spec(family, **c) for c in combos if valid(**c)]
    return out
