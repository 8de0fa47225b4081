"""The read floor of a benchmark row: how long a plain streaming read of the row's bytes takes in the
same harness (run_perftest: events around each call, inputs rotated over 2x L2 or L2 flushed).

No kernel that must read those bytes can take less in that harness: the floor carries the call's own
cost (~3-4 us of events on the H100 beyond any kernel: paged_attention NOTES.md, 2026-11-27 (6)), the
memory system's ramp and its tail, which bytes / 3.0 TB/s does not. The read is
csrc_hip/stream_read/stream_read.hip; the floor is the fastest of its tile sizes (UNROLLS).
"""
from __future__ import annotations

import torch

from hipkern.ops._common import check_tensor, module_for, on_device, raw_stream
from hipkern.testing import run_perftest

BLOCK_THREADS = 256  # stream_read.hip's kBlockThreads
UNROLLS = (1, 2, 4, 8)  # 16-byte vectors a lane: tiles of 4, 8, 16 or 32 KB a block

_floors: dict = {}


def tiles(nbytes: int, unroll: int) -> int:
    """Blocks (tiles of unroll x 4 KB) of a read of `nbytes`: the length of its sink."""
    per_tile = unroll * BLOCK_THREADS * 16
    return -(-nbytes // per_tile)


def stream_read(src: torch.Tensor, unroll: int, sink: torch.Tensor | None = None) -> torch.Tensor:
    """Read every byte of `src` (contiguous, on a GPU, 16-byte aligned, a multiple of 16 bytes) once, a
    block of 256 threads per tile of `unroll` x 4 KB; returns `sink` (int32 [tiles(bytes, unroll)]): each
    tile's XOR of its 32-bit words."""
    check_tensor("src", src)
    nbytes = src.numel() * src.element_size()
    if nbytes % 16 or src.data_ptr() % 16:
        raise ValueError(f"src must be 16-byte aligned and a multiple of 16 bytes, got {nbytes} bytes at "
                         f"address {src.data_ptr():#x}")
    if unroll not in UNROLLS:
        raise ValueError(f"unroll must be one of {UNROLLS}, got {unroll!r}")
    grid = tiles(nbytes, unroll)
    if sink is None:
        sink = torch.empty(grid, dtype=torch.int32, device=src.device)
    check_tensor("sink", sink, dtypes=(torch.int32,), shape=(grid,))
    if sink.device != src.device:
        raise ValueError(f"sink must be on {src.device} (the device of src), got {sink.device}")
    on_device(src.get_device(), _launch, src, nbytes, sink, grid, unroll)
    return sink


def _launch(src, nbytes, sink, grid, unroll):
    dev = src.get_device()
    mod = module_for("stream_read", dev)
    mod.check(mod.hk_stream_read(src.data_ptr(), nbytes, sink.data_ptr(), grid, unroll, dev, raw_stream(dev)),
              "stream_read")


def read_floor_us(nbytes: int, num_iters: int = 50) -> float:
    """Median us of the fastest tile size's read of `nbytes` (rounded up to 16) in run_perftest, on the
    current GPU; memoised per (GPU, bytes, num_iters) for the process."""
    dev = torch.cuda.current_device()
    nbytes = -(-int(nbytes) // 16) * 16
    key = (dev, nbytes, num_iters)
    if key not in _floors:
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        src.random_(0, 256)
        best = float("inf")
        for unroll in UNROLLS:
            sink = torch.empty(tiles(nbytes, unroll), dtype=torch.int32, device="cuda")
            _, us = run_perftest(stream_read, src, unroll, sink, num_iters=num_iters)
            best = min(best, us)
        del src
        torch.cuda.empty_cache()
        _floors[key] = best
    return _floors[key]
