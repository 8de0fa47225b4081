"""The JIT builder where users trip (a review of 2026-11-28): what the cache key covers, a cache that cannot be
written, compiler output that is not UTF-8, lock waits, arch names with features, HIPKERN_JIT_DIR spelt with ~ or
relative, Ctrl-C in `python -m hipkern.build`. CPU only; the tests that compile need nvcc or clang-19."""
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path

import pytest

from conftest import derived_device_libs_or_skip, tiny_spec, toolchain_or_skip
from hipkern import jit
from hipkern.jit import _lock, _paths, builder, toolchain
from hipkern.jit.platform import JitError

pytestmark = pytest.mark.toolchain

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _unhashed_includes(spec) -> list[str]:
    """Quoted includes reachable from the spec's sources that resolve (beside the includer, then in the include
    directory, as the compilers look) to a file the module key does not hash, or to no file."""
    hashed = {p.resolve() for p in builder._source_files(spec)}
    todo = [spec.root / "common" / "module_api.hip"] + [spec.root / s for s in spec.sources]
    seen, bad = set(), []
    while todo:
        f = todo.pop().resolve()
        if f in seen:
            continue
        seen.add(f)
        for name in _INCLUDE.findall(f.read_text(errors="replace")):
            found = next((c.resolve() for c in (f.parent / name, spec.include_dir / name) if c.is_file()), None)
            if found is None or found not in hashed:
                bad.append(f"{f.name}: #include \"{name}\"")
            elif found not in seen:
                todo.append(found)
    return bad


def test_every_file_the_shipped_modules_include_is_in_their_key():
    """The key hashes headers by place (include/, the sources' directories); a quoted include from elsewhere
    (../shared/x.h) or of another suffix (impl.hip) would be served stale after an edit."""
    specs = {s.sources: s for s in jit.all_specs()}.values()
    assert specs
    for spec in specs:
        assert _unhashed_includes(spec) == [], spec.name


def test_the_include_check_finds_a_file_outside_the_key(tiny_root):
    (tiny_root / "shared").mkdir()
    (tiny_root / "shared" / "factor.h").write_text("#define FACTOR 5\n")
    (tiny_root / "tiny" / "impl.hip").write_text("// included source\n")
    src = tiny_root / "tiny" / "tiny.hip"
    src.write_text('#include "../shared/factor.h"\n#include "impl.hip"\n#include "missing.h"\n' + src.read_text())
    assert _unhashed_includes(tiny_spec(tiny_root)) == ['tiny.hip: #include "../shared/factor.h"',
                                                       'tiny.hip: #include "impl.hip"',
                                                       'tiny.hip: #include "missing.h"']


def test_an_editor_s_swap_file_beside_a_header_changes_no_key(jit_dir, tiny_root, tmp_path):
    tc = toolchain_or_skip("sm_90", tmp_path)
    key = jit.module_key(tiny_spec(tiny_root), "sm_90", tc)
    (tiny_root / "include" / "hipkern" / ".platform.h.swp").write_bytes(b"\x00vim swap")
    (tiny_root / "include" / "hipkern" / "reduce.h~").write_text("// a backup\n")
    assert jit.module_key(tiny_spec(tiny_root), "sm_90", tc) == key


def test_compiler_output_that_is_not_utf8_keeps_the_compiler_s_message(jit_dir, tiny_root, tmp_path):
    toolchain_or_skip("sm_90", tmp_path)
    (tiny_root / "tiny" / "tiny.hip").write_bytes(b"caf\xe9 is not C++;\n")
    with pytest.raises(JitError, match=r"(?s)building module tiny for sm_90 failed .*caf\ufffd is not C\+\+"):
        jit.build(tiny_spec(tiny_root), "sm_90")


def test_a_cache_that_cannot_be_written_is_a_jit_error(jit_dir, tiny_root, tmp_path):
    """A full or read-only cache raised a bare OSError (from the lock file, the arch directory, the logs)."""
    toolchain_or_skip("sm_90", tmp_path)
    jit_dir.mkdir(mode=0o700)
    (jit_dir / "sm_90").write_text("a file where the arch's directory goes\n")
    with pytest.raises(JitError, match=r"building module tiny for sm_90: the JIT cache .*/sm_90 cannot be written "
                                       r"\(.*File exists.*set HIPKERN_JIT_DIR"):
        jit.build(tiny_spec(tiny_root), "sm_90")


def test_a_compile_error_whose_log_cannot_be_saved_still_shows_the_compiler_s_message(jit_dir, tiny_root, tmp_path):
    tc = toolchain_or_skip("sm_90", tmp_path)
    (tiny_root / "tiny" / "tiny.hip").write_text("this is not C++;\n")
    key = jit.module_key(tiny_spec(tiny_root), "sm_90", tc)
    (jit_dir / "sm_90" / f"tiny-{key}.failed.log").mkdir(parents=True)  # (as a full disk would refuse it)
    with pytest.raises(JitError, match=r"(?s)failed \(exit \d+\); the full log could not be saved \(.*\n\$ .*"
                                       r"this is not C\+\+"):
        jit.build(tiny_spec(tiny_root), "sm_90")


def test_threads_waiting_for_one_lock_share_one_timeout(tmp_path, monkeypatch):
    """Three threads of a process that all wait for a lock another process holds time out together, after one
    HIPKERN_JIT_LOCK_TIMEOUT (they timed out one after another, at 1x, 2x and 3x it)."""
    import fcntl

    lock = tmp_path / "x.lock"
    held = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)  # another open file: flock treats it as another process
    fcntl.flock(held, fcntl.LOCK_EX)
    monkeypatch.setenv("HIPKERN_JIT_LOCK_TIMEOUT", "1")
    ends = []

    def wait():
        t0 = time.monotonic()
        with pytest.raises(JitError, match="timed out after 1s waiting for the lock"):
            with _lock.file_lock(lock, "testing"):
                pytest.fail("took the lock")
        ends.append(time.monotonic() - t0)

    try:
        threads = [threading.Thread(target=wait) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    finally:
        os.close(held)
    assert len(ends) == 3 and max(ends) < 1.8, ends


def _threads_loading(n, spec, monkeypatch, compile_fn=None, on_load=None):
    """n threads' first jit.load of `spec` at once (toolchain and key faked; `compile_fn` as builder._compile):
    [(the JitError's text or "loaded", seconds)] in the order they ended."""
    monkeypatch.setattr(builder, "find_toolchain", lambda arch, root: object())
    monkeypatch.setattr(builder, "module_key", lambda spec, arch, tc: "0" * 20)
    monkeypatch.setattr(builder, "_loaded", {})
    monkeypatch.setattr(builder, "_load_failures", {}, raising=False)  # (a fresh process)
    if compile_fn:
        monkeypatch.setattr(builder, "_compile", compile_fn)
    t0, ends, barrier = time.monotonic(), [], threading.Barrier(n)

    def call():
        barrier.wait(timeout=10)
        try:
            mod = jit.load(spec, "sm_90")
            ends.append(("loaded", time.monotonic() - t0))
            if on_load:
                on_load(mod)
        except JitError as e:
            ends.append((str(e), time.monotonic() - t0))

    threads = [threading.Thread(target=call) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return sorted(ends, key=lambda e: e[1])


def test_threads_loading_one_module_share_one_lock_timeout(jit_dir, monkeypatch):
    """Three threads' first load of a module whose build lock another process holds all time out after one
    HIPKERN_JIT_LOCK_TIMEOUT: the threads queued behind the first on jit.load's own lock get its error (each waited
    a timeout of its own in the file lock after the one before it: 1x, 2x, 3x)."""
    import fcntl

    monkeypatch.setenv("HIPKERN_JIT_LOCK_TIMEOUT", "1")
    spec = jit.spec("topk_softmax", dtype="float32")
    arch_dir = builder.cache_root() / "sm_90"
    arch_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    held = os.open(arch_dir / f"{spec.name}-{'0' * 20}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)  # another open file: flock treats it as another process
    try:
        ends = _threads_loading(3, spec, monkeypatch)
    finally:
        os.close(held)
    assert len(ends) == 3 and all("timed out after 1s waiting for the lock" in e for e, _ in ends), ends
    assert max(t for _, t in ends) < 1.8, ends


def test_threads_behind_a_failed_build_get_its_error_not_a_build_each(jit_dir, monkeypatch):
    """Four threads' first load of a module whose build fails: one compile, its error raised in every thread (each
    thread compiled again, one after another); a later call, not waiting on that build, tries again."""
    monkeypatch.delenv("HIPKERN_JIT_LOCK_TIMEOUT", raising=False)
    compiles = []

    def failing_compile(spec, arch, toolchain, final_dir, key):
        compiles.append(threading.get_ident())
        time.sleep(1.0)  # (the other threads, past the barrier, queue behind this load meanwhile)
        raise JitError("building the module failed (faked)")

    spec = jit.spec("topk_softmax", dtype="float16")
    ends = _threads_loading(4, spec, monkeypatch, failing_compile)
    assert len(compiles) == 1 and len(ends) == 4, (compiles, ends)
    assert all("building the module failed (faked)" in e for e, _ in ends), ends
    with pytest.raises(JitError, match="faked"):
        jit.load(spec, "sm_90")
    assert len(compiles) == 2


def test_threads_behind_a_slow_load_get_its_module_whatever_the_lock_timeout(jit_dir, monkeypatch):
    """A thread queued behind another thread's load of the same module gets that module however long the load took,
    even with HIPKERN_JIT_LOCK_TIMEOUT=0 (the timeout is for another process's lock, not this process's work)."""
    monkeypatch.setenv("HIPKERN_JIT_LOCK_TIMEOUT", "0")
    module, builds = object(), []

    def slow_build(spec, arch):
        builds.append(arch)
        time.sleep(0.5)
        return None

    monkeypatch.setattr(builder, "build", slow_build)
    monkeypatch.setattr(builder, "load_built", lambda spec, arch, result: module)
    got = []
    ends = _threads_loading(2, jit.spec("topk_softmax", dtype="bfloat16"), monkeypatch,
                            on_load=lambda mod: got.append(mod))
    assert [e for e, _ in ends] == ["loaded", "loaded"] and got == [module, module] and builds == ["sm_90"], ends


def test_a_failed_load_keeps_no_reference_to_its_caller_s_objects(jit_dir, monkeypatch):
    """The failure kept for the threads that waited on a load is its text: the JitError itself, with its traceback,
    held the frames of the failing call and their tensors (an op's weights) for the process's life."""
    import gc
    import weakref

    def failing_build(spec, arch):
        raise JitError("building the module failed (faked)")

    monkeypatch.setattr(builder, "build", failing_build)
    monkeypatch.setattr(builder, "_loaded", {})
    monkeypatch.setattr(builder, "_load_failures", {}, raising=False)

    class Weights:
        pass

    def op_call(weights):
        jit.load(jit.spec("topk_softmax", dtype="float32"), "sm_90")

    weights = Weights()
    alive = weakref.ref(weights)
    with pytest.raises(JitError, match="faked"):
        op_call(weights)
    del weights
    gc.collect()
    assert alive() is None, "a failed load keeps its caller's objects alive"


def test_a_long_wait_for_a_lock_is_said_once(tmp_path, monkeypatch, caplog):
    import fcntl

    lock = tmp_path / "x.lock"
    held = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)
    os.pwrite(held, b"4242", 0)
    monkeypatch.setattr(_lock, "TELL_AFTER_S", 0.1)
    monkeypatch.setenv("HIPKERN_JIT_LOCK_TIMEOUT", "0.5")
    try:
        with caplog.at_level(logging.WARNING, logger="hipkern.jit"):
            with pytest.raises(JitError):
                with _lock.file_lock(lock, "building tiny for sm_90"):
                    pass
    finally:
        os.close(held)
    said = [r.getMessage() for r in caplog.records if "waiting for process" in r.getMessage()]
    assert len(said) == 1 and "waiting for process 4242, which is building tiny for sm_90" in said[0]


def test_rocm_arch_names_with_features_are_their_arch(monkeypatch):
    assert jit.platform.check_arch("gfx942:sramecc+:xnack-") == "gfx942"
    assert jit.platform.check_arch("gfx90a:xnack+") == "gfx90a"
    monkeypatch.setenv("HIPKERN_ARCH", "gfx942:sramecc+:xnack-")
    assert jit.current_arch() == "gfx942"
    with pytest.raises(JitError, match="is not a GPU architecture name"):
        jit.platform.check_arch("sm_90:xnack+")
    # the wave size of the arch, not of its name's length with the features
    waves = [jit.platform.wave_size_of(a) for a in ("gfx1100:xnack-", "gfx942:sramecc+:xnack-", "gfx1100")]
    assert waves == [32, 64, 32]


def test_a_file_system_that_cannot_lock_is_a_jit_error_naming_the_lock(tmp_path, monkeypatch):
    """flock's other errors (ENOLCK on NFS without a lock daemon, EOPNOTSUPP on some FUSE mounts) were a bare
    OSError without a file name."""
    import errno
    import fcntl

    real = fcntl.flock

    def no_locks(fd, op):
        if op & fcntl.LOCK_EX:
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
        return real(fd, op)

    monkeypatch.setattr(_lock.fcntl, "flock", no_locks)
    with pytest.raises(JitError, match=r"cannot lock .*x\.lock \(building tiny for sm_90\).*HIPKERN_JIT_DIR"):
        with _lock.file_lock(tmp_path / "x.lock", "building tiny for sm_90"):
            pass


def test_rdna_is_refused_before_any_toolchain_is_looked_for(jit_dir, tiny_root, monkeypatch):
    """gfx1100 was told that Debian's device libraries do not support it, as if newer ones would help."""
    monkeypatch.setenv("HIPKERN_HIP_CLANG", "/nonexistent/clang")
    with pytest.raises(JitError, match="arch gfx1100 has 32-lane waves"):
        jit.build(tiny_spec(tiny_root), "gfx1100")


def test_jit_dir_with_a_tilde_or_relative_is_one_absolute_directory(tmp_path, monkeypatch):
    _paths._env_root.cache_clear()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HIPKERN_JIT_DIR", "~/hk-cache")
    assert _paths.cache_root() == tmp_path / "home" / "hk-cache"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    monkeypatch.setenv("HIPKERN_JIT_DIR", f"rel-{tmp_path.name}")
    first = _paths.cache_root()
    monkeypatch.chdir(tmp_path / "b")  # a later chdir keeps the same cache
    assert _paths.cache_root() == first == tmp_path / "a" / f"rel-{tmp_path.name}"
    assert not (tmp_path / "b" / f"rel-{tmp_path.name}").exists()


def test_a_compiler_whose_version_query_fails_is_a_clear_error(tmp_path, monkeypatch):
    cc = tmp_path / "badcc"
    cc.write_text("#!/bin/sh\necho 'no version here' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setattr(toolchain, "_versions", {})
    with pytest.raises(JitError, match=r"badcc --version exited 1 .*standard error: no version here"):
        toolchain._version(str(cc))


def test_nvcc_ccbin_s_version_is_in_the_cuda_toolchain_s_version(tmp_path, monkeypatch):
    toolchain_or_skip("sm_90", tmp_path)
    cc = tmp_path / "bin" / "my-gcc"
    cc.parent.mkdir()
    cc.write_text("#!/bin/sh\necho 'my-gcc (Other) 42.1'\n")
    cc.chmod(0o755)
    monkeypatch.setenv("NVCC_CCBIN", str(cc))
    assert "| host my-gcc (Other) 42.1" in toolchain.find_toolchain("sm_90", tmp_path).version


def test_a_killed_device_library_derivation_s_copy_is_removed(tmp_path):
    """gfx942 on Debian's ROCm libraries derives its ISA-version file into a private copy; a copy left by a
    killed process (another pid) is removed by the next derivation."""
    rocm, first = derived_device_libs_or_skip(tmp_path, tmp_path / "one")
    fresh = tmp_path / "two"
    stale = fresh / f"{first.name}.tmp99999999"
    stale.mkdir(parents=True)
    (stale / "ockl.bc").write_bytes(b"partial")
    derived = toolchain._device_libs(rocm, "gfx942", fresh)
    assert Path(derived).is_dir() and not stale.exists()
    shutil.rmtree(tmp_path / "one")


def test_ctrl_c_stops_the_build_command_before_the_queued_modules(monkeypatch, capsys):
    from hipkern import build

    started = []

    def slow_build(spec, arch, force):
        started.append(spec.name)
        time.sleep(0.2)

    def interrupted(futures):
        raise KeyboardInterrupt

    monkeypatch.setattr(jit, "build", slow_build)
    monkeypatch.setattr(build, "wait", interrupted)
    assert build.main(["--arch", "sm_90", "--jobs", "1"]) == 130
    assert "interrupted" in capsys.readouterr().err
    time.sleep(0.5)  # the one running build ends; no queued one starts
    assert len(started) <= 1 < len(jit.all_specs())


def test_prune_removes_older_builds_of_the_selected_modules_only(jit_dir, tiny_root, tmp_path):
    """Every edit of a shared header leaves a set of builds under old keys; --prune removes those of the modules
    it is given (folder, lock, failed log, killed builds' folders), keeps the current build and anything else."""
    toolchain_or_skip("sm_90", tmp_path)
    old = jit.build(tiny_spec(tiny_root), "sm_90").path.parent
    src = tiny_root / "tiny" / "tiny.hip"
    src.write_text(src.read_text() + "\n// edited\n")
    new = jit.build(tiny_spec(tiny_root), "sm_90").path.parent
    arch_dir = jit_dir / "sm_90"
    killed = arch_dir / f".tmp-{old.name}-4242-99"
    killed.mkdir()
    (arch_dir / f"{old.name}.failed.log").write_text("an old failure\n")
    other = arch_dir / "someone-else-0123456789abcdef0123"
    other.mkdir()
    assert old != new and (arch_dir / f"{old.name}.lock").exists()
    removed = builder.prune([tiny_spec(tiny_root)], "sm_90")
    assert {p.name for p in removed} == {old.name, f"{old.name}.lock", f"{old.name}.failed.log", killed.name}
    assert not old.exists() and not killed.exists() and not (arch_dir / f"{old.name}.lock").exists()
    assert new.exists() and other.exists() and (new / "tiny.so").is_file()
    assert builder.prune([tiny_spec(tiny_root)], "sm_90") == []
    assert builder._entry_module(f".tmp-{new.name}-1-2") == ("tiny", new.name.split("-")[-1])
    assert builder._entry_module("rocm-device-libs-gfx942-abc") is None


def test_the_build_command_prunes_after_building_when_asked(monkeypatch, capsys):
    from hipkern import build

    class Built:
        path, built, seconds, resources = Path("/nowhere/x.so"), False, 0.0, []

    pruned = []
    monkeypatch.setattr(jit, "build", lambda spec, arch, force: Built())
    monkeypatch.setattr(builder, "Module", lambda spec, arch, path: None)
    monkeypatch.setattr(builder, "prune", lambda specs, arch: pruned.append((len(specs), arch)) or [Path("a")])
    assert build.main(["--arch", "sm_90", "--only", "topk_softmax", "--prune"]) == 0
    assert pruned == [(len(build.select(["topk_softmax"])), "sm_90")]
    assert "== sm_90: pruned 1 cache entries of older builds ==" in capsys.readouterr().out
    assert build.main(["--arch", "sm_90", "--only", "topk_softmax"]) == 0 and len(pruned) == 1


def test_a_lock_file_unlinked_while_waited_on_is_not_taken(tmp_path):
    """--prune unlinks old keys' lock files: a waiter that had opened one must lock the file now at that path,
    not the unlinked one (else two processes could hold "the" lock at once)."""
    import fcntl

    lock = tmp_path / "x.lock"
    held = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)
    got = []

    def waiter():
        with _lock.file_lock(lock, "testing"):
            got.append(os.stat(lock).st_ino)
            time.sleep(0.2)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.3)  # the waiter has opened the old file and waits on it
    lock.unlink()
    other = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)  # another process's new lock file, taken
    fcntl.flock(other, fcntl.LOCK_EX)
    fcntl.flock(held, fcntl.LOCK_UN)
    os.close(held)
    time.sleep(0.3)
    assert not got  # it did not take the unlinked file's lock
    fcntl.flock(other, fcntl.LOCK_UN)
    os.close(other)
    t.join(timeout=10)
    assert got == [os.stat(lock).st_ino]


def test_nvcc_ccbin_may_name_the_host_compilers_directory(tmp_path, monkeypatch):
    toolchain_or_skip("sm_90", tmp_path)
    d = tmp_path / "hostbin"
    d.mkdir()
    for n in ("gcc", "g++"):
        (d / n).write_text(f"#!/bin/sh\necho '{n} (Dir) 7.7'\n")
        (d / n).chmod(0o755)
    monkeypatch.setenv("NVCC_CCBIN", str(d))
    version = toolchain.find_toolchain("sm_90", tmp_path).version
    assert "| host gcc (Dir) 7.7" in version and "| host g++ (Dir) 7.7" in version


def test_an_os_error_outside_the_cache_is_not_blamed_on_it(jit_dir, tiny_root, tmp_path, monkeypatch):
    toolchain_or_skip("sm_90", tmp_path)

    def vanished(*args):
        raise FileNotFoundError(2, "No such file or directory", str(tiny_root / "tiny" / "tiny.hip"))

    monkeypatch.setattr(builder, "_compile", vanished)
    with pytest.raises(FileNotFoundError):
        jit.build(tiny_spec(tiny_root), "sm_90")


# ---------------------------------------------------------------- from an audit (2026-11-29)
def test_a_full_disk_is_a_jit_error_naming_the_cache(jit_dir, tiny_root, tmp_path, monkeypatch):
    """Writes, fsync and the lock's pid raise ENOSPC without a file name: it was a bare OSError."""
    import errno
    toolchain_or_skip("sm_90", tmp_path)

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(builder, "_compile", full)
    with pytest.raises(JitError, match=r"the JIT cache .*/sm_90 cannot be written \(\[Errno 28\] No space left"):
        jit.build(tiny_spec(tiny_root), "sm_90")


def test_the_cache_root_is_returned_resolved(tmp_path, monkeypatch):
    """A link to the cache (another user's in /tmp, say) is followed once, when checked: re-pointed later, it
    changes nothing, since builds and loads use the resolved directory."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    monkeypatch.setenv("HIPKERN_JIT_DIR", str(link))
    _paths._env_root.cache_clear()
    assert _paths.cache_root() == real.resolve() and real.is_dir()


def test_a_relative_xdg_cache_home_is_ignored(tmp_path, monkeypatch):
    """XDG's rule: a relative XDG_CACHE_HOME is ignored (it made the cache follow the working directory)."""
    monkeypatch.delenv("HIPKERN_JIT_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    for xdg in ("relcache", "~/xdg"):
        monkeypatch.setenv("XDG_CACHE_HOME", xdg)
        assert _paths.cache_root() == (tmp_path / "home" / ".cache" / "hipkern" / "jit").resolve()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _paths.cache_root() == (tmp_path / "xdg" / "hipkern" / "jit").resolve()


def test_directories_made_above_the_cache_are_private_whatever_the_umask(tmp_path, monkeypatch):
    """mkdir(parents=True) made the parents by the umask (0777 under umask 0), and the check then refused them."""
    monkeypatch.setenv("HIPKERN_JIT_DIR", str(tmp_path / "a" / "b" / "jit"))
    _paths._env_root.cache_clear()
    old = os.umask(0)
    try:
        root = _paths.cache_root()
    finally:
        os.umask(old)
    for d in (tmp_path / "a", tmp_path / "a" / "b", root):
        assert d.stat().st_mode & 0o777 == 0o700, d


def test_a_module_pruned_before_it_loads_is_built_again(jit_dir, tiny_root, tmp_path):
    """Another install's --prune (sharing the cache) may remove a module between its build and its load: the
    load builds it again, as the README says, instead of calling the file damaged."""
    toolchain_or_skip("sm_90", tmp_path)
    spec = tiny_spec(tiny_root)
    first = jit.build(spec, "sm_90")
    shutil.rmtree(first.path.parent)
    mod = builder.load_built(spec, "sm_90", first)
    assert first.path.is_file() and mod.wave_size() == 32


def test_prune_removes_killed_builds_folders_of_current_keys(jit_dir, tiny_root, tmp_path):
    """A killed --force or HIPKERN_REBUILD build leaves .tmp-<name>-<current key>-*: prune takes those too (under
    the key's lock), and keeps the module and its lock."""
    toolchain_or_skip("sm_90", tmp_path)
    cur = jit.build(tiny_spec(tiny_root), "sm_90").path.parent
    killed = cur.parent / f".tmp-{cur.name}-4242-99"
    killed.mkdir()
    (killed / "tiny.so").write_bytes(b"half a module")
    assert [p.name for p in builder.prune([tiny_spec(tiny_root)], "sm_90")] == [killed.name]
    assert not killed.exists() and (cur / "tiny.so").is_file() and (cur.parent / f"{cur.name}.lock").exists()
