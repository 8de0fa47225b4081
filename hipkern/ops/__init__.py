"""Public ops. Each module validates its arguments, registers torch.ops.hipkern.<op>, and dispatches
to a JIT-built HIP module."""
from .fused_moe import fused_moe
from .grouped_topk import grouped_topk
from .moe_sorting import moe_sorting, moe_sorting_max_padded
from .paged_attention import paged_attention_decode
from .topk_softmax import topk_softmax

__all__ = ["fused_moe", "grouped_topk", "moe_sorting", "moe_sorting_max_padded", "paged_attention_decode",
           "topk_softmax"]
