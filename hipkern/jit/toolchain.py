"""Compilers for each platform: finding them, their command lines, and their resource reports.

CUDA: ``nvcc`` (``HIPKERN_NVCC``, else ``$CUDA_HOME/bin/nvcc``, ``nvcc`` on PATH,
``/usr/local/cuda/bin/nvcc``). ROCm: a clang with HIP support (``HIPKERN_HIP_CLANG``, else
``$ROCM_PATH/llvm/bin/clang++``, ``/opt/rocm/llvm/bin/clang++``, then Debian's ``clang++-19..17``
with ``--rocm-path=/usr``). When the device libraries lack the ISA-version file of the target (Debian
ships ROCm 5.2, which predates gfx942), a private copy of the libraries is made with that file derived
from its nearest sibling (gfx940 -> gfx942: the same bitcode with the version constant changed).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

from ._lock import file_lock
from .platform import JitError, platform_of, wave_size_of

__all__ = ["Toolchain", "find_toolchain", "local_bytes", "parse_resources"]

# gfx942's ISA-version bitcode is gfx940's with the version constant 9400 -> 9402.
_ISA_SIBLINGS = {"942": ("940", "9400", "9402"), "941": ("940", "9400", "9401")}


@dataclasses.dataclass(frozen=True)
class Toolchain:
    platform: str
    compiler: str
    version: str  # first line(s) of `compiler --version`: part of every module's cache key
    rocm_path: str | None = None
    device_lib_dir: str | None = None
    extra_tools: tuple = ()

    def command(self, arch: str, sources, out: str, include_dirs, defines: dict) -> list[str]:
        if self.platform == "rocm":
            supported_wave(arch)
        d = [f"-D{k}={v}" for k, v in sorted(defines.items())] + [f"-DHK_WAVE_SIZE={wave_size_of(arch)}"]
        inc = [f"-I{p}" for p in include_dirs]
        if self.platform == "cuda":
            num = arch[3:]
            if num in ("90", "90a"):  # every compute-capability-9.0 GPU runs sm_90a code: wgmma (hipkern/wgmma.h)
                # sm_90a's PTX is for compute-capability 9.0 only: machine code alone.
                gencode = "-gencode=arch=compute_90a,code=sm_90a"
                d = d + ["-DHK_WGMMA=1"]
            else:
                # Machine code for the arch and its PTX, which the driver compiles for any later GPU: an sm_80
                # module also runs on an H100 (how the sm_80/89 code paths, cp.async and mma.sync without
                # tensor maps or wgmma, are tested on one: `bash .ci/gpu sm80`).
                gencode = f"-gencode=arch=compute_{num},code=[sm_{num},compute_{num}]"
            if int(num.rstrip("a")) >= 90:  # the device code waits in griddep_wait(): early launches (launch.h)
                d = d + ["-DHK_PDL=1"]
            # -z defs: a host symbol defined nowhere fails the link (with its log), not the first call at run time
            return [self.compiler, "-x", "cu", "-std=c++17", "-O3", gencode, "-shared", "-Xlinker", "-zdefs",
                    "-Xcompiler", "-fPIC,-fvisibility=hidden", "-Xptxas", "-v", "-lineinfo",
                    *inc, *d, *map(str, sources), "-o", out]
        cmd = [self.compiler, "-x", "hip", f"--offload-arch={arch}", "-std=c++17", "-O3", "-fPIC",
               "-shared", "-Wl,-z,defs", "-fvisibility=hidden", "-Rpass-analysis=kernel-resource-usage",
               f"--rocm-path={self.rocm_path}", *inc, *d, *map(str, sources), "-o", out]
        if self.device_lib_dir:
            cmd.insert(4, f"--rocm-device-lib-path={self.device_lib_dir}")
        lib = Path(self.rocm_path) / "lib"
        if lib.is_dir():
            cmd += [f"-L{lib}", f"-Wl,-rpath,{lib}"]
        return cmd + ["-lamdhip64"]


def supported_wave(arch: str) -> None:
    """A JitError for ROCm archs with 32-lane waves (RDNA)."""
    if wave_size_of(arch) != 64:
        raise JitError(f"arch {arch} has 32-lane waves (RDNA): hipkern's HIP kernels are written for CDNA's "
                       "64-lane waves and MFMA matrix cores (gfx942, MI300); RDNA is not supported")


_versions: dict = {}  # absolute path as invoked -> `--version`, asked once per process


def _version(compiler: str) -> str:
    """`compiler --version`, asked of the compiler once per process. (A memo on disk keyed by the file's
    size and time missed upgrades behind a wrapper script, e.g. /usr/local/bin/nvcc exec'ing a toolkit's
    nvcc updated in place: modules built by the old compiler kept their keys.) Keyed by the path invoked, not the
    file it resolves to: names linked to one multi-call program (ccache's gcc, g++, clang++) are other compilers."""
    key = os.path.abspath(compiler)
    known = _versions.get(key)
    if known is not None:
        return known
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, errors="replace", timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise JitError(f"compiler {compiler} does not run: {e}") from e
    version = " | ".join(line.strip() for line in out.stdout.splitlines() if line.strip())[:400]
    if out.returncode != 0 or not version:  # its version is part of every module's key: it has to give one
        detail = (out.stderr or "").strip()[:300] or "nothing"
        raise JitError(f"compiler {compiler} --version exited {out.returncode} and printed no version on its "
                       f"standard output (standard error: {detail})")
    _versions[key] = version
    return version


def _which(candidates) -> str | None:
    for c in candidates:
        if not c:
            continue
        p = shutil.which(c) if os.sep not in c else (c if os.access(c, os.X_OK) else None)
        if p:
            return p
    return None


def _compiler_from_env(var: str, value: str) -> str:
    """The compiler a variable names: a bare name (``nvcc``) is looked up on PATH, a path is taken as it is."""
    if os.sep in value:
        if os.path.isfile(value) and os.access(value, os.X_OK):
            return value
        raise JitError(f"{var}={value} is not an executable compiler")
    found = shutil.which(value)
    if not found:
        raise JitError(f"{var}={value} is not an executable compiler: there is no {value} on PATH")
    return found


def _find_nvcc() -> str:
    env = os.environ.get("HIPKERN_NVCC")
    if env:
        return _compiler_from_env("HIPKERN_NVCC", env)
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    found = _which([cuda_home and os.path.join(cuda_home, "bin", "nvcc"), "nvcc", "/usr/local/cuda/bin/nvcc"])
    if not found:
        raise JitError("no CUDA compiler found: install the CUDA toolkit (nvcc), or set HIPKERN_NVCC "
                       "or CUDA_HOME")
    return found


def _find_hip_clang() -> tuple[str, str]:
    env = os.environ.get("HIPKERN_HIP_CLANG")
    rocm = os.environ.get("ROCM_PATH")
    if env:
        clang = _compiler_from_env("HIPKERN_HIP_CLANG", env)
        return clang, rocm or ("/opt/rocm" if os.path.isdir("/opt/rocm") else "/usr")
    for root in [rocm, "/opt/rocm"]:
        if root and os.access(os.path.join(root, "llvm", "bin", "clang++"), os.X_OK):
            return os.path.join(root, "llvm", "bin", "clang++"), root
    found = _which(["clang++-19", "clang++-18", "clang++-17"])
    if found and os.path.isfile("/usr/include/hip/hip_runtime.h"):
        return found, "/usr"
    raise JitError("no HIP compiler found: install ROCm (or Debian's hipcc, libamdhip64-dev, "
                   "rocm-device-libs and clang-19), or set HIPKERN_HIP_CLANG and ROCM_PATH")


def _device_libs(rocm_path: str, arch: str, cache_dir: Path) -> str | None:
    """The device-library dir to pass, or None when the compiler's default one serves `arch`."""
    candidates = [Path(rocm_path) / "amdgcn" / "bitcode", Path(rocm_path) / "lib" / "amdgcn" / "bitcode",
                  Path("/usr/lib/x86_64-linux-gnu/amdgcn/bitcode")]
    src = next((p for p in candidates if (p / "ockl.bc").is_file()), None)
    if src is None:
        raise JitError(f"no ROCm device libraries (ockl.bc) under {rocm_path}: install rocm-device-libs")
    num = arch[3:]
    if (src / f"oclc_isa_version_{num}.bc").is_file():
        return str(src)
    if num not in _ISA_SIBLINGS:
        raise JitError(f"the ROCm device libraries in {src} do not support {arch}")
    sibling, old, new = _ISA_SIBLINGS[num]
    dest = cache_dir / f"rocm-device-libs-{arch}-{_fingerprint(src.glob('*.bc'))}"  # new libs: new copy
    target = dest / f"oclc_isa_version_{num}.bc"
    if target.is_file():
        return str(dest)
    llvm_bin = _which(["llvm-dis-19", "llvm-dis-18", "llvm-dis-17", "llvm-dis"])
    llvm_as = _which(["llvm-as-19", "llvm-as-18", "llvm-as-17", "llvm-as"])
    if not (llvm_bin and llvm_as):
        raise JitError(f"deriving {target.name} for {arch} needs llvm-dis and llvm-as (package llvm-19)")
    try:
        with file_lock(cache_dir / f"rocm-device-libs-{arch}.lock", f"device libraries for {arch}"):
            if target.is_file():  # made by another process while we waited
                return str(dest)
            for stale in cache_dir.glob(f"{dest.name}.tmp*"):  # under the lock: killed derivations' copies
                shutil.rmtree(stale, ignore_errors=True)
            tmp = Path(f"{dest}.tmp{os.getpid()}")
            try:
                shutil.copytree(src, tmp)
                text = subprocess.run([llvm_bin, str(src / f"oclc_isa_version_{sibling}.bc"), "-o", "-"],
                                      capture_output=True, text=True, errors="replace", check=True).stdout
                subprocess.run([llvm_as, "-o", str(tmp / target.name)], input=text.replace(old, new), text=True,
                               capture_output=True, check=True)
                os.rename(tmp, dest)
            except (OSError, subprocess.CalledProcessError) as e:
                shutil.rmtree(tmp, ignore_errors=True)
                detail = getattr(e, "stderr", "") or e
                raise JitError(f"deriving {target.name} for {arch} from {src} failed: {detail}") from e
    except OSError as e:  # the lock (a full or read-only cache): the cache is at fault, as builder.build says
        raise JitError(f"deriving the device libraries for {arch}: the JIT cache {cache_dir} cannot be written ({e}); "
                       "free space there, or set HIPKERN_JIT_DIR to a writable private directory") from e
    return str(dest)


def _fingerprint(paths, by_content=()) -> str:
    """Short hash of the names, sizes and mtimes of some files; of the names and bytes of those named in
    `by_content` (a file this process may write again with the same bytes, as the derived ISA library)."""
    h = hashlib.sha256()
    for p in sorted(paths):
        name = os.path.basename(p)
        if name in by_content:
            h.update(f"{name}|".encode() + hashlib.sha256(Path(p).read_bytes()).digest() + b";")
            continue
        st = os.stat(p)
        h.update(f"{name}|{st.st_size}|{st.st_mtime_ns};".encode())
    return h.hexdigest()[:12]


def find_toolchain(arch: str, cache_dir: Path) -> Toolchain:
    if platform_of(arch) == "cuda":
        nvcc = _find_nvcc()
        # nvcc preprocesses and compiles a module's host code with the gcc it finds on PATH and links with g++,
        # or with the compiler NVCC_CCBIN names: their versions are part of what a module is built with.
        def versions(names):
            return [_version(path) for name in names if (path := shutil.which(name))]

        ccbin = os.environ.get("NVCC_CCBIN")
        names = ("gcc", "g++")
        if ccbin:  # a compiler, or (as nvcc's -ccbin takes too) the directory holding gcc and g++
            names = tuple(os.path.join(ccbin, n) for n in names) if os.path.isdir(ccbin) else (ccbin,)
        # (a name nvcc may resolve otherwise: PATH's compilers at least)
        hosts = versions(names) or versions(("gcc", "g++"))
        return Toolchain("cuda", nvcc, " | host ".join([_version(nvcc)] + hosts))
    clang, rocm = _find_hip_clang()
    libs = _device_libs(rocm, arch, cache_dir)
    # The HIP headers and device libraries are part of what a module is built from: in the key.
    headers = [p for p in (Path(rocm) / "include" / "hip" / "hip_version.h",) if p.is_file()]
    derived = (f"oclc_isa_version_{arch[3:]}.bc",) if Path(libs).parent == Path(cache_dir) else ()  # (its copy)
    version = f"{_version(clang)} | hip {_fingerprint(headers)} | libs {_fingerprint(Path(libs).glob('*.bc'), derived)}"
    return Toolchain("rocm", clang, version, rocm_path=rocm, device_lib_dir=libs)


# ----------------------------------------------------------------------------------------------
# Resource reports: registers/VGPRs, shared memory/LDS, spills per kernel, from the build log.
# ----------------------------------------------------------------------------------------------
_PTXAS_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")
_CLANG_REMARK = re.compile(r"remark:\s+(Function Name|SGPRs|VGPRs|AGPRs|ScratchSize \[bytes/lane\]|"
                           r"Occupancy \[waves/SIMD\]|SGPRs Spill|VGPRs Spill|LDS Size \[bytes/block\]):\s*(\S+)")


def _demangle(names):
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, errors="replace",
                             timeout=30)
        lines = out.stdout.splitlines()
        if len(lines) == len(names):
            return lines
    except OSError:
        pass
    return list(names)


def local_bytes(row: dict) -> int:
    """A parse_resources row's local memory in bytes: ptxas' stack frame (CUDA) or clang's scratch per lane
    (ROCm); 0 where the row has neither (a resources.json cached before they were parsed)."""
    return row.get("stack_bytes", row.get("scratch_bytes", 0))


def parse_resources(platform: str, log: str) -> list[dict]:
    """One dict per kernel: kernel, regs (registers / VGPRs), shared_bytes (smem / LDS), spills
    (CUDA: spill store+load bytes; ROCm: VGPRs spilled to scratch; SGPRs spilled into VGPR lanes, which
    cost no memory traffic, are `sgpr_spills`), and target-specific extras."""
    rows: list[dict] = []
    if platform == "cuda":
        cur = None
        for line in log.splitlines():
            m = _PTXAS_ENTRY.search(line)
            if m:
                cur = {"kernel": m.group(1), "regs": 0, "shared_bytes": 0, "spills": 0, "stack_bytes": 0}
                rows.append(cur)
                continue
            if cur is None:
                continue
            m = _PTXAS_FRAME.search(line)
            if m:
                cur["stack_bytes"] = int(m.group(1))
                cur["spills"] = int(m.group(2)) + int(m.group(3))
            m = _PTXAS_USED.search(line)
            if m:
                cur["regs"] = int(m.group(1))
                cur["shared_bytes"] = int(m.group(2) or 0)
    else:
        cur = None
        for line in log.splitlines():
            m = _CLANG_REMARK.search(line)
            if not m:
                continue
            key, val = m.groups()
            if key == "Function Name":
                cur = {"kernel": val, "regs": 0, "shared_bytes": 0, "spills": 0}
                rows.append(cur)
            elif cur is not None:
                if key == "VGPRs":
                    cur["regs"] = int(val)
                elif key == "LDS Size [bytes/block]":
                    cur["shared_bytes"] = int(val)
                elif key == "VGPRs Spill":  # to scratch memory
                    cur["spills"] += int(val)
                elif key == "SGPRs Spill":  # into VGPR lanes: no memory traffic
                    cur["sgpr_spills"] = int(val)
                elif key == "ScratchSize [bytes/lane]":
                    cur["scratch_bytes"] = int(val)
                elif key == "AGPRs":
                    cur["agprs"] = int(val)
                elif key == "Occupancy [waves/SIMD]":
                    cur["occupancy"] = int(val)
    for row, name in zip(rows, _demangle([r["kernel"] for r in rows])):
        row["kernel"] = name
    return rows
