"""What the paged_attention_decode tests share: tolerances, random cases, the checked call, the variants this
GPU runs, edge lengths and the strided inputs serving engines pass."""
import math

import pytest
import torch

import hipkern
from hipkern.ops.paged_attention import VARIANTS, choose_variant, runs_here
from hipkern.reference import paged_attention_ref
from hipkern.testing import checkAllclose, poison, poison_next_alloc, rows_scaled



# Output: fp32 accumulation rounded once to the output dtype (half an ulp: 2^-9 bf16, 2^-12 fp16), and
# softmax weights rounded to the dtype for the PV product on matrix cores. atol is scaled by each row's
# largest |reference| where that is under 1 (check_out, hipkern.testing.rows_scaled): random outputs
# shrink like 1/sqrt(length), ~0.004 at 131072 tokens, where a fixed 8e-3 would pass wrong blocks.
TOL = {torch.bfloat16: dict(atol=8e-3, rtol=8e-3), torch.float16: dict(atol=1e-3, rtol=1e-3)}
# LSE: scores in fp32 from exact products, exp2 / log2 to ~2^-22; 2e-4 leaves room for the largest
# scores the tests make (~35), where fp32 sums of 128-256 products err by a few 1e-6 relative.
LSE_TOL = dict(atol=2e-4, rtol=2e-5)
VARIANT_NAMES = sorted(VARIANTS)


def make_case(lens, num_kv_heads=2, group=4, head_size=128, block_size=16, dtype=torch.bfloat16, layout="NHD",
              extra_blocks=3, shared=False, seed=0, num_blocks=None):
    """Random q/K/V, a random (non-contiguous) block table covering `lens`, context_lens."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    lens = list(lens)
    max_blocks = max(1, max(math.ceil(n / block_size) for n in lens)) + extra_blocks
    need = len(lens) * max_blocks
    num_blocks = num_blocks or (need // 2 + 1 if shared else need + 7)
    shape = ((num_blocks, block_size, num_kv_heads, head_size) if layout == "NHD"
             else (num_blocks, num_kv_heads, block_size, head_size))
    k = torch.randn(shape, generator=g, device="cuda").to(dtype)
    v = torch.randn(shape, generator=g, device="cuda").to(dtype)
    q = torch.randn(len(lens), num_kv_heads * group, head_size, generator=g, device="cuda").to(dtype)
    if shared:  # blocks drawn with replacement: sequences share blocks
        bt = torch.randint(0, num_blocks, (len(lens), max_blocks), generator=g, device="cuda", dtype=torch.int32)
    else:
        bt = torch.randperm(num_blocks, generator=g, device="cuda")[:need].view(len(lens), max_blocks).to(torch.int32)
    cl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return q, k, v, bt, cl


def check_out(o, ref, msg=""):
    """checkAllclose of an output with TOL's atol scaled by each row's (sequence, head) largest |ref|,
    when that is under 1. The reference is finite (it masks invalid metadata), so a NaN anywhere in `o`
    (its poison, or a NaN cache row let into a sum) fails."""
    assert torch.isfinite(ref).all(), "the reference is not finite"
    return checkAllclose(*rows_scaled(o, ref), msg=msg, **TOL[o.dtype])


def refused_here(variant, head_size):
    """Whether the op refuses `variant` at this head size on this GPU (runs_here: v16 / v5 at head size 256
    on CDNA, whose LDS their tiles do not fit)."""
    return not runs_here(variant, head_size)


def variants_here(head_size):
    return [v for v in VARIANT_NAMES if not refused_here(v, head_size)]


def run_and_check(case, layout="NHD", variant=None, scale=None, msg=""):
    """The op (variant, or the database's / a pinned choice) into poisoned outputs against the reference;
    where this GPU refuses the variant at this head size, the refusal is checked and the test skipped."""
    q, k, v, bt, cl = case
    chosen = variant or choose_variant(q, k, bt, layout)[0]
    if refused_here(chosen, q.shape[-1]):
        with pytest.raises(ValueError, match="supports head sizes 64 and 128 on this GPU"):
            hipkern.paged_attention_decode(q, k, v, bt, cl, kv_layout=layout, variant=variant, scale=scale)
        pytest.skip(f"{chosen} refuses head size {q.shape[-1]} on this GPU (checked)")
    out = poison(torch.empty_like(q))
    poison_next_alloc(q.device, (q.shape[:2], torch.float32))  # the op's own LSE tensor: unwritten shows
    o, lse = hipkern.paged_attention_decode(q, k, v, bt, cl, kv_layout=layout, out=out, return_lse=True,
                                            variant=variant, scale=scale)
    assert o is out
    ref, ref_lse = paged_attention_ref(q, k, v, bt, cl, scale=scale, kv_layout=layout)
    assert check_out(o, ref, msg=f"{msg}out ") == 0
    assert checkAllclose(lse, ref_lse, msg=f"{msg}lse ", **LSE_TOL) == 0
    return o, lse


def edge_lengths(block_size, partition=512):
    """Block, tile (64: the mma kernel's) and partition (512, 1024) boundaries +-1, and 2048."""
    return sorted({1, block_size - 1, block_size, block_size + 1, 63, 65, partition - 1, partition, partition + 1,
                   2 * partition - 1, 2 * partition + 1, 2048} - {0})


def strided_like(case, kinds):
    """The same values as `case` in the strided forms serving engines pass: K and V as the two halves of one
    fused [blocks, 2, ...] tensor ("fused_kv"), head rows padded by 8 elements ("padded_rows"), the query
    heads a slice of a [seqs, q + 2 kv heads, D] qkv tensor ("qkv"), a query whose rows are not 16-byte
    aligned (head stride D + 1, one element in: "q_unaligned"), the block table the first columns of a wider
    one ("wide_table"). Cache and query memory outside the views is NaN, so a read of it shows; the table's extra
    columns name block 0 (a wrong row stride shifts the rows read, and the output shows it)."""
    q, k, v, bt, cl = case
    d = q.shape[-1]
    if "fused_kv" in kinds:
        kv = torch.full((k.shape[0], 2) + tuple(k.shape[1:]), math.nan, dtype=k.dtype, device=k.device)
        kv[:, 0], kv[:, 1] = k, v
        k, v = kv[:, 0], kv[:, 1]
    if "padded_rows" in kinds:
        pads = [torch.full(tuple(c.shape[:-1]) + (d + 8,), math.nan, dtype=c.dtype, device=c.device) for c in (k, v)]
        for p_, c in zip(pads, (k, v)):
            p_[..., :d] = c
        k, v = (p_[..., :d] for p_ in pads)
    if "qkv" in kinds:
        hq = q.shape[1]
        qkv = torch.full((q.shape[0], hq + 2 * (hq // 4 or 1), d), math.nan, dtype=q.dtype, device=q.device)
        qkv[:, :hq] = q
        q = qkv[:, :hq]
    if "q_unaligned" in kinds:
        n = q.shape[0] * q.shape[1] * (d + 1) + 1
        flat = torch.full((n,), math.nan, dtype=q.dtype, device=q.device)
        qu = flat[1:].as_strided(q.shape, (q.shape[1] * (d + 1), d + 1, 1))
        qu.copy_(q)
        q = qu
    if "wide_table" in kinds:
        wide = torch.zeros(bt.shape[0], bt.shape[1] + 5, dtype=bt.dtype, device=bt.device)
        wide[:, : bt.shape[1]] = bt
        bt = wide[:, : bt.shape[1]]
    return q, k, v, bt, cl
