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


@contextlib.contextmanager
def file_lock(path, what: str):
    with _guard:
        tlock = _thread_locks.setdefault(str(path), threading.Lock())
    with tlock:  # flock is per open file, so threads of this process queue here first
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            _acquire(fd, path, what)
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


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


def _acquire(fd, path, what):
    timeout = _timeout()
    start = time.monotonic()
    told = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if not told:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                log.info("waiting for process %s, which is %s", holder, what)
                told = True
            if time.monotonic() - start > timeout:
                raise JitError(f"timed out after {timeout:.0f}s waiting for the lock {path} ({what}) "
                               f"(HIPKERN_JIT_LOCK_TIMEOUT)") from None
            time.sleep(0.05)
