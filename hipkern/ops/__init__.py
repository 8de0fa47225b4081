"""The ops' modules. Each validates its op's arguments, registers torch.ops.hipkern.<op>, and dispatches to a
JIT-built HIP module. The ops themselves are hipkern's (hipkern.fused_moe, ...); their modules here hold each op's
limits and helpers (hipkern.ops.fused_moe.DECODE_MAX_PAIRS, hipkern.ops.fused_moe.choose_config, ...)."""
from . import fused_moe, grouped_topk, moe_sorting, paged_attention, topk_softmax

__all__ = ["fused_moe", "grouped_topk", "moe_sorting", "paged_attention", "topk_softmax"]
