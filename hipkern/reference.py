"""Plain-torch references (the "naive" of the benchmark tables), computed in float32 or wider."""
from __future__ import annotations

import torch

__all__ = ["topk_softmax_ref", "paged_attention_ref"]


def topk_softmax_ref(gating_logits: torch.Tensor, topk: int, renormalize: bool = True):
    """float32 softmax, then a stable descending sort (ties: lower expert index first)."""
    probs = torch.softmax(gating_logits.float(), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :topk], ids[:, :topk].to(torch.int32)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def paged_attention_ref(query, key_cache, value_cache, block_tables, context_lens, scale=None, kv_layout="NHD",
                        compute_dtype=torch.float32):
    """Per-sequence loop: gather each sequence's K/V from its blocks, attend in `compute_dtype`
    (softmax and LSE in float32). Returns (out [S, Hq, D] in compute_dtype, lse float32 [S, Hq])."""
    import math

    if kv_layout == "HND":
        key_cache, value_cache = key_cache.transpose(1, 2), value_cache.transpose(1, 2)
    num_seqs, num_q_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_q_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_size) if scale is None else scale
    out = torch.zeros(num_seqs, num_q_heads, head_size, dtype=compute_dtype, device=query.device)
    lse = torch.full((num_seqs, num_q_heads), -math.inf, dtype=torch.float32, device=query.device)
    for s, n in enumerate(context_lens.tolist()):
        if n <= 0:
            continue
        blocks = block_tables[s, : (n + block_size - 1) // block_size].long()
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_size)[:n].to(compute_dtype)
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_size)[:n].to(compute_dtype)
        q = query[s].to(compute_dtype).view(num_kv_heads, group, head_size)
        scores = torch.einsum("hgd,nhd->hgn", q, k).float() * scale
        lse[s] = torch.logsumexp(scores, dim=-1).reshape(num_q_heads)
        probs = torch.softmax(scores, dim=-1).to(compute_dtype)
        out[s] = torch.einsum("hgn,nhd->hgd", probs, v).reshape(num_q_heads, head_size)
    return out, lse
