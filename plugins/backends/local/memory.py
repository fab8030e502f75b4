"""Giving freed memory back to the system: after a training step (the activations of a large
batch), and after a client's session ends (``serve-tinker`` runs for days, and each training run
holds a model copy, its sampling copy, adapter snapshots and Adam's moments).

glibc serves an allocation of at least its *mmap threshold* from a fresh mapping, returned to
the system when freed, and anything smaller from its heap, which it keeps. The threshold starts
at 128 KiB but rises (up to 32 MiB) each time a mapped block is freed, so after the first step
most activation tensors come from the heap and stay there. Measured on one ``forward_backward``
of SmolLM2 (LoRA, 16 rows x 400 tokens, ``benchmarks/multi_turn_step.py``'s shape): peak RSS
15.3 GB and 9.5 GB still resident after the step; with the threshold fixed at 1 MiB
(:func:`fix_mmap_threshold`, which the local backend calls) 9.8 GB and 1.1 GB, in the same time.

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

__all__ = ["fix_mmap_threshold", "give_back", "rss_bytes"]


#: glibc's ``M_MMAP_THRESHOLD`` (malloc.h); setting it also turns its dynamic raising off.
M_MMAP_THRESHOLD = -3
#: Tensors of 1 MiB and more (a SmolLM2 activation is 1-20 MB) are mapped and so returned when
#: freed; smaller ones stay on the heap, where reuse is cheap. 64 KiB measured the same.
MMAP_THRESHOLD_BYTES = 1 << 20


@cache
def _libc_function(name: str) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """A glibc function (``malloc_trim``, ``mallopt``), or None where the C library has none."""
    path = ctypes.util.find_library("c")
    if path is None:
        return None
    try:
        return getattr(ctypes.CDLL(path), name)
    except (OSError, AttributeError):
        return None


@cache
def fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD_BYTES` for this process, once; False
    where the C library is not glibc (nothing changes there)."""
    mallopt = _libc_function("mallopt")
    return mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def give_back() -> None:
    """Free unreachable objects (cycles included) and return free heap pages to the system."""
    gc.collect()
    trim = _libc_function("malloc_trim")
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
