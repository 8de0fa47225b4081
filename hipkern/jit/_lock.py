"""An inter-process lock on a file (flock): released by the kernel when its holder dies, so the
lock of a killed process never needs cleaning up. Also excludes threads of one process."""
from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import threading
import time

from .platform import JitError

log = logging.getLogger("hipkern.jit")
_thread_locks: dict = {}
_guard = threading.Lock()


# A wait longer than this is said once on stderr (a warning: hipkern installs no log handler, so the
# logging module's last-resort handler prints it), naming the process it waits for.
TELL_AFTER_S = 5.0


@contextlib.contextmanager
def file_lock(path, what: str):
    """Hold `path` flock'ed; one HIPKERN_JIT_LOCK_TIMEOUT for the whole wait, the other threads' turns included."""
    timeout = _timeout()
    deadline = time.monotonic() + timeout
    with _guard:
        tlock = _thread_locks.setdefault(str(path), threading.Lock())
    # flock is per open file, so threads of this process queue here first
    if not tlock.acquire(timeout=-1 if timeout >= threading.TIMEOUT_MAX else timeout):
        raise JitError(f"timed out after {timeout:.0f}s waiting for the lock {path} ({what}) behind another thread "
                       "of this process, which holds it or waits for it too (HIPKERN_JIT_LOCK_TIMEOUT)")
    try:
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)  # (a planted link is no lock)
            try:
                _acquire(fd, path, what, timeout, deadline)
            except BaseException:
                os.close(fd)
                raise
            if _same_file(fd, path):
                break
            # the file was unlinked (hipkern.build --prune removes old keys' locks) while we waited on it: a new
            # one may be another process's lock, so take that one instead
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        try:
            os.pwrite(fd, f"{os.getpid():<20}".encode(), 0)  # (fixed width: no truncation of the file opened)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
    finally:
        tlock.release()


def _same_file(fd, path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _timeout() -> float:
    """HIPKERN_JIT_LOCK_TIMEOUT: the seconds to wait for a lock (default 1800); anything else is a JitError."""
    value = os.environ.get("HIPKERN_JIT_LOCK_TIMEOUT") or "1800"
    try:
        timeout = float(value)
    except ValueError:
        timeout = math.nan
    if not timeout >= 0:  # NaN too
        raise JitError(f"HIPKERN_JIT_LOCK_TIMEOUT={value} is not a number of seconds: expected a number >= 0, "
                       "such as 1800 (the default)")
    return timeout


def _acquire(fd, path, what, timeout: float, deadline: float):
    start = time.monotonic()
    told = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        except OSError as e:  # ENOLCK (NFS without a lock daemon), EOPNOTSUPP / ENOSYS (some FUSE or Lustre mounts)
            raise JitError(f"the JIT cache's file system cannot lock {path} ({what}): {e.strerror or e}; set "
                           "HIPKERN_JIT_DIR to a private directory on a local disk") from e
        now = time.monotonic()  # another process holds it: wait
        if not told and now - start >= TELL_AFTER_S:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            log.warning("hipkern: waiting for process %s, which is %s (lock %s; at most %.0f s, "
                        "HIPKERN_JIT_LOCK_TIMEOUT)", holder, what, path, timeout)
            told = True
        if now > deadline:
            raise JitError(f"timed out after {timeout:.0f}s waiting for the lock {path} ({what}) "
                           f"(HIPKERN_JIT_LOCK_TIMEOUT)") from None
        time.sleep(0.05)
