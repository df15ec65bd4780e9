"""Gradient all-reduce through shared memory, for data-parallel ranks on one host (CPU).

gloo moves a CPU all-reduce over TCP even between processes on the same machine: for the
`small` policy's 66 MiB of fp32 gradients that took 110 ms (one flat tensor) to 250 ms (a
collective per tensor) between two one-core ranks, about a third of each rank's training pass,
and its threads take that time from the cores the backward runs on (bench/allreduce.py). Ranks
that share a host can instead each write their gradients into a shared segment and sum everyone's
from there: one copy in, one read-add out, about a tenth of that time.

The segment holds two sets of one slot per rank (`slot_bytes` each). Tensors go through it in
packs of at most a slot (several small tensors in one pack, a large one in several): each rank
writes its pack into its slot of the current set, all meet at a barrier (the group's own gloo
barrier), then each sums every rank's slot in rank order into its own tensor, so every rank gets
the same bits. Packs alternate between the two sets, so one barrier per pack is enough: a rank
reaches pack k+2's write (into pack k's set) only past pack k+1's barrier, which every rank
reaches only once it has read pack k.

`SharedMemoryAllReduce.open` checks that every rank really sees the segment rank 0 made (same
host and the same /dev/shm: a token written by rank 0, read back by everyone) and that the
memory is there (`posix_fallocate`, so a full /dev/shm is an error up front, not a SIGBUS later);
it returns None, and the caller keeps gloo, when any rank cannot. The file is unlinked as soon
as every rank has mapped it: nothing is left behind, whatever happens to the processes later.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

SHM_DIR = "/dev/shm"
ALIGN = 64  # bytes: each tensor of a pack starts on a cache line (and any dtype's alignment)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class SharedMemoryAllReduce:
    """Sum lists of CPU tensors over `world` ranks on one host (see the module's docstring)."""

    def __init__(self, segment: Tensor, rank: int, world: int, slot_bytes: int,
                 barrier: Callable[[], None]):
        self.segment, self.rank, self.world = segment, rank, world
        self.slot_bytes, self.barrier = slot_bytes, barrier
        self.packs = 0  # packs reduced so far: which of the two sets the next one uses

    @classmethod
    def open(cls, store: Any, rank: int, world: int, *, key: str, slot_bytes: int,
             barrier: Callable[[], None]) -> tuple[SharedMemoryAllReduce | None, str]:
        """Every rank calls it with the same arguments (but `rank`); `key` prefixes what they
        exchange in `store`. Returns the reducer, or None on every rank when any of them cannot
        share rank 0's segment, and why not."""
        nbytes = 2 * world * slot_bytes
        segment: Tensor | None = None
        reason = ""
        if rank == 0:
            path = os.path.join(SHM_DIR, f"yatt-grads-{os.getpid()}-{secrets.token_hex(6)}")
            token = secrets.token_bytes(16)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                    os.pwrite(fd, token, 0)
                finally:
                    os.close(fd)
                store.set(f"{key}/segment", f"{path} {token.hex()}")
            except OSError as exc:
                reason = f"rank 0: {exc}"
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                store.set(f"{key}/segment", "")
        path, _, shared = store.get(f"{key}/segment").decode().partition(" ")
        if shared and not os.path.exists(path):  # another host, or another /dev/shm
            reason = f"rank {rank}: no {path} here"
        elif shared:
            try:
                storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
                segment = torch.empty(0, dtype=torch.uint8).set_(storage)
                if bytes(segment[:16].tolist()) != bytes.fromhex(shared):
                    reason, segment = f"rank {rank}: another segment under {path}", None
            except (OSError, RuntimeError) as exc:
                reason, segment = f"rank {rank}: {exc}", None
        store.set(f"{key}/ok/{rank}", "" if segment is not None else reason or "no segment")
        failures = [f for f in (store.get(f"{key}/ok/{r}").decode() for r in range(world)) if f]
        if rank == 0 and shared:
            os.unlink(path)  # every rank has mapped it (or given up): the name is no longer needed
        if failures:
            return None, "; ".join(failures)
        assert segment is not None
        return cls(segment, rank, world, slot_bytes, barrier), ""

    def _slot(self, set_index: int, rank: int) -> Tensor:
        start = (set_index * self.world + rank) * self.slot_bytes
        return self.segment[start : start + self.slot_bytes]

    def all_reduce_(self, tensors: list[Tensor]) -> None:
        """Replace each CPU tensor with its sum over the ranks. Every rank passes tensors of the
        same shapes and dtypes in the same order."""
        if any(t.device.type != "cpu" for t in tensors):
            raise ValueError("shared-memory all-reduce takes CPU tensors")
        strided = [(t, t.contiguous()) for t in tensors if not t.is_contiguous()]
        if strided:  # reduced as contiguous copies, written back
            copies = {id(t): c for t, c in strided}
            self.all_reduce_([copies.get(id(t), t) for t in tensors])
            for t, c in strided:
                t.copy_(c)
            return
        pack: list[tuple[Tensor, int]] = []  # (a flat piece of a tensor, its offset in the slot)
        used = 0
        for t in tensors:
            flat = t.view(-1)
            per = max(1, self.slot_bytes // flat.element_size())
            for start in range(0, flat.numel(), per):
                piece = flat[start : start + per]
                n = piece.numel() * piece.element_size()
                if used + n > self.slot_bytes:
                    self._reduce(pack)
                    pack, used = [], 0
                pack.append((piece, used))
                used = _aligned(used + n)
        if pack:
            self._reduce(pack)

    def _reduce(self, pack: list[tuple[Tensor, int]]) -> None:
        set_index = self.packs % 2
        self.packs += 1
        mine = self._slot(set_index, self.rank)
        for piece, offset in pack:
            n = piece.numel() * piece.element_size()
            mine[offset : offset + n].view(piece.dtype).copy_(piece)
        self.barrier()
        slots = [self._slot(set_index, r) for r in range(self.world)]
        for piece, offset in pack:
            n = piece.numel() * piece.element_size()
            theirs = [s[offset : offset + n].view(piece.dtype) for s in slots]
            # rank order on every rank: ((t0 + t1) + t2) + ...; ranks 0 and 1 start from their own
            # piece (t0 + t1 and t1 + t0 are the same bits), the others from slot 0
            if self.rank <= 1:
                piece.add_(theirs[1 - self.rank])
            else:
                piece.copy_(theirs[0]).add_(theirs[1])
            for r in range(2, self.world):
                piece.add_(theirs[r])
