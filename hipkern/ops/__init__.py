"""Public ops. Each module validates its arguments, registers torch.ops.hipkern.<op>, and dispatches
to a JIT-built HIP module."""
from .topk_softmax import topk_softmax

__all__ = ["topk_softmax"]
