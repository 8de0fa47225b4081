"""Plain-torch references (the "naive" of the benchmark tables), computed in float32 or wider."""
from __future__ import annotations

import torch

__all__ = ["topk_softmax_ref"]


def topk_softmax_ref(gating_logits: torch.Tensor, topk: int, renormalize: bool = True):
    """float32 softmax, then a stable descending sort (ties: lower expert index first)."""
    probs = torch.softmax(gating_logits.float(), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :topk], ids[:, :topk].to(torch.int32)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
