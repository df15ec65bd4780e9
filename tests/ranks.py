"""Where the ranks a test spawns meet: rank 0 binds its store's port and publishes it in a file.

A port found free by the parent and bound by rank 0 later can be taken in between (in CI,
2026-12-06: rank 0 died at the bind and rank 1 waited in the rendezvous until its timeout). Rank 0
binds first (`trainer.rendezvous.host`, the OS picks the port); the group it then builds on that
port takes the bound store.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def meet(rank: int, path: str | Path, timeout_s: float = 600.0) -> int:
    """This run's port: rank 0 binds it and writes it to `path` (a file no other run uses), every
    other rank waits for it there."""
    path = Path(path)
    if rank == 0:
        from trainer import rendezvous

        _, port = rendezvous.host("127.0.0.1")
        tmp = path.with_suffix(".tmp")
        tmp.write_text(str(port))
        tmp.rename(path)  # whole or absent for the reader
        return port
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 published no port in {path} within {timeout_s:.0f} s")
        time.sleep(0.05)
    return int(path.read_text())


def leave(barrier: Any, *queues: Any) -> None:
    """End a rank process once every rank is done: past ``barrier`` (a callable every rank calls),
    with what it put on ``queues`` flushed, and without the interpreter's teardown, where gloo's
    threads are destroyed in no set order. In CI (2026-12-06) and here a rank aborted there now and
    then ("terminate called without an active exception", exit code -SIGABRT)."""
    import os
    import sys

    barrier()
    for q in queues:  # a multiprocessing queue's feeder thread must hand its items over first
        q.close()
        q.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
