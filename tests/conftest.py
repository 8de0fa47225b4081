import os
import shutil
from pathlib import Path

import pytest
import torch

# The shared helpers of the test files (their checked calls assert): failures show their values, as in a test file.
pytest.register_assert_rewrite("moe_cases", "pa_cases")

from hipkern.jit.platform import JitError  # noqa: E402
from hipkern.jit.toolchain import find_toolchain  # noqa: E402
from hipkern.testing import poison_next_alloc  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# CI sets this: a missing compiler is then a failure, not a skip.
REQUIRE_TOOLCHAINS = os.environ.get("HIPKERN_REQUIRE_TOOLCHAINS") == "1"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a GPU visible to torch")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def sm90_build() -> bool:
    """Whether the ops' modules here are sm_90a builds (wgmma, tensor maps, thread-block clusters, early
    launches), which the GPU's compute capability alone does not say: HIPKERN_ARCH=sm_80 runs sm_80 builds on
    an H100 through their PTX, without any of those (`bash .ci/gpu sm80`)."""
    from hipkern import jit
    return jit.current_arch() == "sm_90"


def derived_device_libs_or_skip(tmp_path: Path, cache: Path) -> tuple:
    """(ROCm path, gfx942's device-library folder derived into `cache`), or skip where the libraries support gfx942
    as they are (nothing derived) or there is no HIP toolchain."""
    from hipkern.jit import toolchain

    toolchain_or_skip("gfx942", tmp_path)
    clang, rocm = toolchain._find_hip_clang()
    cache.mkdir(parents=True, exist_ok=True)  # (the cache directory, which exists when a build asks)
    libs = toolchain._device_libs(rocm, "gfx942", cache)
    if not libs.startswith(str(cache)):
        pytest.skip("these device libraries support gfx942 as they are: nothing is derived")
    return rocm, Path(libs)


def poison_routing_outputs(device, t: int, k: int) -> None:
    """A routing op's functional outputs (float32 weights and int32 ids, [t, k]) from poisoned blocks."""
    poison_next_alloc(device, ((t, k), torch.float32), ((t, k), torch.int32))


def poison_sorting_outputs(device, num_pairs: int, num_experts: int, block_m: int) -> None:
    """moe_sorting's functional outputs (sorted ids, expert ids, count) from poisoned blocks."""
    from hipkern.ops.moe_sorting import moe_sorting_max_padded

    n = moe_sorting_max_padded(num_pairs, num_experts, block_m)
    poison_next_alloc(device, ((n,), torch.int32), ((n // block_m,), torch.int32), ((1,), torch.int32))


def toolchain_or_skip(arch: str, tmp_path: Path):
    """The toolchain for `arch`, or skip (fail under HIPKERN_REQUIRE_TOOLCHAINS=1) if it is missing."""
    try:
        return find_toolchain(arch, tmp_path)
    except JitError as e:
        if REQUIRE_TOOLCHAINS:
            pytest.fail(f"toolchain for {arch} required but missing: {e}")
        pytest.skip(f"no toolchain for {arch}: {e}")


@pytest.fixture
def tuning_results(tmp_path, monkeypatch):
    """tmp_path/results/sm_90 for a test's tuning files, with HIPKERN_TUNING_DB unset and the loaded
    tuning database forgotten before and after. Without a GPU (no module to load) HIPKERN_JIT_DIR, where the
    tuner's save lock lives (core.files_lock), is the test's own unless set, not the user's cache."""
    import torch
    from hipkern import tuning_db

    monkeypatch.delenv("HIPKERN_TUNING_DB", raising=False)
    if not os.environ.get("HIPKERN_JIT_DIR") and not torch.cuda.is_available():
        monkeypatch.setenv("HIPKERN_JIT_DIR", str(tmp_path / "jit"))
    tuning_db.reset()
    yield tmp_path / "results" / "sm_90"
    tuning_db.reset()


@pytest.fixture
def jit_dir(tmp_path, monkeypatch):
    d = tmp_path / "jit"
    monkeypatch.setenv("HIPKERN_JIT_DIR", str(d))
    monkeypatch.delenv("HIPKERN_REBUILD", raising=False)
    return d


TINY_SOURCE = r"""
#include "hipkern/error.h"
#include "hipkern/reduce.h"

__global__ void tiny_scale_kernel(float* x, int n, float a) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  float v = i < n ? x[i] * a : 0.f;
  v += 0.f * hk::group_sum(v);  // exercise the portability layer's shuffles
  if (i < n) x[i] = v;
}

HK_EXPORT int hk_tiny_scale(void* x, int n, int device, void* stream) {
  HK_REQUIRE(n > 0);
  HK_TRY(hk::use_device(device));
  hipLaunchKernelGGL(tiny_scale_kernel, dim3((n + 255) / 256), dim3(256), 0, (hipStream_t)stream,
                     (float*)x, n, TINY_FACTOR);
  HK_CHECK_LAUNCH("tiny_scale_kernel");
  return 0;
}
"""


@pytest.fixture
def tiny_root(tmp_path):
    """A csrc root holding the real shared headers and module API plus a one-kernel module."""
    root = tmp_path / "csrc"
    shutil.copytree(REPO / "csrc_hip" / "include", root / "include")
    shutil.copytree(REPO / "csrc_hip" / "common", root / "common")
    (root / "tiny").mkdir()
    (root / "tiny" / "tiny.hip").write_text(TINY_SOURCE)
    return root


def tiny_spec(root, name="tiny", factor="2.0f"):
    from hipkern.jit.modules import ModuleSpec

    return ModuleSpec(name=name, sources=("tiny/tiny.hip",), defines=(("TINY_FACTOR", factor),),
                      functions=(("hk_tiny_scale", "i32", ("ptr", "i32", "i32", "ptr")),), root=Path(root))


def routing_out_overlaps(x):
    """(out, match) cases of a routing op's out= pair (topk = all of x's experts) that overlap each other or
    the logits x, float32 [T, E] on the GPU, with the ValueError each must raise."""
    import torch

    buf = torch.empty_like(x)
    return [((buf, buf.view(torch.int32)), r"out\[0\] \(weights\) must not overlap out\[1\] \(ids\)"),
            ((x, torch.empty(x.shape, dtype=torch.int32, device=x.device)),
             r"out\[0\] \(weights\) must not overlap gating_logits")]


def launch_piece_rows(e, dtype, t, every=1):
    """For the routing ops (topk_softmax, grouped_topk), which launch a block per block of rows in pieces of
    2^16 blocks (csrc_hip/include/hipkern/launch.h kMaxLaunchBlocks): the rows a block takes at E experts of
    `dtype` (256 threads / lanes a row, as their launchers pick lanes: a 16-byte chunk a lane, the fewest
    lanes up to a wave, else whole waves; one element a lane on the scalar path), and a sample of t rows:
    every `every`-th, all rows within 300 of each piece's first, and the last 300."""
    from hipkern import jit
    wave = jit.wave_size_of(jit.current_arch())
    vec = 16 // torch.empty(0, dtype=dtype).element_size()
    chunks = e // vec if e % vec == 0 else e
    lanes = min(wave, 1 << (chunks - 1).bit_length()) if e % vec == 0 else wave
    per_block = 256 // lanes
    starts = torch.arange(0, t, 65536 * per_block, device="cuda")
    near = (starts[:, None] + torch.arange(-300, 300, device="cuda")).flatten()
    rows = torch.cat([torch.arange(0, t, every, device="cuda"), near, torch.arange(t - 300, t, device="cuda")])
    return per_block, rows[(rows >= 0) & (rows < t)].unique()
