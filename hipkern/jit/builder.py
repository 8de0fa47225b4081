"""Build, cache and load JIT modules.

A module is a plain shared library with a C ABI (no torch headers), loaded through ctypes. Layout
of the cache (see ``_paths.cache_root``)::

    <cache>/<arch>/<name>-<key>/<name>.so     the module
    <cache>/<arch>/<name>-<key>/build.log     the compiler's output (resource report included)
    <cache>/<arch>/<name>-<key>/resources.json
    <cache>/<arch>/<name>-<key>.lock          flock'ed while a process builds it

``key`` hashes every source file, every shared header, the defines, the compile command's flags,
the compiler's version and the arch. A build runs in a temporary directory that is renamed into
place, so a killed build never leaves a partial module; the lock is an flock, released by the kernel
when its holder dies, so a dead builder's lock never blocks anyone. ``HIPKERN_REBUILD=1`` rebuilds
each module once per process.
"""
from __future__ import annotations

import ctypes
import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

from ._lock import file_lock
from ._paths import cache_root, check_private
from .modules import ModuleSpec
from .platform import JitError, check_arch, current_arch, platform_of
from .toolchain import find_toolchain, parse_resources, supported_wave

__all__ = ["Module", "BuildResult", "build", "load", "module_key", "prune"]

log = logging.getLogger("hipkern.jit")

BUILDER_VERSION = "1"
ABI_VERSION = 1
_CTYPES = {"ptr": ctypes.c_void_p, "i32": ctypes.c_int, "i64": ctypes.c_int64, "f32": ctypes.c_float}

_loaded: dict = {}
_rebuilt: set = set()
_load_locks: dict = {}  # (spec, arch) -> lock: a build blocks only loads of the same module
_load_failures: dict = {}  # (spec, arch) -> (failed loads, the last one's JitError's text)
_mutex = threading.Lock()


@dataclasses.dataclass
class BuildResult:
    spec: ModuleSpec
    arch: str
    path: Path
    built: bool  # False: found in the cache
    seconds: float  # compile time if built, else the time to find it
    resources: list


def _source_files(spec: ModuleSpec) -> list[Path]:
    """What the key hashes: the shared headers, module_api.hip, the sources, and the headers beside and below them.
    (Every file these #include is among them: tests/test_jit.py resolves each quoted include to check. Headers
    only: an editor's swap or backup file beside a header changes no key.)"""
    files = sorted(p for p in spec.include_dir.rglob("*") if p.is_file() and p.suffix in HEADER_SUFFIXES)
    files.append(spec.root / "common" / "module_api.hip")
    files += [spec.root / s for s in spec.sources]
    for d in sorted({(spec.root / s).parent for s in spec.sources}):  # headers beside the sources, and below
        files += sorted(p for p in d.rglob("*") if p.is_file() and p.suffix in HEADER_SUFFIXES)
    for f in files:
        if not f.is_file():
            raise JitError(f"module {spec.name}: source {f} is missing")
    return files


HEADER_SUFFIXES = (".h", ".hpp", ".cuh", ".inc")

# Environment variables the compilers read as flags or include paths: a module built under one of them is
# another module (nvcc: NVCC_APPEND_FLAGS / NVCC_PREPEND_FLAGS, and the variables its nvcc.profile extends from
# the environment, INCLUDES, SYSTEM_INCLUDES, LIBRARIES, CUDAFE_FLAGS, PTXAS_FLAGS; clang: CPATH and the like,
# CCC_OVERRIDE_OPTIONS, and HIP_PATH, whose include directory it puts in place of --rocm-path's; the host
# compiler and linker: GCC_EXEC_PREFIX, COMPILER_PATH, LIBRARY_PATH).
COMPILER_ENV = ("NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS", "NVCC_CCBIN", "INCLUDES", "SYSTEM_INCLUDES", "LIBRARIES",
                "CUDAFE_FLAGS", "PTXAS_FLAGS", "CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "CCC_OVERRIDE_OPTIONS",
                "HIPCC_COMPILE_FLAGS_APPEND", "HIPCC_LINK_FLAGS_APPEND", "HIP_PATH", "GCC_EXEC_PREFIX",
                "COMPILER_PATH", "LIBRARY_PATH")


def module_key(spec: ModuleSpec, arch: str, toolchain) -> str:
    h = hashlib.sha256()
    for f in _source_files(spec):
        h.update(str(f.relative_to(spec.root)).encode() + b"\0" + f.read_bytes() + b"\0")
    if toolchain.device_lib_dir:  # under the cache directory; its libraries' contents are in the version
        toolchain = dataclasses.replace(toolchain, device_lib_dir="LIBS")
    flags = toolchain.command(arch, ["SRC"], "OUT", ["INC"], dict(spec.defines))[1:]
    parts = [BUILDER_VERSION, arch, toolchain.version, flags]
    env = {k: os.environ[k] for k in COMPILER_ENV if os.environ.get(k)}
    if env:  # (absent when none is set: the usual keys stay as they were)
        parts.append(env)
    h.update(json.dumps(parts).encode())
    return h.hexdigest()[:20]


def _compile(spec: ModuleSpec, arch: str, toolchain, final_dir: Path, key: str) -> float:
    tmp = final_dir.with_name(f".tmp-{final_dir.name}-{os.getpid()}-{threading.get_ident()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)
    sources = [spec.root / "common" / "module_api.hip"] + [spec.root / s for s in spec.sources]
    cmd = toolchain.command(arch, sources, str(tmp / f"{spec.name}.so"), [spec.include_dir], dict(spec.defines))
    try:
        return _compile_in(spec, arch, toolchain, cmd, tmp, final_dir, key)
    except BaseException:  # a failed or interrupted build leaves nothing behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _compile_in(spec: ModuleSpec, arch: str, toolchain, cmd, tmp: Path, final_dir: Path, key: str) -> float:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace")  # (any bytes in a message)
    except OSError as e:
        raise JitError(f"could not run the compiler {cmd[0]}: {e}") from e
    seconds = time.perf_counter() - t0
    log_text = "$ " + " ".join(map(str, cmd)) + "\n" + proc.stdout + proc.stderr
    if proc.returncode != 0:
        failed = final_dir.with_name(f"{final_dir.name}.failed.log")
        try:
            failed.write_text(log_text)
            where = f"full log: {failed}"
        except OSError as e:  # (a full disk): the compiler's message below is what matters
            where = f"the full log could not be saved ({e})"
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        # The first errors (the cause; later ones often follow from it) and the end (the summary).
        shown = lines if len(lines) <= 40 else lines[:25] + [f"... ({len(lines) - 40} lines) ..."] + lines[-15:]
        raise JitError(f"building module {spec.name} for {arch} failed (exit {proc.returncode}); "
                       f"{where}\n$ {' '.join(map(str, cmd))}\n" + "\n".join(shown))
    # The key hashed the sources before the compiler read them: had one changed meanwhile (a checkout, an
    # editor's save), this module could be of the new text under the old text's key.
    if module_key(spec, arch, toolchain) != key:
        raise JitError(f"building module {spec.name} for {arch}: its sources changed while it was built; the "
                       f"build was discarded (call again to build the current sources)")
    (tmp / "build.log").write_text(log_text)
    resources = parse_resources(toolchain.platform, log_text)
    (tmp / "resources.json").write_text(json.dumps({"seconds": seconds, "kernels": resources}, indent=1))
    for f in tmp.iterdir():  # on disk before the rename makes them the cache's: a crash leaves no torn module
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final_dir.exists():  # HIPKERN_REBUILD: replace file by file, so a loader never finds it missing
        for f in tmp.iterdir():
            os.replace(f, final_dir / f.name)
        tmp.rmdir()
    else:
        os.rename(tmp, final_dir)
    return seconds


def build(spec: ModuleSpec, arch: str | None = None, force: bool = False) -> BuildResult:
    """Make sure `spec` is built for `arch` (default: the current GPU's); build it if needed."""
    arch = check_arch(arch) if arch else current_arch()
    if platform_of(arch) == "rocm":
        supported_wave(arch)  # (before looking for device libraries that would serve an arch hipkern refuses)
    root = cache_root()
    arch_dir = root / arch
    toolchain = find_toolchain(arch, root)
    key = module_key(spec, arch, toolchain)
    final_dir = arch_dir / f"{spec.name}-{key}"
    so = final_dir / f"{spec.name}.so"
    want_rebuild = force or (os.environ.get("HIPKERN_REBUILD") == "1" and (spec.name, arch) not in _rebuilt)
    t0 = time.perf_counter()
    if so.is_file() and not want_rebuild:
        for d in (arch_dir, final_dir):  # (made 0700 by this user: anything else was put there)
            check_private(d)
        return BuildResult(spec, arch, so, False, time.perf_counter() - t0, _resources(final_dir))
    seconds = None  # compile time when this call built it
    try:
        arch_dir.mkdir(mode=0o700, exist_ok=True)
        with file_lock(arch_dir / f"{spec.name}-{key}.lock", f"building {spec.name} for {arch}"):
            if want_rebuild or not so.is_file():  # another process may have built it while we waited
                # Under the lock no live process builds this module: a temporary folder of it is a killed build's.
                for stale in arch_dir.glob(f".tmp-{final_dir.name}-*"):
                    shutil.rmtree(stale, ignore_errors=True)
                log.info("building module %s for %s", spec.name, arch)
                seconds = _compile(spec, arch, toolchain, final_dir, key)
                _rebuilt.add((spec.name, arch))
    except OSError as e:  # a full or read-only cache: the cache, not the module, is at fault
        # (writes, fsync and the lock's pid carry no file name: a full disk is the cache's whatever the name)
        if not (str(e.filename or "").startswith(str(arch_dir)) or e.errno in _CACHE_FULL):
            raise  # (a source that vanished mid-build, say: not the cache's fault)
        raise JitError(f"building module {spec.name} for {arch}: the JIT cache {arch_dir} cannot be written ({e}); "
                       "free space there, or set HIPKERN_JIT_DIR to a writable private directory") from e
    built = seconds is not None
    return BuildResult(spec, arch, so, built, seconds if built else time.perf_counter() - t0, _resources(final_dir))


_CACHE_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)


def _entry_module(entry: str) -> tuple | None:
    """(module name, key) of a cache entry: <name>-<key>[.lock|.failed.log] or a build's .tmp-<name>-<key>-<pid>-<tid>;
    None for anything else."""
    if entry.startswith(".tmp-"):
        parts = entry[len(".tmp-"):].rsplit("-", 2)
        if len(parts) != 3:
            return None
        entry = parts[0]
    for suffix in (".lock", ".failed.log"):
        if entry.endswith(suffix):
            entry = entry[: -len(suffix)]
    name, sep, key = entry.rpartition("-")
    if not sep or len(key) != 20 or any(c not in "0123456789abcdef" for c in key):
        return None
    return name, key


def prune(specs, arch: str) -> list[Path]:
    """Remove from the cache the builds of `specs` for `arch` under keys other than their current ones (older
    sources, compilers or flags: every edit of a shared header leaves a set), with their lock and failed-build
    files and killed builds' temporary folders, each under its module's lock. Entries of other names are left
    alone. Another hipkern sharing the cache (another checkout or environment) has other keys too: its builds
    go, and it builds them again. Returns what was removed."""
    arch = check_arch(arch)
    root = cache_root()
    arch_dir = root / arch
    if not arch_dir.is_dir():
        return []
    toolchain = find_toolchain(arch, root)
    current = {s.name: module_key(s, arch, toolchain) for s in specs}
    stale: dict = {}  # (name, old key) -> its entries
    killed: dict = {}  # (name, current key) -> its killed builds' temporary folders (a killed --force or rebuild)
    for entry in sorted(arch_dir.iterdir()):
        found = _entry_module(entry.name)
        if found is not None and found[0] in current:
            if found[1] != current[found[0]]:
                stale.setdefault(found, []).append(entry)
            elif entry.name.startswith(".tmp-"):
                killed.setdefault(found, []).append(entry)
    for (name, key), entries in sorted(stale.items()):
        lock = arch_dir / f"{name}-{key}.lock"
        # its lock file goes last, while held (file_lock re-checks that it holds the file at the path)
        with file_lock(lock, f"pruning {name} for {arch}"):
            for entry in entries:
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
            lock.unlink(missing_ok=True)
    for (name, key), entries in sorted(killed.items()):
        with file_lock(arch_dir / f"{name}-{key}.lock", f"pruning {name} for {arch}"):  # (no live build holds it)
            for entry in entries:
                shutil.rmtree(entry, ignore_errors=True)
    return [entry for entries in [*stale.values(), *killed.values()] for entry in entries]


def _resources(final_dir: Path) -> list:
    try:
        return json.loads((final_dir / "resources.json").read_text())["kernels"]
    except (OSError, ValueError, KeyError):
        return []


class Module:
    """A loaded module: its C functions as attributes, with ctypes signatures from the spec."""

    def __init__(self, spec: ModuleSpec, arch: str, path: Path):
        self.spec, self.arch, self.path = spec, arch, path
        try:
            self._lib = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_LOCAL)  # (linked -z defs: all resolve)
        except OSError as e:
            raise JitError(f"module {spec.name} ({path}) does not load: {e}. If the cached file is damaged, "
                           f"delete {path.parent} (or set HIPKERN_REBUILD=1) to build it again") from e
        abi = self._lib.hk_module_abi_version()
        if abi != ABI_VERSION:
            raise JitError(f"module {path} has ABI {abi}, this hipkern expects {ABI_VERSION}")
        self._wave_size = self._lib.hk_wave_size()
        self._lib.hk_last_error.restype = ctypes.c_char_p
        self._lib.hk_last_error.argtypes = ()
        for name, restype, argtypes in spec.functions:
            fn = getattr(self._lib, name)
            fn.restype = _CTYPES[restype]
            fn.argtypes = [_CTYPES[a] for a in argtypes]
            setattr(self, name, fn)

    def wave_size(self) -> int:
        return self._wave_size

    def last_error(self) -> str:
        return self._lib.hk_last_error().decode(errors="replace")

    def check(self, rc: int, op: str) -> None:
        if rc != 0:
            raise RuntimeError(f"hipkern {op}: {self.last_error()}")


def load(spec: ModuleSpec, arch: str | None = None) -> Module:
    """The loaded module for `spec` on `arch`, built first if the cache lacks it. Memoised.

    Threads of this process loading one module queue behind the first; a JitError of the load a thread waited for
    (a failed build, a timed-out lock) is raised in it too, rather than one more build each, one after another."""
    arch = check_arch(arch) if arch else current_arch()
    key = (spec, arch)  # the whole spec: a name with other defines or sources is another module
    mod = _loaded.get(key)
    if mod is not None:
        return mod
    with _mutex:
        lock = _load_locks.setdefault(key, threading.Lock())
        failed_before = _load_failures.get(key, (0, ""))[0]
    with lock:
        mod = _loaded.get(key)
        if mod is None:
            failed, message = _load_failures.get(key, (0, ""))
            if failed > failed_before:  # the load this thread waited for failed
                raise JitError(message)
            try:
                platform_of(arch)
                mod = _loaded[key] = load_built(spec, arch, build(spec, arch))
            except JitError as e:
                _load_failures[key] = (failed + 1, str(e))  # (the text: the error's frames hold the caller's tensors)
                raise
    return mod


def load_built(spec: ModuleSpec, arch: str, result: BuildResult) -> Module:
    """Module(result.path); built again once if the file is gone meanwhile (another install's --prune shares the
    cache and removed it: the documented outcome is a rebuild, not a "damaged file" error)."""
    try:
        return Module(spec, arch, result.path)
    except JitError:
        if result.path.is_file():
            raise
        return Module(spec, arch, build(spec, arch).path)
