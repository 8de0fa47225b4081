"""The JIT where its surroundings differ (an audit of 2026-11-29): compiler variables in the environment, a host
symbol defined nowhere, compilers behind one multi-call program, a read-only cache deriving gfx942's device
libraries, the derived library made again, a lock path that is a link. CPU only; the tests that compile need nvcc
or clang-19."""
import errno
import os

import pytest

from conftest import derived_device_libs_or_skip, tiny_spec, toolchain_or_skip
from hipkern import jit
from hipkern.jit import _lock, toolchain
from hipkern.jit.platform import JitError

pytestmark = pytest.mark.toolchain


@pytest.mark.parametrize("var", ["INCLUDES", "SYSTEM_INCLUDES", "LIBRARIES", "CUDAFE_FLAGS", "PTXAS_FLAGS",
                                 "GCC_EXEC_PREFIX", "COMPILER_PATH", "LIBRARY_PATH"])
def test_variables_the_compilers_read_from_the_environment_are_in_the_key(var, tiny_root, tmp_path, monkeypatch):
    """nvcc's nvcc.profile extends INCLUDES, LIBRARIES, PTXAS_FLAGS ... from the environment (INCLUDES=-DX=42 built
    another binary under the usual key, which later processes loaded without it); gcc reads the others."""
    tc = toolchain_or_skip("sm_90", tmp_path)
    for v in jit.builder.COMPILER_ENV:
        monkeypatch.delenv(v, raising=False)
    key = jit.module_key(tiny_spec(tiny_root), "sm_90", tc)
    monkeypatch.setenv(var, "-DPROBE=42")
    assert jit.module_key(tiny_spec(tiny_root), "sm_90", tc) != key
    monkeypatch.setenv(var, "")  # empty: as unset
    assert jit.module_key(tiny_spec(tiny_root), "sm_90", tc) == key


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_a_host_symbol_defined_nowhere_fails_the_build_not_the_first_call(arch, jit_dir, tiny_root, tmp_path):
    """A launcher calling a function no source defines linked (-shared allows undefined symbols), loaded lazily and
    passed `python -m hipkern.build`'s load check; its first call then killed the process ("symbol lookup error").
    Linked with -z defs it is a build error naming the symbol."""
    toolchain_or_skip(arch, tmp_path)
    src = tiny_root / "tiny" / "tiny.hip"
    text = src.read_text().replace("HK_EXPORT int hk_tiny_scale(void* x, int n, int device, void* stream) {\n",
                                   "namespace hk { int helper_defined_nowhere(int); }\n"
                                   "HK_EXPORT int hk_tiny_scale(void* x, int n, int device, void* stream) {\n"
                                   "  if (n == 12345) return hk::helper_defined_nowhere(n);\n")
    assert "helper_defined_nowhere(n)" in text
    src.write_text(text)
    with pytest.raises(JitError, match=r"(?s)building module tiny.*helper_defined_nowhere"):
        jit.build(tiny_spec(tiny_root), arch)
    assert not list((jit_dir / arch).glob("tiny-*/tiny.so"))


def test_compilers_linked_to_one_program_are_asked_their_version_apart(tmp_path, monkeypatch):
    """ccache's masquerade directory links gcc, g++ and clang++ to one program: the version memo keyed by the file
    they resolve to gave clang gcc's version (or the other way round, by which arch a process asked first)."""
    program = tmp_path / "multicall"
    program.write_text('#!/bin/sh\necho "$(basename "$0") version 1.0"\n')
    program.chmod(0o755)
    for name in ("gcc", "clang++-19"):
        (tmp_path / name).symlink_to(program)
    monkeypatch.setattr(toolchain, "_versions", {})
    assert toolchain._version(str(tmp_path / "gcc")) == "gcc version 1.0"
    assert toolchain._version(str(tmp_path / "clang++-19")) == "clang++-19 version 1.0"


def test_a_cache_that_cannot_take_the_device_libraries_lock_is_a_jit_error(tmp_path, monkeypatch):
    """The derivation's lock in a read-only cache raised a bare OSError (EROFS) out of find_toolchain, where a
    module's own build says what to do."""
    rocm, _ = derived_device_libs_or_skip(tmp_path, tmp_path / "probe")

    def read_only(path, what):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(toolchain, "file_lock", read_only)
    (tmp_path / "ro").mkdir()
    with pytest.raises(JitError, match=r"device libraries for gfx942: the JIT cache .*ro cannot be written "
                                       r".*HIPKERN_JIT_DIR"):
        toolchain._device_libs(rocm, "gfx942", tmp_path / "ro")


def test_the_derived_device_library_made_again_keeps_the_modules_keys(tmp_path):
    """The derived ISA library was fingerprinted by its time: derived again (the folder deleted, a cache copied
    without times) with the same bytes, every gfx942 module's key changed and every module was built again."""
    cache = tmp_path / "cache"
    _, libs = derived_device_libs_or_skip(tmp_path, cache)
    before = toolchain.find_toolchain("gfx942", cache).version
    derived = libs / "oclc_isa_version_942.bc"
    st = derived.stat()
    os.utime(derived, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert toolchain.find_toolchain("gfx942", cache).version == before
    derived.write_bytes(derived.read_bytes() + b"\0")  # other bytes: another library, another key
    assert toolchain.find_toolchain("gfx942", cache).version != before


def test_a_lock_path_that_is_a_symbolic_link_is_not_followed(tmp_path):
    """A link planted at a lock's path (the tuner's lock lived in the shared temporary directory) was followed and
    the file it named truncated; now the open fails and that file keeps its bytes."""
    victim = tmp_path / "precious.txt"
    victim.write_text("precious user data")
    (tmp_path / "x.lock").symlink_to(victim)
    with pytest.raises(OSError) as e:
        with _lock.file_lock(tmp_path / "x.lock", "testing"):
            pass
    assert e.value.errno == errno.ELOOP and victim.read_text() == "precious user data"
    with _lock.file_lock(tmp_path / "y.lock", "testing"):
        assert (tmp_path / "y.lock").read_text().strip() == str(os.getpid())
