"""paged_attention_decode: the reference logs' table, plus each variant, bandwidth and torch baselines.

Naive: a per-sequence torch loop (gather, matmuls in bf16), as in the reference log; it reads the
context lengths back to the host, so its time includes that wait and its launches (host-bound). SDPA gather:
gather the paged K/V into contiguous tensors, then scaled_dot_product_attention(enable_gqa=True).
SDPA contiguous: SDPA alone over K/V already contiguous (no paging). Bytes_MB: the K/V rows actually read
(each once), plus Q and O, over which TBps is taken; KV_MB: the K/V part alone (the bars' size classes). For
the mixed-length batch both SDPA baselines run on K/V padded to the longest length, with a mask (SDPA has no
per-sequence lengths), so they read more than Bytes_MB (the run prints how much). Custom_Time_us:
variant=None (the tuning database's choice, Variant, with its parameters); it and the per-variant columns
(defaults): run_perftest (events around each call); Graph_us / SDPA_contiguous_graph_us: run_graphtest (the
calls back to back in CUDA graphs over rotated inputs, as serving engines run decode and as the issue's peer
figures were taken). Floor_us: a plain read of the row's bytes in run_perftest (bench.floor.read_floor_us),
the least any kernel reading them takes in this harness.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

import hipkern
from hipkern import jit
from hipkern.ops.paged_attention import VARIANTS, choose_variant, runs_here
from hipkern.reference import paged_attention_ref
from hipkern.testing import BenchTable, checkAllclose, poison, rows_scaled, run_graphtest, run_perftest

from . import COPY_BW_TBPS, bars
from .floor import read_floor_us

BLOCK = 16
REFERENCE_GRID = [(b, c, hq, hkv, d) for hq, hkv, d in ((64, 1, 256), (64, 8, 128))
                  for b in (1, 8, 16, 32) for c in (256, 2048)]
LARGE_GRID = [(b, c, 32, 8, 128) for b in (64, 128) for c in (4096, 16384, 32768)]
# ContextLen: the longest length (an int on every row: a spreadsheet reads the column as numbers); Lengths says
# whether the batch's lengths are uniform or mixed (and their range).
COLUMNS = ["BatchSize", "ContextLen", "NumQHeads", "NumKVHeads", "HeadSize", "Naive_Time_us", "Custom_Time_us",
           "Speedup", "Lengths", "Variant", "Floor_us", "KV_MB", "Bytes_MB", "TBps", "Pct_of_copy_BW", "SDPA_gather_us",
           "SDPA_contiguous_us", "Graph_us", "Graph_TBps", "SDPA_contiguous_graph_us", "Best_Variant", "Best_us",
           *[f"{v}_us" for v in VARIANTS], "Check"]


def make_inputs(lens, hq, hkv, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    nblk = [math.ceil(n / BLOCK) for n in lens]
    max_blocks = max(nblk)
    total = len(lens) * max_blocks
    k = torch.randn((total, BLOCK, hkv, d), generator=g, device="cuda", dtype=dtype)
    v = torch.randn((total, BLOCK, hkv, d), generator=g, device="cuda", dtype=dtype)
    bt = torch.randperm(total, generator=g, device="cuda").view(len(lens), max_blocks).to(torch.int32)
    q = torch.randn((len(lens), hq, d), generator=g, device="cuda", dtype=dtype)
    cl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return q, k, v, bt, cl


def gather_kv(k, v, bt, n):
    """Contiguous [S, Hkv, n, D] copies of each sequence's first n tokens."""
    s, nb = bt.shape
    kk = k[bt.long()].reshape(s, nb * BLOCK, *k.shape[2:])[:, :n].transpose(1, 2)
    vv = v[bt.long()].reshape(s, nb * BLOCK, *v.shape[2:])[:, :n].transpose(1, 2)
    return kk, vv


def sdpa(q, kk, vv, mask):
    return F.scaled_dot_product_attention(q.unsqueeze(2), kk, vv, attn_mask=mask, enable_gqa=True).squeeze(2)


def sdpa_gather(q, k, v, bt, n, mask):
    kk, vv = gather_kv(k, v, bt, n)
    return sdpa(q, kk, vv, mask)


def bytes_moved(lens, num_kv_heads: int, num_q_heads: int, head_size: int, itemsize: int) -> int:
    """What a decode call must move: each sequence's K and V rows up to its own length (each once, no
    padding of its last block, nothing past it), plus the query and the output rows."""
    return kv_bytes_read(lens, num_kv_heads, head_size, itemsize) + 2 * len(lens) * num_q_heads * head_size * itemsize


def kv_bytes_read(lens, num_kv_heads: int, head_size: int, itemsize: int) -> int:
    """The K and V part of bytes_moved: each sequence's rows up to its own length, each once."""
    return sum(lens) * num_kv_heads * head_size * 2 * itemsize


def bench_shape(table, name, lens, hq, hkv, d, iters, naive_iters):
    q, k, v, bt, cl = make_inputs(lens, hq, hkv, d)
    n = max(lens)
    # SDPA's mask only where lengths differ: with equal lengths it takes no mask (its fastest kernels).
    mask = None if min(lens) == n else (torch.arange(n, device="cuda")[None, :] < cl[:, None]).view(len(lens), 1, 1, n)
    ref, _ = paged_attention_ref(q, k, v, bt, cl)
    # Every checked call writes into a NaN-poisoned out= (an unwritten element fails) and is compared with
    # the reference itself.
    out = hipkern.paged_attention_decode(q, k, v, bt, cl, out=poison(torch.empty_like(q)))
    err = checkAllclose(*rows_scaled(out, ref), atol=8e-3, rtol=8e-3, msg=f"{name} ")
    times = {}
    for var in (v for v in VARIANTS if runs_here(v, d)):  # CDNA: no v16 / v5 at head 256
        o = hipkern.paged_attention_decode(q, k, v, bt, cl, variant=var, out=poison(torch.empty_like(q)))
        err = max(err, checkAllclose(*rows_scaled(o, ref), atol=8e-3, rtol=8e-3, msg=f"{name} {var} ", printLog=False))
        _, times[var] = run_perftest(hipkern.paged_attention_decode, q, k, v, bt, cl, variant=var, num_iters=iters)
    del ref
    chosen, params = choose_variant(q, k, bt, "NHD")
    chosen += "".join(f"[{k}={v}]" for k, v in sorted(params.items()))
    best = min(times, key=times.get)
    _, custom_us = run_perftest(hipkern.paged_attention_decode, q, k, v, bt, cl, num_iters=iters)  # variant=None
    _, graph_us = run_graphtest(hipkern.paged_attention_decode, q, k, v, bt, cl, num_iters=max(3, iters // 5))
    _, naive_us = run_perftest(paged_attention_ref, q, k, v, bt, cl, compute_dtype=q.dtype, num_iters=naive_iters,
                               num_warmup=1)
    _, gather_us = run_perftest(sdpa_gather, q, k, v, bt, n, mask, num_iters=max(3, iters // 4), num_warmup=2)
    kk, vv = gather_kv(k, v, bt, n)
    kk, vv = kk.contiguous(), vv.contiguous()
    _, contig_us = run_perftest(sdpa, q, kk, vv, mask, num_iters=max(3, iters // 4), num_warmup=2)
    _, contig_graph_us = run_graphtest(sdpa, q, kk, vv, mask, num_iters=max(3, iters // 5))
    del kk, vv
    nbytes = bytes_moved(lens, hkv, hq, d, q.element_size())
    kv_bytes = kv_bytes_read(lens, hkv, d, q.element_size())
    if mask is not None:
        print(f"# {name}: both SDPA baselines read K/V padded to {n} tokens a sequence "
              f"({len(lens) * n / sum(lens):.2f}x the {sum(lens)} tokens of the batch), masked", flush=True)
    us = custom_us
    tbps = nbytes / us / 1e6
    floor_us = read_floor_us(nbytes, num_iters=iters)
    table.add(BatchSize=len(lens), ContextLen=n, NumQHeads=hq, NumKVHeads=hkv, HeadSize=d, Naive_Time_us=naive_us,
              Custom_Time_us=us, Speedup=naive_us / us,
              Lengths=f"mixed {min(lens)}..{n}" if name == "mixed" else "uniform", Variant=chosen, Floor_us=floor_us,
              KV_MB=kv_bytes / 1e6, Bytes_MB=nbytes / 1e6, TBps=tbps,
              Pct_of_copy_BW=100 * tbps / COPY_BW_TBPS,
              SDPA_gather_us=gather_us, SDPA_contiguous_us=contig_us, Graph_us=graph_us,
              Graph_TBps=nbytes / graph_us / 1e6, SDPA_contiguous_graph_us=contig_graph_us,
              Best_Variant=best, Best_us=times[best],
              **{f"{v}_us": times.get(v, math.nan) for v in VARIANTS}, Check="passed" if err == 0 else "FAILED")
    return err != 0


def main(out_dir: Path, quick: bool = False) -> int:
    table = BenchTable(COLUMNS, title="# paged_attention_decode (bf16, block 16, NHD)",
                       decimals={"TBps": 3, "Graph_TBps": 3})  # (the bars' rates: 2.795 is not 2.80)
    failures = 0
    iters = 10 if quick else 50
    shapes = [("ref", [c] * b, hq, hkv, d, iters, 5) for b, c, hq, hkv, d in REFERENCE_GRID]
    shapes += [("large", [c] * b, hq, hkv, d, iters, 2) for b, c, hq, hkv, d in LARGE_GRID]
    mixed = torch.randint(1, 4097, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    shapes.append(("mixed", mixed, 32, 8, 128, iters, 5))
    for name, lens, hq, hkv, d, it, nit in shapes:
        failures += bench_shape(table, name, lens, hq, hkv, d, it, nit)
        torch.cuda.empty_cache()
    table.print()
    table.to_csv(out_dir / "paged_attention.csv")
    archs = jit.platform.built_and_device_arch(torch.cuda.current_device())
    report = bars.device_lines(torch.cuda.get_device_name(), *archs) + bars.paged_attention(table.rows)
    print("\n".join(report), flush=True)
    return failures


def sweep(out_dir: Path, quick: bool = False) -> int:
    """v16 at fixed partition sizes against its own plan (what calibrates _plan_balanced)."""
    from hipkern.tune.core import Candidate
    from hipkern.tune.paged_attention import pinned

    sizes = [0, 64, 128, 256, 512, 1024, 2048, 4096]  # 0: the plan's own choice
    table = BenchTable(["BatchSize", "ContextLen", "NumQHeads", "NumKVHeads", "HeadSize",
                        *[f"p{s}_us" for s in sizes]],
                       title="# v16 by partition size (bf16, block 16; p0: its own plan)")
    grid = REFERENCE_GRID + LARGE_GRID[:3] + [(b, c, 32, 8, 128) for b in (1, 4) for c in (4096, 16384)]
    for b, c, hq, hkv, d in grid:
        if not runs_here("v16", d):  # CDNA: v16 has no head size 256
            continue
        q, k, v, bt, cl = make_inputs([c] * b, hq, hkv, d)
        times = {}
        for s in sizes:
            with pinned(Candidate.of("v16", **({"partition_size": s} if s else {}))):
                _, times[s] = run_perftest(hipkern.paged_attention_decode, q, k, v, bt, cl,
                                           num_iters=10 if quick else 30)
        table.add(BatchSize=b, ContextLen=c, NumQHeads=hq, NumKVHeads=hkv, HeadSize=d,
                  **{f"p{s}_us": times[s] for s in sizes})
        del q, k, v, bt, cl
        torch.cuda.empty_cache()
    table.print()
    table.to_csv(out_dir / "paged_attention_sweep.csv")
    return 0
