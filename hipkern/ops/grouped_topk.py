"""MoE router of DeepSeek-V3: ``grouped_topk(gating_logits, correction_bias, topk, num_expert_group,
topk_group) -> (weights, ids)``."""
from __future__ import annotations

import torch

from ._common import (DTYPE_NAMES, as_bool, as_float, as_int, check_aligned, check_bool, check_device, check_int,
                      check_routing_apart, check_routing_out, check_tensor, impl_checked, is_float32, lib, module_for,
                      on_device, plain_cuda, raw_stream)

__all__ = ["grouped_topk", "GROUP_SCORINGS", "MAX_EXPERTS", "MAX_TOPK", "MAX_GROUPS", "SCORINGS"]

MAX_EXPERTS = 512
MAX_TOPK = 16
MAX_GROUPS = 64
SCORINGS = {"sigmoid": 0, "softmax": 1}  # name -> the kernel's code
# A group's score: the sum of its two largest b (DeepSeek-V3; vLLM with a correction bias), or its largest
# b (DeepSeek-V2's group-limited routing; vLLM and aiter's grouped_topk without a bias).
GROUP_SCORINGS = {"top2": 0, "max": 1}
_DTYPES = frozenset(DTYPE_NAMES)

lib.define("grouped_topk(Tensor gating_logits, Tensor? correction_bias, int topk, int num_expert_group, "
           "int topk_group, str scoring='sigmoid', bool renormalize=True, float routed_scaling_factor=1.0, "
           "str group_scoring='top2') -> (Tensor, Tensor)")
lib.define("grouped_topk_out(Tensor gating_logits, Tensor? correction_bias, int topk, int num_expert_group, "
           "int topk_group, str scoring, bool renormalize, float routed_scaling_factor, str group_scoring, "
           "Tensor(a!) weights, Tensor(b!) ids) -> ()")


def _validate(gating_logits, correction_bias, topk, num_expert_group, topk_group, scoring, renormalize,
              routed_scaling_factor, group_scoring="top2", out=None) -> None:
    # Fast path for the common valid call; anything else takes the checks below, which name the
    # offending argument.
    if (out is None and plain_cuda(gating_logits) and gating_logits.dim() == 2
            and gating_logits.dtype in _DTYPES and gating_logits.is_contiguous()
            and type(topk) is int and type(num_expert_group) is int and type(topk_group) is int
            and 1 <= num_expert_group <= MAX_GROUPS and 1 <= topk_group <= num_expert_group
            and type(scoring) is str and scoring in SCORINGS and type(renormalize) is bool
            and type(routed_scaling_factor) is float and is_float32(routed_scaling_factor)
            and type(group_scoring) is str and group_scoring in GROUP_SCORINGS):
        num_experts = gating_logits.shape[1]
        if (num_experts <= MAX_EXPERTS and num_experts % num_expert_group == 0
                and 1 <= topk <= min(MAX_TOPK, topk_group * (num_experts // num_expert_group))
                and (correction_bias is None or (plain_cuda(correction_bias)
                                                 and correction_bias.dtype == torch.float32
                                                 and correction_bias.shape == (num_experts,)
                                                 and correction_bias.is_contiguous()
                                                 and correction_bias.device == gating_logits.device))):
            return
    # Device checks last, so that every other argument error shows on any device.
    check_tensor("gating_logits", gating_logits, ndim=2, dtypes=tuple(DTYPE_NAMES), gpu=False)
    num_tokens, num_experts = gating_logits.shape
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"gating_logits must have 1..{MAX_EXPERTS} experts (columns), got {num_experts}")
    if correction_bias is not None:
        check_tensor("correction_bias", correction_bias, dtypes=(torch.float32,), shape=(num_experts,), gpu=False)
    check_int("num_expert_group", num_expert_group, 1, min(MAX_GROUPS, num_experts),
              f" (at most {MAX_GROUPS} and at most the number of experts, {num_experts})")
    if num_experts % num_expert_group:
        raise ValueError(f"num_expert_group must divide the number of experts ({num_experts}), "
                         f"got {num_expert_group}")
    check_int("topk_group", topk_group, 1, num_expert_group, " (at most num_expert_group)")
    kept = topk_group * (num_experts // num_expert_group)
    check_int("topk", topk, 1, min(MAX_TOPK, kept),
              f" (at most {MAX_TOPK} and at most the experts of the kept groups, {kept})")
    if not isinstance(scoring, str) or scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {', '.join(map(repr, SCORINGS))}, got {scoring!r}")
    check_bool("renormalize", renormalize)
    if not is_float32(routed_scaling_factor):
        raise ValueError(f"routed_scaling_factor must be a float finite in float32 (the kernel's type), got "
                         f"{routed_scaling_factor!r}")
    if not isinstance(group_scoring, str) or group_scoring not in GROUP_SCORINGS:
        raise ValueError(f"group_scoring must be one of {', '.join(map(repr, GROUP_SCORINGS))}, got {group_scoring!r}")
    outs = check_routing_out(out, num_tokens, topk)
    check_tensor("gating_logits", gating_logits)
    others = {} if correction_bias is None else {"correction_bias": correction_bias}
    check_device(gating_logits.device, **others, **outs)


def _outputs(gating_logits, topk):
    n = gating_logits.shape[0]
    dev = gating_logits.device
    return (torch.empty((n, topk), dtype=torch.float32, device=dev),
            torch.empty((n, topk), dtype=torch.int32, device=dev))


def _launch(gating_logits, correction_bias, topk, num_expert_group, topk_group, scoring, renormalize,
            routed_scaling_factor, group_scoring, weights, ids) -> None:
    check_aligned(gating_logits=gating_logits, correction_bias=correction_bias, weights=weights, ids=ids)
    if gating_logits.shape[0]:
        on_device(gating_logits.get_device(), _launch_here, gating_logits, correction_bias, topk, num_expert_group,
                  topk_group, scoring, renormalize, routed_scaling_factor, group_scoring, weights, ids)


def _launch_here(gating_logits, correction_bias, topk, num_expert_group, topk_group, scoring, renormalize,
                 routed_scaling_factor, group_scoring, weights, ids) -> None:
    num_tokens, num_experts = gating_logits.shape
    dev = gating_logits.get_device()
    mod = module_for("grouped_topk", dev, dtype=DTYPE_NAMES[gating_logits.dtype])
    bias = None if correction_bias is None else correction_bias.data_ptr()
    rc = mod.hk_grouped_topk(gating_logits.data_ptr(), bias, weights.data_ptr(), ids.data_ptr(), num_tokens,
                             num_experts, topk, num_expert_group, topk_group, SCORINGS[scoring],
                             GROUP_SCORINGS[group_scoring], int(renormalize), float(routed_scaling_factor), dev,
                             raw_stream(dev))
    if rc:
        mod.check(rc, "grouped_topk")


def _gpu_impl(gating_logits, correction_bias, topk, num_expert_group, topk_group, scoring="sigmoid",
              renormalize=True, routed_scaling_factor=1.0, group_scoring="top2"):
    weights, ids = _outputs(gating_logits, topk)
    _launch(gating_logits, correction_bias, topk, num_expert_group, topk_group, scoring, renormalize,
            routed_scaling_factor, group_scoring, weights, ids)
    return weights, ids


def _launch_out(gating_logits, correction_bias, topk, num_expert_group, topk_group, scoring, renormalize,
                routed_scaling_factor, group_scoring, weights, ids) -> None:
    """The caller's outputs: each must be apart from the inputs and from the other (addresses: at launch)."""
    ins = {"gating_logits": gating_logits}
    if correction_bias is not None:
        ins["correction_bias"] = correction_bias
    check_routing_apart(weights, ids, **ins)
    _launch(gating_logits, correction_bias, topk, num_expert_group, topk_group, scoring, renormalize,
            routed_scaling_factor, group_scoring, weights, ids)


@torch.library.register_fake("hipkern::grouped_topk")
def _fake(gating_logits, correction_bias, topk, num_expert_group, topk_group, scoring="sigmoid", renormalize=True,
          routed_scaling_factor=1.0, group_scoring="top2"):
    _validate(gating_logits, correction_bias, topk, num_expert_group, topk_group, scoring, renormalize,
              routed_scaling_factor, group_scoring)
    return _outputs(gating_logits, topk)


@torch.library.register_fake("hipkern::grouped_topk_out")
def _fake_out(gating_logits, correction_bias, topk, num_expert_group, topk_group, scoring, renormalize,
              routed_scaling_factor, group_scoring, weights, ids):
    _validate(gating_logits, correction_bias, topk, num_expert_group, topk_group, scoring, renormalize,
              routed_scaling_factor, group_scoring, (weights, ids))


# The registered implementations validate too: torch.ops.hipkern.* called directly (or from a compiled
# graph) gets the Python function's checks before any launch.
# (The dispatcher leaves out trailing arguments equal to their defaults: hence the full signatures.)
def _checked_impl(gating_logits, correction_bias, topk, num_expert_group, topk_group, scoring="sigmoid",
                  renormalize=True, routed_scaling_factor=1.0, group_scoring="top2"):
    args = (gating_logits, correction_bias, topk, num_expert_group, topk_group, scoring, renormalize,
            routed_scaling_factor, group_scoring)
    _validate(*args)
    return _gpu_impl(*args)


def _checked_out(gating_logits, correction_bias, topk, num_expert_group, topk_group, scoring, renormalize,
                 routed_scaling_factor, group_scoring, weights, ids):
    args = (gating_logits, correction_bias, topk, num_expert_group, topk_group, scoring, renormalize,
            routed_scaling_factor, group_scoring)
    _fake_out(*args, weights, ids)  # the checks of trace time
    _launch_out(*args, weights, ids)


impl_checked("grouped_topk", _checked_impl)
impl_checked("grouped_topk_out", _checked_out)


def grouped_topk(gating_logits: torch.Tensor, correction_bias: torch.Tensor | None, topk: int, num_expert_group: int,
                 topk_group: int, *, scoring: str = "sigmoid", renormalize: bool = True,
                 routed_scaling_factor: float = 1.0, group_scoring: str = "top2", out=None):
    """Route tokens to experts as DeepSeek-V3 does: top-k inside the best groups of experts.

    Per token: scores s = sigmoid(logits) (or softmax over the row, scoring="softmax"), in float32;
    selection scores b = s + correction_bias (b = s without a bias). The experts form
    `num_expert_group` groups of consecutive experts; a group's score is the sum of its two largest
    b (its only b when groups have one expert), or with group_scoring="max" its largest b; the
    `topk_group` best groups are kept, and the
    `topk` largest b among their experts are chosen. Weights are the chosen experts' s (not b),
    divided by their sum if `renormalize`, then multiplied by `routed_scaling_factor`.

    Ties are broken deterministically: of equal group scores the lower group index is kept, of
    equal b the lower expert index is chosen (and listed) first.

    Args:
        gating_logits: [num_tokens, num_experts] float32, float16 or bfloat16, contiguous, on the GPU;
            1 <= num_experts <= 512.
        correction_bias: float32 [num_experts] on the same device, or None.
        topk: experts per token, 1 <= topk <= min(16, topk_group * experts per group).
        num_expert_group: groups, dividing num_experts, at most 64.
        topk_group: groups kept per token, 1 <= topk_group <= num_expert_group.
        scoring: "sigmoid" (DeepSeek-V3) or "softmax".
        renormalize: scale each token's weights to sum to 1 before `routed_scaling_factor`.
        routed_scaling_factor: finite float multiplying every weight.
        group_scoring: "top2" (DeepSeek-V3; vLLM with a correction bias) or "max" (DeepSeek-V2's
            group-limited routing; what vLLM's and aiter's grouped_topk do without a bias).
        out: optional (weights float32, ids int32), each [num_tokens, topk] contiguous on the same
            device, written in place (for preallocated buffers and CUDA graphs).

    Returns:
        (weights float32 [num_tokens, topk], ids int32 [num_tokens, topk]) in order of decreasing b
        (`out` itself when given). num_tokens == 0 gives empty tensors. Logits must not be NaN (NaN
        gives unspecified, but in-range, ids); with renormalize, a token whose chosen scores are all
        0 in float32 (logits of -inf, or finite ones whose float32 score underflows: sigmoid logits below
        about -88, softmax logits some 100 or more below the row's largest) gets NaN weights.
    """
    topk, num_expert_group, topk_group = as_int(topk), as_int(num_expert_group), as_int(topk_group)
    routed_scaling_factor, renormalize = as_float(routed_scaling_factor), as_bool(renormalize)
    _validate(gating_logits, correction_bias, topk, num_expert_group, topk_group, scoring, renormalize,
              routed_scaling_factor, group_scoring, out)
    args = (gating_logits, correction_bias, topk, num_expert_group, topk_group, scoring, renormalize,
            float(routed_scaling_factor), group_scoring)
    if torch.compiler.is_compiling():  # traced: the registered ops (eager skips the dispatcher)
        if out is None:
            return torch.ops.hipkern.grouped_topk.default(*args)
        torch.ops.hipkern.grouped_topk_out.default(*args, out[0], out[1])
        return out[0], out[1]
    if out is None:
        return _gpu_impl(*args)
    _launch_out(*args, out[0], out[1])
    return out[0], out[1]
