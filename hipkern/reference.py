"""Plain-torch references (the "naive" of the benchmark tables), computed in float32 or wider."""
from __future__ import annotations

import torch

__all__ = ["topk_softmax_ref", "paged_attention_ref", "grouped_topk_scores_ref", "grouped_topk_ref",
           "moe_sorting_ref", "fused_moe_ref"]


def topk_softmax_ref(gating_logits: torch.Tensor, topk: int, renormalize: bool = True):
    """float32 softmax; the experts ranked by logit, larger first (a stable sort: of equal logits the lower
    index first), as the op documents: the softmax's order, except that distinct logits whose probabilities
    round to the same float32 value (both underflow to 0, say) keep their logits' order."""
    logits = gating_logits.float()
    probs = torch.softmax(logits, dim=-1)
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :topk]
    weights, ids = probs.gather(-1, ids), ids.to(torch.int32)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def paged_attention_ref(query, key_cache, value_cache, block_tables, context_lens, scale=None, kv_layout="NHD",
                        compute_dtype=torch.float32):
    """Per-sequence loop: gather each sequence's K/V from its blocks, attend in `compute_dtype`
    (softmax and LSE in float32). Returns (out [S, Hq, D] in compute_dtype, lse float32 [S, Hq]).
    As the op documents bad metadata: a length is clamped to [0, what the block-table row addresses],
    and a token whose block id lies outside [0, num_blocks) is left out (masked); a sequence with no
    token left gets a zero row and an LSE of -inf."""
    import math

    if kv_layout == "HND":
        key_cache, value_cache = key_cache.transpose(1, 2), value_cache.transpose(1, 2)
    num_seqs, num_q_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    group = num_q_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_size) if scale is None else scale
    out = torch.zeros(num_seqs, num_q_heads, head_size, dtype=compute_dtype, device=query.device)
    lse = torch.full((num_seqs, num_q_heads), -math.inf, dtype=torch.float32, device=query.device)
    most = block_tables.shape[1] * block_size
    for s, n in enumerate(context_lens.tolist()):
        t = torch.arange(max(0, min(n, most)), device=query.device)
        blocks = block_tables[s, t // block_size].long()
        keep = (blocks >= 0) & (blocks < num_blocks)
        t, blocks = t[keep], blocks[keep]
        if t.numel() == 0:
            continue
        k = key_cache[blocks, t % block_size].to(compute_dtype)  # [tokens, KV heads, D]
        v = value_cache[blocks, t % block_size].to(compute_dtype)
        q = query[s].to(compute_dtype).view(num_kv_heads, group, head_size)
        scores = torch.einsum("hgd,nhd->hgn", q, k).float() * scale
        lse[s] = torch.logsumexp(scores, dim=-1).reshape(num_q_heads)
        probs = torch.softmax(scores, dim=-1).to(compute_dtype)
        out[s] = torch.einsum("hgn,nhd->hgd", probs, v).reshape(num_q_heads, head_size)
    return out, lse


def grouped_topk_scores_ref(gating_logits, correction_bias, num_expert_group, scoring="sigmoid",
                            dtype=torch.float64, group_scoring="top2"):
    """The scores grouped_topk ranks, in `dtype`: (s [T, E] unbiased, b [T, E] = s + bias,
    group_scores [T, G] = the sum of each group's two largest b, or its only b; with group_scoring "max"
    each group's largest b)."""
    x = gating_logits.to(dtype)
    s = torch.sigmoid(x) if scoring == "sigmoid" else torch.softmax(x, dim=-1)
    b = s if correction_bias is None else s + correction_bias.to(dtype)
    t, e = b.shape
    per_group = e // num_expert_group
    groups = b.view(t, num_expert_group, per_group)
    if group_scoring == "max":
        return s, b, groups.amax(dim=-1)
    return s, b, groups.topk(min(2, per_group), dim=-1).values.sum(dim=-1)


def grouped_topk_ref(gating_logits, correction_bias, topk, num_expert_group, topk_group, scoring="sigmoid",
                     renormalize=True, routed_scaling_factor=1.0, dtype=torch.float64, group_scoring="top2"):
    """DeepSeek-V3 routing in `dtype`: keep the topk_group groups of largest group score, then the topk
    largest b among their experts (stable descending sorts: ties go to the lower index); weights are
    the chosen s, renormalised, times routed_scaling_factor (groups scored as grouped_topk_scores_ref's
    group_scoring). Returns (weights float32, ids int32)."""
    s, b, group_scores = grouped_topk_scores_ref(gating_logits, correction_bias, num_expert_group, scoring, dtype,
                                                 group_scoring)
    t, e = b.shape
    kept = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :topk_group]
    group_mask = torch.zeros(t, num_expert_group, dtype=torch.bool, device=b.device).scatter_(1, kept, True)
    expert_mask = group_mask.repeat_interleave(e // num_expert_group, dim=1)
    # the kept groups' experts first, each part by b (a kept expert of b = -inf still before every dropped one)
    order = torch.sort(b, dim=-1, descending=True, stable=True).indices
    kept_first = torch.sort(expert_mask.gather(1, order).to(torch.int8), dim=-1, descending=True, stable=True).indices
    ids = order.gather(1, kept_first)[:, :topk]
    weights = s.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights * routed_scaling_factor
    return weights.float(), ids.to(torch.int32)


def moe_sorting_ref(topk_ids, num_experts, block_m, expert_map=None):
    """Per-expert loop over the flattened ids (pair p = t * k + j): each expert's pairs in increasing p,
    padded with the sentinel T*k to a multiple of block_m; pairs with ids outside [0, E) or remote
    experts (expert_map < 0) dropped. Returns (sorted_token_ids, expert_ids, num_tokens_post_padded),
    int32, on the device of topk_ids."""
    flat = topk_ids.reshape(-1).long().cpu()
    n = flat.numel()
    max_padded = (n + num_experts * (block_m - 1) + block_m - 1) // block_m * block_m
    sorted_ids = torch.full((max_padded,), n, dtype=torch.int32)
    expert_ids = torch.full((max_padded // block_m,), -1, dtype=torch.int32)
    emap = None if expert_map is None else expert_map.cpu().tolist()
    pos = 0
    for e in range(num_experts):
        if emap is not None and emap[e] < 0:
            continue
        pairs = (flat == e).nonzero().flatten()
        if pairs.numel() == 0:
            continue
        sorted_ids[pos:pos + pairs.numel()] = pairs.to(torch.int32)
        rows = (pairs.numel() + block_m - 1) // block_m * block_m
        expert_ids[pos // block_m:(pos + rows) // block_m] = e if emap is None else emap[e]
        pos += rows
    dev = topk_ids.device
    return sorted_ids.to(dev), expert_ids.to(dev), torch.tensor([pos], dtype=torch.int32, device=dev)


def _moe_activation(name: str):
    import torch.nn.functional as F

    if name == "silu":
        return F.silu
    if name == "gelu":
        return F.gelu  # exact (erf) gelu, torch's default
    raise ValueError(f"activation must be 'silu' or 'gelu', got {name!r}")


def fused_moe_ref(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu", expert_map=None,
                  compute_dtype=torch.float64, intermediate_dtype=None):
    """Per-expert torch loop over the experts that received tokens: out[t] = sum_j topk_weights[t, j] *
    w2[e] @ (act(w1[e, :I] @ x_t) * (w1[e, I:] @ x_t)), e = topk_ids[t, j] (mapped through expert_map,
    whose -1 entries mark remote experts: their pairs contribute nothing). A pair whose id lies outside
    [0, E_global), or whose expert is not one of w1's, is dropped too (the op leaves such ids undefined
    without validate; its kernels drop them).

    hidden_states [T, D]; w1 [E_local, 2I, D] (gate rows, then up rows); w2 [E_local, D, I];
    topk_weights [T, k]; topk_ids [T, k] indexing E_global (expert_map's length, else E_local).
    Both products in `compute_dtype`; `intermediate_dtype` (when given) rounds act(gate) * up to it
    and back before the second product, as a bf16/fp16 kernel does. Duplicate ids in a row each add
    their own term. Returns [T, D] in compute_dtype (float64: the tests' reference; the input dtype:
    the benchmark's naive loop). Syncs with the device (one .tolist() and one nonzero per expert).
    """
    act = _moe_activation(activation)
    num_tokens, model_dim = hidden_states.shape
    inter_dim = w1.shape[1] // 2
    k = topk_ids.shape[1] if topk_ids.dim() == 2 else 1
    out = torch.zeros(num_tokens, model_dim, dtype=compute_dtype, device=hidden_states.device)
    if num_tokens == 0 or k == 0:
        return out
    local = topk_ids.reshape(-1).long()
    if expert_map is not None:  # ids outside [0, len(expert_map)) are dropped (-1), never wrapped to its end
        emap = expert_map.to(local.device).long()
        inside = (local >= 0) & (local < emap.numel())
        local = torch.where(inside, emap[local.clamp(0, emap.numel() - 1)], -1)
    # a pair whose expert (after the map) is not one of w1's is dropped, as the kernels drop it
    local = torch.where((local >= 0) & (local < w1.shape[0]), local, -1)
    weights = topk_weights.reshape(-1)
    for e in torch.unique(local).tolist():
        if e < 0:  # remote expert
            continue
        pairs = (local == e).nonzero().flatten()  # pair p = t * k + j
        tokens = pairs // k
        x = hidden_states[tokens].to(compute_dtype)
        gate_up = x @ w1[e].to(compute_dtype).t()
        h = act(gate_up[:, :inter_dim]) * gate_up[:, inter_dim:]
        if intermediate_dtype is not None:
            h = h.to(intermediate_dtype).to(compute_dtype)
        y = h @ w2[e].to(compute_dtype).t()
        out.index_add_(0, tokens, y * weights[pairs].to(compute_dtype)[:, None])
    return out
