"""MoE sorting: ``moe_sorting(topk_ids, num_experts, block_m) -> (sorted_token_ids, expert_ids,
num_tokens_post_padded)``, the routed (token, slot) pairs grouped by expert in blocks of block_m."""
from __future__ import annotations

import torch

from ._common import (as_bool, as_int, check_aligned, check_bool, check_device, check_int, check_outputs_apart,
                      check_tensor, host_check, impl_checked, lib, module_for, on_device, plain_cuda, raw_stream)

__all__ = ["moe_sorting", "moe_sorting_max_padded", "MAX_EXPERTS", "MAX_BLOCK_M"]

MAX_EXPERTS = 1024
MAX_BLOCK_M = 1024
_INT32_MAX = 2**31 - 1
_HEADROOM = 4096  # margin under 2^31 for the kernels' int32 indices past the pairs (a chunk's steps, cursors)

lib.define("moe_sorting(Tensor topk_ids, int num_experts, int block_m, Tensor? expert_map=None) "
           "-> (Tensor, Tensor, Tensor)")
lib.define("moe_sorting_out(Tensor topk_ids, int num_experts, int block_m, Tensor? expert_map, "
           "Tensor(a!) sorted_token_ids, Tensor(b!) expert_ids, Tensor(c!) num_tokens_post_padded) -> ()")


_OUT_NAMES = ("out[0] (sorted_token_ids)", "out[1] (expert_ids)", "out[2] (num_tokens_post_padded)")


def moe_sorting_max_padded(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Length of sorted_token_ids: num_pairs + num_experts * (block_m - 1), rounded up to block_m.
    num_pairs is T * k (>= 0); num_experts and block_m as moe_sorting takes them."""
    num_pairs, num_experts, block_m = as_int(num_pairs), as_int(num_experts), as_int(block_m)
    check_int("num_pairs", num_pairs, 0, _INT32_MAX)
    check_int("num_experts", num_experts, 1, MAX_EXPERTS)
    check_int("block_m", block_m, 1, MAX_BLOCK_M)
    return _max_padded(num_pairs, num_experts, block_m)


def _max_padded(num_pairs, num_experts, block_m):  # unchecked: the op's own (possibly symbolic) sizes
    return (num_pairs + num_experts * (block_m - 1) + block_m - 1) // block_m * block_m


def _validate(topk_ids, num_experts, block_m, expert_map, out=None) -> None:
    # Fast path for the common valid call; anything else takes the checks below, which name the
    # offending argument.
    if (out is None and expert_map is None and plain_cuda(topk_ids)
            and topk_ids.dtype == torch.int32 and topk_ids.dim() == 2 and topk_ids.is_contiguous()
            and type(num_experts) is int and type(block_m) is int and 1 <= num_experts <= MAX_EXPERTS
            and 1 <= block_m <= MAX_BLOCK_M and topk_ids.numel() < 2**30):
        return
    # Device checks last, so that every other argument error shows on any device.
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32,), gpu=False)
    check_int("num_experts", num_experts, 1, MAX_EXPERTS)
    check_int("block_m", block_m, 1, MAX_BLOCK_M)
    if expert_map is not None:
        check_tensor("expert_map", expert_map, dtypes=(torch.int32,), shape=(num_experts,), gpu=False)
    num_pairs = topk_ids.shape[0] * topk_ids.shape[1]
    if num_pairs + num_experts * block_m + _HEADROOM > _INT32_MAX:
        raise ValueError(f"topk_ids has too many entries ({num_pairs}) for int32 indices with {num_experts} "
                         f"experts and block_m {block_m}")
    names = _OUT_NAMES
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            raise ValueError("out must be a triple (sorted_token_ids, expert_ids, num_tokens_post_padded)")
        max_padded = _max_padded(num_pairs, num_experts, block_m)
        for name, t, shape in zip(names, out, ((max_padded,), (max_padded // block_m,), (1,))):
            check_tensor(name, t, dtypes=(torch.int32,), shape=shape, gpu=False)
    check_tensor("topk_ids", topk_ids)
    others = {} if expert_map is None else {"expert_map": expert_map}
    if out is not None:
        others.update(zip(names, out))
    check_device(topk_ids.device, **others)


@host_check
def _check_values(topk_ids, num_experts, expert_map, num_local=None, local_bound="num_experts",
                  bound="num_experts") -> None:
    """validate=True: ids in [0, E), and expert_map's values -1 or a local index in [0, num_local) (num_local
    defaults to E: the local experts are some of the E), at the cost of a device sync. `bound` and `local_bound`
    say what E and num_local are, in the caller's arguments."""
    if topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"topk_ids must lie in [0, {num_experts}) ({bound}), found values in [{lo}, {hi}]")
    if expert_map is None or not expert_map.numel():
        return
    num_local = num_experts if num_local is None else num_local
    lo, hi = int(expert_map.min()), int(expert_map.max())
    if lo < -1 or hi >= num_local:
        raise ValueError(f"expert_map values must be -1 (remote) or a local expert index in [0, {num_local}) "
                         f"({local_bound}), found values in [{lo}, {hi}]")


def _outputs(topk_ids, num_experts, block_m):
    dev = topk_ids.device
    max_padded = _max_padded(topk_ids.shape[0] * topk_ids.shape[1], num_experts, block_m)
    return (torch.empty((max_padded,), dtype=torch.int32, device=dev),
            torch.empty((max_padded // block_m,), dtype=torch.int32, device=dev),
            torch.empty((1,), dtype=torch.int32, device=dev))


def _launch_here(topk_ids, num_experts, block_m, expert_map, sorted_ids, expert_ids, num_post) -> None:
    dev = topk_ids.get_device()
    num_pairs = topk_ids.numel()
    mod = module_for("moe_sorting", dev)
    ws_len = mod.hk_moe_sorting_workspace(num_pairs, num_experts)
    ws = torch.empty((ws_len,), dtype=torch.int32, device=topk_ids.device) if ws_len else None
    emap = None if expert_map is None else expert_map.data_ptr()
    rc = mod.hk_moe_sorting(topk_ids.data_ptr(), emap, sorted_ids.data_ptr(), expert_ids.data_ptr(),
                            num_post.data_ptr(), None if ws is None else ws.data_ptr(), ws_len, num_pairs,
                            num_experts, block_m, sorted_ids.numel(), dev, raw_stream(dev))
    if rc:
        mod.check(rc, "moe_sorting")


def _run(topk_ids, num_experts, block_m, expert_map, sorted_ids, expert_ids, num_post) -> None:
    outs = dict(zip(_OUT_NAMES, (sorted_ids, expert_ids, num_post)))
    check_aligned(topk_ids=topk_ids, expert_map=expert_map, **outs)
    on_device(topk_ids.get_device(), _launch_here, topk_ids, num_experts, block_m, expert_map, sorted_ids,
              expert_ids, num_post)


def _launch(topk_ids, num_experts, block_m, expert_map, sorted_ids, expert_ids, num_post) -> None:
    """The caller's outputs (out=): the multi-block path re-reads the ids (and the map) while other blocks
    write the outputs, so an overlap would change the ranking under way (cursors past their segments).
    Addresses only: at launch, never while tracing."""
    ins = {"topk_ids": topk_ids} if expert_map is None else {"topk_ids": topk_ids, "expert_map": expert_map}
    check_outputs_apart(dict(zip(_OUT_NAMES, (sorted_ids, expert_ids, num_post))), **ins)
    _run(topk_ids, num_experts, block_m, expert_map, sorted_ids, expert_ids, num_post)


def _gpu_impl(topk_ids, num_experts, block_m, expert_map=None):
    outs = _outputs(topk_ids, num_experts, block_m)
    _run(topk_ids, num_experts, block_m, expert_map, *outs)
    return outs


@torch.library.register_fake("hipkern::moe_sorting")
def _fake(topk_ids, num_experts, block_m, expert_map=None):
    _validate(topk_ids, num_experts, block_m, expert_map)
    return _outputs(topk_ids, num_experts, block_m)


@torch.library.register_fake("hipkern::moe_sorting_out")
def _fake_out(topk_ids, num_experts, block_m, expert_map, sorted_ids, expert_ids, num_post):
    _validate(topk_ids, num_experts, block_m, expert_map, (sorted_ids, expert_ids, num_post))


# The registered implementations validate too: torch.ops.hipkern.* called directly (or from a compiled
# graph) gets the Python function's checks before any launch.
def _checked_impl(topk_ids, num_experts, block_m, expert_map=None):
    _validate(topk_ids, num_experts, block_m, expert_map)
    return _gpu_impl(topk_ids, num_experts, block_m, expert_map)


def _checked_out(topk_ids, num_experts, block_m, expert_map, sorted_ids, expert_ids, num_post):
    _fake_out(topk_ids, num_experts, block_m, expert_map, sorted_ids, expert_ids, num_post)  # the checks of trace time
    _launch(topk_ids, num_experts, block_m, expert_map, sorted_ids, expert_ids, num_post)


impl_checked("moe_sorting", _checked_impl)
impl_checked("moe_sorting_out", _checked_out)


def moe_sorting(topk_ids: torch.Tensor, num_experts: int, block_m: int, *, expert_map: torch.Tensor | None = None,
                validate: bool = False, out=None):
    """Group the routed (token, slot) pairs by expert, each expert's run padded to block_m rows.

    Pair p = t * k + j is token t's j-th choice, topk_ids[t, j]. The pairs of expert 0 come first,
    then those of expert 1, ...; within an expert in increasing p (deterministic); each expert's run
    is padded with the sentinel num_pairs = T * k to a multiple of `block_m` (experts without pairs
    take no rows). Output sizes depend on shapes only (no host sync: CUDA-graph capturable).

    Args:
        topk_ids: int32 [T, k] contiguous on the GPU (T may be 0).
        num_experts: E, 1 <= E <= 1024.
        block_m: rows per block of the expert GEMM, 1 <= block_m <= 1024.
        expert_map: optional int32 [E] on the same device: for expert parallelism, the local index of
            each expert, -1 for experts on other GPUs, whose pairs are dropped (any other negative value
            is dropped too, but rejected by `validate`). expert_ids carries the values as they are.
        validate: check that every id lies in [0, E) and expert_map's values in [-1, E), raising
            ValueError otherwise. This syncs with the device; without it such ids give undefined
            (but in-bounds) output: the kernels never read or write out of bounds for any id.
        out: optional (sorted_token_ids, expert_ids, num_tokens_post_padded), int32 tensors of the
            shapes below, contiguous on the same device, written in place (every element).

    Returns:
        sorted_token_ids: int32 [max_padded], max_padded = T*k + E*(block_m - 1) rounded up to
            block_m (hipkern.moe_sorting_max_padded): the pair indices by expert; the padding and the
            unused tail hold the sentinel T*k.
        expert_ids: int32 [max_padded // block_m], the expert of each block of block_m rows
            (expert_map[e] when expert_map is given), -1 for the unused trailing blocks.
        num_tokens_post_padded: int32 [1], the rows in use (a multiple of block_m).
        (`out` itself when given.)
    """
    num_experts, block_m, validate = as_int(num_experts), as_int(block_m), as_bool(validate)
    check_bool("validate", validate)
    _validate(topk_ids, num_experts, block_m, expert_map, out)
    if validate:
        _check_values(topk_ids, num_experts, expert_map)
    if torch.compiler.is_compiling():  # traced: the registered ops (eager skips the dispatcher)
        if out is None:
            return torch.ops.hipkern.moe_sorting.default(topk_ids, num_experts, block_m, expert_map)
        torch.ops.hipkern.moe_sorting_out.default(topk_ids, num_experts, block_m, expert_map, *out)
        return tuple(out)
    if out is None:
        return _gpu_impl(topk_ids, num_experts, block_m, expert_map)
    _launch(topk_ids, num_experts, block_m, expert_map, *out)
    return tuple(out)
