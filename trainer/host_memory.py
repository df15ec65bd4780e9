"""A steady heap for the trainer's processes: glibc malloc's thresholds fixed at start.

glibc moves its mmap threshold up to the size of the largest mmapped block freed so far, and
trims the top of the heap (gives pages back to the kernel) when more than twice that is free. A
trainer process allocates blocks of many sizes (the rollout engine's decode buffers, each
micro-batch's activations, whose sizes follow the batch's lengths), so which blocks come fresh
from the kernel — zero-filled, one page fault per 4 KiB page on first touch — depends on what
the previous steps happened to allocate. Measured on the short trainer_vs_trl workload (2 cores,
colocate, the same 1,000 tokens generated per step in every run): the rollout took 0.79–0.80 s
(median over the steps of a run) after steps that trained on groups dealt by
`train.balance_ranks`, 0.65–0.70 s after steps that trained on the ranks' own groups, and
0.65–0.74 s either way with the thresholds fixed (docs/benchmarks.md, "A steady heap").

Fixed here: blocks up to 32 MiB (glibc's own ceiling for the dynamic threshold) always come from
the heap, and up to 1 GiB of free heap top is kept rather than trimmed, so a step reuses the
pages of the step before. Blocks over 32 MiB are still mmapped, as before. A threshold the user
set (``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` or ``GLIBC_TUNABLES``) is left
alone, as is any libc other than glibc; ``YATT_STEADY_HEAP=0`` keeps glibc's dynamic thresholds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "steady_heap"]

MMAP_THRESHOLD = 32 * 2**20
TRIM_THRESHOLD = 2**30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h

_applied: bool | None = None


def steady_heap() -> bool:
    """Fix this process's malloc thresholds (once; later calls return the first answer).

    Returns whether they were set: False off Linux/glibc, where the user chose their own, or
    with ``YATT_STEADY_HEAP=0``.
    """
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    user = ({"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & set(os.environ)
            or "malloc" in os.environ.get("GLIBC_TUNABLES", ""))
    if os.environ.get("YATT_STEADY_HEAP", "1") == "0" or user or sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
    return _applied
