"""Where the kernel sources and the JIT cache live."""
from __future__ import annotations

import functools
import os
import stat
from pathlib import Path

from .platform import JitError


def csrc_root() -> Path:
    """The HIP sources: packaged as hipkern/_csrc in a wheel, csrc_hip/ in a checkout."""
    pkg = Path(__file__).resolve().parents[1]
    for cand in (pkg / "_csrc", pkg.parent / "csrc_hip"):
        if (cand / "include" / "hipkern" / "platform.h").is_file():
            return cand
    raise JitError(f"hipkern's HIP sources are missing (looked in {pkg / '_csrc'} and {pkg.parent / 'csrc_hip'})")


@functools.lru_cache(maxsize=None)
def _env_root(env: str) -> Path:
    """HIPKERN_JIT_DIR's directory: ``~`` expanded, a relative path taken from the directory the process was in at
    its first use (a later chdir does not start a second cache)."""
    return Path(env).expanduser().absolute()


def cache_root() -> Path:
    """HIPKERN_JIT_DIR (``~`` expanded, made absolute), else $XDG_CACHE_HOME/hipkern/jit (default ~/.cache/hipkern/jit;
    a relative XDG_CACHE_HOME is ignored, as the XDG specification says).

    Created 0700, and so are the directories above it that it makes. It must belong to this user and be writable
    by no one else, and so must every directory above it but for sticky ones such as /tmp (group-writable ones
    are taken): modules are loaded from it, so a directory others can write or replace is refused rather than
    used. The arch and module folders are checked too before a module is loaded (builder.build). Returned
    resolved: a symbolic link on the way (another user's link in /tmp, say) is followed once, when it is checked,
    and never again, so re-pointing it later leads nowhere.
    """
    env = os.environ.get("HIPKERN_JIT_DIR")
    if env:
        root = _env_root(env)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
        root = Path(base) / "hipkern" / "jit"
    try:
        for d in reversed(root.parents):  # (mkdir(parents=True) would make them by the umask)
            if not d.exists():
                d.mkdir(mode=0o700, exist_ok=True)
        root.mkdir(mode=0o700, exist_ok=True)
        st = root.stat()
    except OSError as e:  # a file of that name, a parent that cannot be made, no permission
        where = f"HIPKERN_JIT_DIR={env}" if env else f"JIT cache {root}"
        raise JitError(f"{where} is not a directory that can be used as the JIT cache ({e}); "
                       "set HIPKERN_JIT_DIR to a private directory") from e
    check_private(root, st)
    _check_ancestors(root)
    return root.resolve()


def check_private(d: Path, st: os.stat_result | None = None) -> None:
    """A JitError unless directory `d` of the cache belongs to this user and is writable by no one else."""
    st = st or d.stat()
    if st.st_uid != os.getuid():
        raise JitError(f"JIT cache {d} belongs to uid {st.st_uid}, not to this user ({os.getuid()}); "
                       "set HIPKERN_JIT_DIR to a private directory")
    if st.st_mode & 0o022:
        raise JitError(f"JIT cache {d} is writable by group or others (mode {oct(st.st_mode & 0o777)}); "
                       f"modules are never loaded from such a directory: chmod 700 {d} or set HIPKERN_JIT_DIR")


def _check_ancestors(root: Path) -> None:
    """Every directory above the cache, as named and as resolved (a link's target), must belong to root or this
    user and be writable by no one else, unless sticky (as /tmp): whoever could write one could move the cache
    aside and put a folder of their own in its place. Group-writable ones are taken (a umask of 002 makes
    ~/.cache so, for the user's own group)."""
    for d in dict.fromkeys([*root.parents, *root.resolve().parents]):
        st = d.stat()
        if st.st_uid not in (0, os.getuid()) or (st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX):
            raise JitError(f"JIT cache {root}: the directory {d} above it belongs to uid {st.st_uid} or is "
                           f"writable by others (mode {oct(st.st_mode & 0o7777)}), who could replace the cache; "
                           "set HIPKERN_JIT_DIR to a private directory under your home")
