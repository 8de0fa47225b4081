"""MoE router: ``topk_softmax(gating_logits, topk, renormalize=True) -> (weights, ids)``."""
from __future__ import annotations

import torch

from ._common import (DTYPE_NAMES, as_bool, as_int, check_aligned, check_bool, check_device, check_int,
                      check_routing_apart, check_routing_out, check_tensor, impl_checked, lib, module_for, on_device,
                      plain_cuda, raw_stream)

__all__ = ["topk_softmax", "MAX_EXPERTS", "MAX_TOPK"]

MAX_EXPERTS = 512
MAX_TOPK = 16

lib.define("topk_softmax(Tensor gating_logits, int topk, bool renormalize=True) -> (Tensor, Tensor)")
lib.define("topk_softmax_out(Tensor gating_logits, int topk, bool renormalize, Tensor(a!) weights, "
           "Tensor(b!) ids) -> ()")


_DTYPES = frozenset(DTYPE_NAMES)


def _validate(gating_logits, topk, renormalize, out=None) -> None:
    # Fast path for the common valid call; anything else takes the checks below, which name the
    # offending argument.
    if (out is None and plain_cuda(gating_logits)
            and gating_logits.dtype in _DTYPES and gating_logits.dim() == 2 and type(topk) is int
            and type(renormalize) is bool and 1 <= topk <= MAX_TOPK and topk <= gating_logits.shape[1] <= MAX_EXPERTS
            and gating_logits.is_contiguous()):
        return
    # Device last, so that every other argument error shows on any device.
    check_tensor("gating_logits", gating_logits, ndim=2, dtypes=tuple(DTYPE_NAMES), gpu=False)
    num_tokens, num_experts = gating_logits.shape
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"gating_logits must have 1..{MAX_EXPERTS} experts (columns), got {num_experts}")
    check_int("topk", topk, 1, min(MAX_TOPK, num_experts),
              f" (at most {MAX_TOPK} and at most the number of experts, {num_experts})")
    check_bool("renormalize", renormalize)
    outs = check_routing_out(out, num_tokens, topk)
    check_tensor("gating_logits", gating_logits)
    if outs:
        check_device(gating_logits.device, **outs)


def _outputs(gating_logits, topk):
    n = gating_logits.shape[0]
    dev = gating_logits.device
    return (torch.empty((n, topk), dtype=torch.float32, device=dev),
            torch.empty((n, topk), dtype=torch.int32, device=dev))


def _launch(gating_logits, topk, renormalize, weights, ids) -> None:
    check_aligned(gating_logits=gating_logits, weights=weights, ids=ids)
    if gating_logits.shape[0]:
        on_device(gating_logits.get_device(), _launch_here, gating_logits, topk, renormalize, weights, ids)


def _launch_here(gating_logits, topk, renormalize, weights, ids) -> None:
    num_tokens, num_experts = gating_logits.shape
    dev = gating_logits.get_device()
    mod = module_for("topk_softmax", dev, dtype=DTYPE_NAMES[gating_logits.dtype])
    rc = mod.hk_topk_softmax(gating_logits.data_ptr(), weights.data_ptr(), ids.data_ptr(), num_tokens,
                             num_experts, topk, int(renormalize), dev, raw_stream(dev))
    if rc:
        mod.check(rc, "topk_softmax")


def _gpu_impl(gating_logits, topk, renormalize=True):
    weights, ids = _outputs(gating_logits, topk)
    _launch(gating_logits, topk, renormalize, weights, ids)
    return weights, ids


def _launch_out(gating_logits, topk, renormalize, weights, ids) -> None:
    """The caller's outputs: each must be apart from the logits and from the other (addresses: at launch)."""
    check_routing_apart(weights, ids, gating_logits=gating_logits)
    _launch(gating_logits, topk, renormalize, weights, ids)


@torch.library.register_fake("hipkern::topk_softmax")
def _fake(gating_logits, topk, renormalize=True):
    _validate(gating_logits, topk, renormalize)
    return _outputs(gating_logits, topk)


@torch.library.register_fake("hipkern::topk_softmax_out")
def _fake_out(gating_logits, topk, renormalize, weights, ids):
    _validate(gating_logits, topk, renormalize, (weights, ids))


# The registered implementations validate too: torch.ops.hipkern.* called directly (or from a compiled
# graph) gets the Python function's checks before any launch.
def _checked_impl(gating_logits, topk, renormalize=True):
    _validate(gating_logits, topk, renormalize)
    return _gpu_impl(gating_logits, topk, renormalize)


def _checked_out(gating_logits, topk, renormalize, weights, ids):
    _fake_out(gating_logits, topk, renormalize, weights, ids)  # the checks of trace time
    _launch_out(gating_logits, topk, renormalize, weights, ids)


impl_checked("topk_softmax", _checked_impl)
impl_checked("topk_softmax_out", _checked_out)


def topk_softmax(gating_logits: torch.Tensor, topk: int, renormalize: bool = True, *, out=None):
    """Route tokens to experts: softmax over each row of `gating_logits`, then its `topk` largest.

    Args:
        gating_logits: [num_tokens, num_experts] float32, float16 or bfloat16, contiguous, on the GPU;
            1 <= num_experts <= 512.
        topk: experts per token, 1 <= topk <= min(16, num_experts).
        renormalize: scale each token's weights to sum to 1 (else they are the softmax probabilities).
        out: optional (weights float32, ids int32), each [num_tokens, topk] contiguous on the same
            device, written in place (for preallocated buffers and CUDA graphs).

    Returns:
        (weights float32 [num_tokens, topk], ids int32 [num_tokens, topk]), best expert first (`out`
        itself when given). The experts are ranked by logit, larger first, and of equal logits the
        lower expert index first: the order of float32 softmax then a stable descending sort, except
        where distinct logits round to the same float32 probability (both underflow to 0, say), which
        keep their logits' order. num_tokens == 0 gives empty tensors. Logits must be
        finite or -inf with a finite row maximum; NaN gives unspecified (but in-range) ids.
    """
    topk, renormalize = as_int(topk), as_bool(renormalize)
    _validate(gating_logits, topk, renormalize, out)
    if torch.compiler.is_compiling():  # traced: the registered ops (eager skips the dispatcher)
        if out is None:
            return torch.ops.hipkern.topk_softmax.default(gating_logits, topk, renormalize)
        torch.ops.hipkern.topk_softmax_out.default(gating_logits, topk, renormalize, out[0], out[1])
        return out[0], out[1]
    if out is None:
        return _gpu_impl(gating_logits, topk, renormalize)
    _launch_out(gating_logits, topk, renormalize, out[0], out[1])
    return out[0], out[1]
