"""MoE router: ``topk_softmax(gating_logits, topk, renormalize=True) -> (weights, ids)``."""
from __future__ import annotations

import torch

from ._common import DTYPE_NAMES, check_int, check_tensor, lib, module_for, raw_stream

__all__ = ["topk_softmax", "MAX_EXPERTS", "MAX_TOPK"]

MAX_EXPERTS = 512
MAX_TOPK = 16

lib.define("topk_softmax(Tensor gating_logits, int topk, bool renormalize=True) -> (Tensor, Tensor)")


def _validate(gating_logits, topk, renormalize) -> None:
    check_tensor("gating_logits", gating_logits, ndim=2, dtypes=tuple(DTYPE_NAMES))
    num_experts = gating_logits.shape[1]
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"gating_logits must have 1..{MAX_EXPERTS} experts (columns), got {num_experts}")
    check_int("topk", topk, 1, min(MAX_TOPK, num_experts), f" (at most {MAX_TOPK} and at most the "
              f"number of experts, {num_experts})")
    if not isinstance(renormalize, bool):
        raise ValueError(f"renormalize must be a bool, got {type(renormalize).__name__}")


def _outputs(gating_logits, topk):
    n = gating_logits.shape[0]
    dev = gating_logits.device
    return (torch.empty((n, topk), dtype=torch.float32, device=dev),
            torch.empty((n, topk), dtype=torch.int32, device=dev))


def _gpu_impl(gating_logits, topk, renormalize=True):
    weights, ids = _outputs(gating_logits, topk)
    num_tokens, num_experts = gating_logits.shape
    if num_tokens:
        dev = gating_logits.device.index
        mod = module_for("topk_softmax", dev, dtype=DTYPE_NAMES[gating_logits.dtype])
        rc = mod.hk_topk_softmax(gating_logits.data_ptr(), weights.data_ptr(), ids.data_ptr(), num_tokens,
                                 num_experts, topk, int(renormalize), dev, raw_stream(dev))
        if rc:
            mod.check(rc, "topk_softmax")
    return weights, ids


lib.impl("topk_softmax", _gpu_impl, "CUDA")


@torch.library.register_fake("hipkern::topk_softmax")
def _fake(gating_logits, topk, renormalize=True):
    _validate(gating_logits, topk, renormalize)
    return _outputs(gating_logits, topk)


def topk_softmax(gating_logits: torch.Tensor, topk: int, renormalize: bool = True):
    """Route tokens to experts: softmax over each row of `gating_logits`, then its `topk` largest.

    Args:
        gating_logits: [num_tokens, num_experts] float32, float16 or bfloat16, contiguous, on the GPU;
            1 <= num_experts <= 512.
        topk: experts per token, 1 <= topk <= min(16, num_experts).
        renormalize: scale each token's weights to sum to 1 (else they are the softmax probabilities).

    Returns:
        (weights float32 [num_tokens, topk], ids int32 [num_tokens, topk]), best expert first.
        Equal to float32 softmax then a stable descending sort: of equal logits the lower expert index
        comes first. num_tokens == 0 gives empty tensors. NaN logits give unspecified (but in-range) ids.
    """
    _validate(gating_logits, topk, renormalize)
    return torch.ops.hipkern.topk_softmax.default(gating_logits, topk, renormalize)
