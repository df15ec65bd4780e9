"""trainer.host_memory: glibc's thresholds fixed, seen through what malloc then does.

Each case runs in a fresh interpreter: the thresholds are process state, set once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# 16 MiB: over glibc's starting mmap threshold (128 KiB), under the steady one (32 MiB).
# mallinfo2().hblkhd: bytes held in mmapped blocks right now.
PROBE = """
import ctypes, json, sys
from trainer.host_memory import steady_heap

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
applied = steady_heap()
before = libc.mallinfo2().hblkhd
p = libc.malloc(16 * 2**20)
ctypes.memset(p, 1, 16 * 2**20)
mmapped = libc.mallinfo2().hblkhd - before
libc.free(p)
arena_after_free = libc.mallinfo2().arena
print(json.dumps({"applied": applied, "mmapped": mmapped, "arena_after_free": arena_after_free}))
"""


def _is_glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError, AttributeError):  # no such name off glibc
        return False


glibc = pytest.mark.skipif(not _is_glibc(), reason="glibc malloc only")


def _probe(**env: str) -> dict:
    base = {k: v for k, v in os.environ.items()
            if k not in ("YATT_STEADY_HEAP", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                         cwd=ROOT, env={**base, "PYTHONPATH": str(ROOT), **env})
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_steady_heap_serves_a_16_mib_block_from_the_heap_and_keeps_it():
    steady = _probe()
    assert steady["applied"] is True
    assert steady["mmapped"] == 0  # from the heap, not a fresh mapping
    # freed, the block stays in the arena for the next step instead of going back to the kernel
    assert steady["arena_after_free"] >= 16 * 2**20


@glibc
def test_glibc_dynamic_thresholds_when_asked_or_when_the_user_set_their_own():
    for env in ({"YATT_STEADY_HEAP": "0"}, {"MALLOC_TRIM_THRESHOLD_": "131072"}):
        dynamic = _probe(**env)
        assert dynamic["applied"] is False, env
        assert dynamic["mmapped"] >= 16 * 2**20, env  # glibc's own threshold: a fresh mapping
