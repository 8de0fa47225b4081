"""The benchmarks' read floor: stream_read reads every byte once (each tile's XOR checked against a
numpy reference), and its arguments are validated before a launch."""
import numpy as np
import pytest
import torch

from hipkern.bench.floor import BLOCK_THREADS, read_floor_us, stream_read, tiles


def _reference_sink(data: np.ndarray, unroll: int) -> np.ndarray:
    """XOR of the 32-bit words of each tile of unroll x 256 16-byte vectors."""
    words = data.view(np.uint32)
    tile = np.arange(words.size) // (4 * unroll * BLOCK_THREADS)
    out = np.zeros(tiles(data.size, unroll), dtype=np.uint32)
    np.bitwise_xor.at(out, tile, words)
    return out.view(np.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("nbytes", [16, 48, 4096, 4096 + 16, 32768 - 16, (1 << 20) + 16 * 37, 3 * (1 << 20)])
@pytest.mark.parametrize("unroll", [1, 2, 4, 8])
def test_each_tile_reads_its_vectors_once(nbytes, unroll):
    g = torch.Generator(device="cuda").manual_seed(nbytes + unroll)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)
    n = tiles(nbytes, unroll)
    sink = torch.full((n,), 0x5A5A5A5A, dtype=torch.int32, device="cuda")  # poisoned: every tile writes
    stream_read(src, unroll, sink)
    np.testing.assert_array_equal(sink.cpu().numpy(), _reference_sink(src.cpu().numpy(), unroll))


@pytest.mark.gpu
def test_empty_buffer_launches_nothing():
    assert stream_read(torch.empty(0, dtype=torch.uint8, device="cuda"), 4).numel() == 0


@pytest.mark.gpu
def test_read_floor_is_a_positive_time_per_size():
    small, large = read_floor_us(1 << 20, num_iters=10), read_floor_us(1 << 28, num_iters=10)
    assert 0 < small < large


def test_tiles_count_partial_tiles():
    assert [tiles(b, 1) for b in (0, 16, 4096, 4097)] == [0, 1, 1, 2]
    assert tiles(3 * 32768 + 16, 8) == 4


@pytest.mark.parametrize("src, match", [(torch.zeros(32, dtype=torch.uint8), "src must be on a GPU"),
                                        ("x", "src must be a torch.Tensor")])
def test_bad_src_is_rejected(src, match):
    with pytest.raises(ValueError, match=match):
        stream_read(src, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("nbytes, unroll, sink, match", [
    (40, 4, None, "multiple of 16 bytes"),
    (64, 3, None, "unroll must be one of"),
    (64, 4, (2, torch.int32), r"sink must have shape \(1,\)"),
    (64, 4, (1, torch.int64), "sink must be one of int32"),
])
def test_bad_arguments_are_rejected_before_a_launch(nbytes, unroll, sink, match):
    src = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    if sink is not None:
        sink = torch.zeros(sink[0], dtype=sink[1], device="cuda")
    with pytest.raises(ValueError, match=match):
        stream_read(src, unroll, sink)


@pytest.mark.gpu
def test_misaligned_or_strided_src_is_rejected():
    buf = torch.zeros(128, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="16-byte aligned"):
        stream_read(buf[8:72], 4)
    with pytest.raises(ValueError, match="src must be contiguous"):
        stream_read(buf.view(8, 16).t(), 4)
