"""Giving memory back after a client's session ends: ``serve-tinker`` runs for days, and each
training run holds a model copy, its sampling copy, adapter snapshots and Adam's moments.

Dropping the last reference frees the tensors, but two things keep the process's resident size
up afterwards: reference cycles (a sampling client refers to its backend and back), which only
the cycle collector frees, and glibc's allocator, which keeps freed heap pages mapped for reuse
instead of returning them to the system. :func:`give_back` runs the collector and then asks
glibc to return what it can (``malloc_trim``); elsewhere (musl, macOS) the second step is
skipped -- the memory is still reused by the next run, only not shown as free.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from functools import cache

__all__ = ["give_back", "rss_bytes"]


@cache
def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """glibc's ``malloc_trim``, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None


def give_back() -> None:
    """Free unreachable objects (cycles included) and return free heap pages to the system."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def rss_bytes() -> int:
    """This process's resident set size (Linux ``/proc``; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as fh:
            pages = int(fh.read().split()[1])
    except OSError:
        return 0
    import os

    return pages * os.sysconf("SC_PAGE_SIZE")
