"""Which GPU platform and architecture hipkern builds for.

The arch is ``HIPKERN_ARCH`` when set, else the current torch device's: ``gfx942`` (the part of
``gcnArchName`` before any ``:feature``) on ROCm, ``sm_<major><minor>`` on CUDA. The platform follows
from the arch name: ``gfx*`` is ROCm, ``sm_*`` is CUDA.
"""
from __future__ import annotations

import functools
import os
import re

__all__ = ["JitError", "platform_of", "wave_size_of", "current_arch", "check_arch", "built_and_device_arch", "runs_on",
           "load_arch"]


class JitError(RuntimeError):
    """A module could not be built or loaded; the message says why and where the log is."""


_ARCH_RE = re.compile(r"^(gfx[0-9a-f]{3,4}|sm_[0-9]{2,3}a?)$")


# Names that build exactly as another: every sm_90 module is compiled for sm_90a (wgmma), so sm_90a shares
# sm_90's module cache and tuning results instead of rebuilding into a cache, and reading results, of its own.
_SAME_AS = {"sm_90a": "sm_90"}


def check_arch(arch: str) -> str:
    """`arch` if it names a GPU architecture (its canonical name: sm_90a is sm_90; gfx942:sramecc+:xnack-, as ROCm
    tools print it, is gfx942: modules are built for any feature setting), else a JitError."""
    if isinstance(arch, str) and arch.startswith("gfx"):
        arch = arch.split(":")[0]
    if not isinstance(arch, str) or not _ARCH_RE.match(arch):
        raise JitError(f"arch {arch!r} is not a GPU architecture name such as 'gfx942' or 'sm_90'")
    return _SAME_AS.get(arch, arch)


def platform_of(arch: str) -> str:
    """'rocm' for gfx* archs, 'cuda' for sm_* archs."""
    return "rocm" if check_arch(arch).startswith("gfx") else "cuda"


def wave_size_of(arch: str) -> int:
    """Lanes per wave: 64 on GCN/CDNA (gfx9xx and older), 32 on RDNA (gfx10+) and NVIDIA."""
    arch = check_arch(arch)  # (gfx1100:xnack- is gfx1100)
    if platform_of(arch) == "cuda":
        return 32
    return 32 if arch.startswith("gfx1") and len(arch) == 7 else 64


@functools.lru_cache(maxsize=None)
def _device_arch(index: int) -> str:
    import torch

    props = torch.cuda.get_device_properties(index)
    if getattr(torch.version, "hip", None):
        return check_arch(props.gcnArchName.split(":")[0])
    return check_arch(f"sm_{props.major}{props.minor}")


_ARCH_KEY = os.environ.encodekey("HIPKERN_ARCH") if hasattr(os.environ, "encodekey") else None


def arch_env() -> str | None:
    """os.environ.get("HIPKERN_ARCH"), read on every launch: for an unset name that costs ~1.3 us (a KeyError raised
    and caught inside os.environ), os.environ's own mapping ~0.1."""
    data = getattr(os.environ, "_data", None)
    if _ARCH_KEY is None or data is None:
        return os.environ.get("HIPKERN_ARCH")
    value = data.get(_ARCH_KEY)
    return None if value is None else os.environ.decodevalue(value)


def current_arch(device_index: int | None = None) -> str:
    """The arch to build for: HIPKERN_ARCH, else the given (or current) torch GPU's."""
    env = arch_env()
    if env:
        return check_arch(env)
    import torch

    if not torch.cuda.is_available():
        raise JitError("no GPU is visible to torch and HIPKERN_ARCH is not set: cannot pick an arch")
    return _device_arch(torch.cuda.current_device() if device_index is None else device_index)


def built_and_device_arch(device_index: int) -> tuple[str, str]:
    """(the arch modules are built for here: current_arch(device_index), GPU device_index's own arch): they differ
    where HIPKERN_ARCH names another arch (e.g. sm_80 modules run on an H100 through their PTX)."""
    return current_arch(device_index), _device_arch(device_index)


def runs_on(built: str, gpu: str) -> bool:
    """Whether a module built for arch `built` runs on a GPU of arch `gpu`: the same arch, or on NVIDIA an
    earlier arch, whose PTX the module carries and the driver compiles for the GPU (toolchain.py). sm_90 is
    built as sm_90a, whose code runs on compute capability 9.0 only; AMD code objects run on their own arch."""
    built, gpu = check_arch(built), check_arch(gpu)
    if built == gpu:
        return True
    if platform_of(built) != "cuda" or platform_of(gpu) != "cuda" or built == "sm_90":
        return False
    if built.endswith("a"):  # arch-specific code (sm_100a): its own compute capability only
        return built[:-1] == gpu.rstrip("a")
    return int(built[3:]) <= int(gpu[3:].rstrip("a"))


def load_arch(device_index: int) -> str:
    """current_arch(device_index) for a module about to run on GPU `device_index`: a JitError naming both archs
    where HIPKERN_ARCH picks code that GPU cannot run, before anything is built or launched."""
    if not arch_env():
        return current_arch(device_index)  # the GPU's own
    arch, own = built_and_device_arch(device_index)
    if not runs_on(arch, own):
        raise JitError(f"HIPKERN_ARCH={os.environ['HIPKERN_ARCH']} builds for {arch}, which GPU {device_index} "
                       f"({own}) cannot run: unset HIPKERN_ARCH, or name {own} or (NVIDIA) an earlier arch other "
                       "than sm_90 (built as sm_90a) and the sm_XXXa ones")
    return arch
