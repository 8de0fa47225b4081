"""Host time of eager calls: ``python3 -m hipkern.bench.host_time`` times 2000 calls of each op (after 50 warm-up
calls) without a sync between them and prints microseconds a call of host time (the loop) and of wall time (to the
sync after it). The benchmark's events see none of it, and a CUDA-graph replay costs none; an eager decode loop
pays it on every call. Small shapes, so the kernels take less than the host; SDPA as a reference."""
from __future__ import annotations

import time


def per_call(fn, n: int = 2000, warmup: int = 50) -> tuple:
    """(host, wall) microseconds a call of `fn` over `n` calls after `warmup`: the loop alone, and to the sync."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6, (time.perf_counter() - t0) / n * 1e6


def cases() -> dict:
    import torch
    import torch.nn.functional as F
    import hipkern
    from hipkern.bench.paged_attention import make_inputs

    def moe(t, d, i, e, k, skew=False):
        g = torch.Generator(device="cuda").manual_seed(t)
        x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, generator=g)
        w1 = torch.randn(e, 2 * i, d, device="cuda", dtype=torch.bfloat16, generator=g) * d ** -0.5
        w2 = torch.randn(e, d, i, device="cuda", dtype=torch.bfloat16, generator=g) * i ** -0.5
        tw, ids = hipkern.topk_softmax(torch.randn(t, e, device="cuda", generator=g), k)
        if skew:
            ids = torch.arange(k, device="cuda", dtype=torch.int32).repeat(t, 1)
        out = torch.empty_like(x)
        return lambda: hipkern.fused_moe(x, w1, w2, tw, ids, out=out)

    q, k, v, bt, cl = make_inputs([256] * 8, 64, 8, 128)
    out = torch.empty_like(q)
    q1, k1, v1, bt1, cl1 = make_inputs([256], 64, 1, 256)
    qs, ks = q[:, :, None], torch.randn(8, 8, 256, 128, device="cuda", dtype=torch.bfloat16)
    return {
        "paged_attention 8 x 256, 64 q / 8 kv x 128": lambda: hipkern.paged_attention_decode(q, k, v, bt, cl, out=out),
        "paged_attention 1 x 256, 64 q / 1 kv x 256": lambda: hipkern.paged_attention_decode(q1, k1, v1, bt1, cl1),
        "SDPA 8 x 256 x 8 kv, contiguous (reference)": lambda: F.scaled_dot_product_attention(qs, ks, ks,
                                                                                              enable_gqa=True),
        "fused_moe DeepSeek-like 1 token (D 7168)": moe(1, 7168, 256, 256, 8),
        "fused_moe DeepSeek-like 4 tokens, skewed": moe(4, 7168, 256, 256, 8, skew=True),
        "fused_moe D 256 I 128 E 64, 20 x 8 pairs": moe(20, 256, 128, 64, 8),
        "fused_moe D 256 I 128 E 64, 64 x 8 pairs": moe(64, 256, 128, 64, 8),
    }


def main() -> int:
    print(f"{'call':46s} {'host us':>8s} {'wall us':>8s}")
    for name, fn in cases().items():
        host, wall = per_call(fn)
        print(f"{name:46s} {host:8.1f} {wall:8.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
