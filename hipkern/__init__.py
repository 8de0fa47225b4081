"""hipkern: ROCm-first GPU kernels for LLM inference, written in HIP, also built for NVIDIA GPUs.

    import hipkern
    weights, ids = hipkern.topk_softmax(router_logits, topk=8)

Kernels are JIT-built for the current GPU on first use and cached (see hipkern.jit).
"""
from .ops.fused_moe import fused_moe
from .ops.grouped_topk import grouped_topk
from .ops.moe_sorting import moe_sorting, moe_sorting_max_padded
from .ops.paged_attention import paged_attention_decode
from .ops.topk_softmax import topk_softmax

__version__ = "0.1.0"
__all__ = ["fused_moe", "grouped_topk", "moe_sorting", "moe_sorting_max_padded", "paged_attention_decode",
           "topk_softmax", "__version__"]
