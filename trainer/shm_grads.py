"""Averaging the replicated ranks' gradients through shared memory, when every rank is on one host.

gloo carries a CPU all-reduce over TCP even between processes on one machine, and its threads
take their time from the cores the backward runs on. On the short colocated workload of
bench/trainer_vs_trl.py (two one-core ranks, the `small` policy's 66 MiB of fp32 gradients) the
training phase took 0.58 s with gloo's all-reduce and 0.50 s with none at all (AMD EPYC Zen 4).

Here each rank's gradients live in its slot of one /dev/shm segment: `zero_grad` points every
parameter's ``.grad`` at its place in the slot (as DDP's ``gradient_as_bucket_view``), so the
backward accumulates into shared memory itself and nothing is copied in or out. `wait` is then
a reduce-scatter and an all-gather in memory: the ranks meet (every slot holds its rank's sum),
rank r adds part r of every slot in rank order, divides by the world size and writes the result
into part r of every slot; they meet again, and each rank's own slot holds the average, the same
bits on every rank (for two ranks the same bits as gloo's sum and `GradientBuckets`' division).
Ranks meet through flags in the segment (a spin, then short sleeps), not through a collective.

`SharedGradients.open` checks that every rank sees the segment rank 0 made (the same host and the
same /dev/shm: a token written by rank 0, read back by everyone), that the memory is there
(`posix_fallocate`: a full /dev/shm is an error up front, not a SIGBUS later) and that the
machine orders stores as x86 does (the flags are plain stores). When any rank cannot, every rank
gets None and the reason, and the caller keeps gloo. The file is unlinked as soon as every rank
has mapped it: nothing is left behind whatever happens to the processes later.
"""

from __future__ import annotations

import contextlib
import os
import platform
import secrets
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

SHM_DIR = "/dev/shm"
LINE = 64  # bytes: one flag per cache line; each rank's part starts on one
PAGE = 4096
READY, DONE = 0, 1  # the two meetings of a `wait`
SPINS = 2000  # polls before a waiting rank starts to sleep between them


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class SharedGradients:
    """Gradients of ``params`` (one dtype) held in shared memory and averaged over ``world`` ranks
    on one host; see the module's docstring. The learner calls `zero_grad` before a step's first
    backward and `wait` before clipping; `arm` and `flush` are there so that it can treat this
    and `GradientBuckets` alike (nothing is launched during the backward here)."""

    def __init__(self, segment: Tensor, params: Sequence[nn.Parameter], rank: int, world: int,
                 timeout_s: float):
        self.params, self.rank, self.world, self.timeout_s = list(params), rank, world, timeout_s
        dtype = self.params[0].dtype
        numel = sum(p.numel() for p in self.params)
        flags_bytes, slot_bytes = _layout(self.params, world)
        self.flags = segment[:world * 2 * LINE].numpy().view(np.int64).reshape(world, 2, LINE // 8)
        slots = segment[flags_bytes:flags_bytes + world * slot_bytes].view(dtype)
        self.slots = slots.view(world, -1)  # [world, slot elements]; the gradients are the head
        self.mine = self.slots[rank, :numel]
        self.views: list[Tensor] = []
        offset = 0
        for p in self.params:
            self.views.append(self.mine[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        # rank r's part: whole cache lines, the last part shorter
        per = _round_up(-(-numel // world), LINE // self.slots.element_size())
        self.parts = [(min(r * per, numel), min((r + 1) * per, numel)) for r in range(world)]
        self.epoch = 0  # meetings so far of each kind (the flags only grow)

    @classmethod
    def open(cls, group: Any, params: Sequence[nn.Parameter], key: str
             ) -> tuple[SharedGradients | None, str]:
        """Every rank of ``group`` (a `DataParallelGroup`) calls it with its own copy of the same
        parameters; ``key`` names this segment among the group's others. Returns the reducer on
        every rank, or None on every rank and why not."""
        rank, world, store = group.rank, group.world, group.store
        reason = ""
        if group.backend != "gloo":
            reason = f"backend {group.backend}"
        elif platform.machine().lower() not in ("x86_64", "amd64"):
            reason = f"{platform.machine()} may reorder plain stores; the flags rely on x86's order"
        elif any(p.device.type != "cpu" for p in params):
            reason = "parameters not on the CPU"
        elif len({p.dtype for p in params}) != 1:
            reason = "parameters of several dtypes"
        if reason:  # the same on every rank: no exchange needed
            return None, reason
        flags_bytes, slot_bytes = _layout(params, world)
        nbytes = flags_bytes + world * slot_bytes
        token_at = flags_bytes - 16  # after the flags, before the first slot
        if rank == 0:
            path = os.path.join(SHM_DIR, f"yatt-grads-{os.getpid()}-{secrets.token_hex(6)}")
            token = secrets.token_bytes(16)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                    os.pwrite(fd, token, token_at)
                finally:
                    os.close(fd)
                store.set(f"{key}/segment", f"{path} {token.hex()}")
            except OSError as exc:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                store.set(f"{key}/segment", f"! rank 0: {exc}")
        path, _, shared = store.get(f"{key}/segment").decode().partition(" ")
        segment: Tensor | None = None
        if path == "!":
            reason = shared
        elif not os.path.exists(path):  # another host, or another /dev/shm
            reason = f"rank {rank}: no {path} here"
        else:
            try:
                storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
                segment = torch.empty(0, dtype=torch.uint8).set_(storage)
                if bytes(segment[token_at:token_at + 16].tolist()) != bytes.fromhex(shared):
                    reason, segment = f"rank {rank}: another segment under {path}", None
            except (OSError, RuntimeError) as exc:
                reason, segment = f"rank {rank}: {exc}", None
        store.set(f"{key}/ok/{rank}", reason)
        failures = [f for f in (store.get(f"{key}/ok/{r}").decode() for r in range(world)) if f]
        if rank == 0 and path != "!":
            os.unlink(path)  # every rank has mapped it or given up: the name is not needed now
        if failures:
            return None, "; ".join(dict.fromkeys(failures))
        assert segment is not None
        timeout = getattr(group, "timeout_s", 600.0)
        return cls(segment, params, rank, world, timeout), ""

    def zero_grad(self) -> None:
        """Every parameter's gradient: zeros, in this rank's slot (before a step's first backward)."""
        self.mine.zero_()
        for p, v in zip(self.params, self.views, strict=True):
            p.grad = v

    def arm(self) -> None:
        """Nothing to prepare: the gradients are averaged after the backward, in `wait`."""

    def flush(self) -> None:
        """Nothing to launch (see `arm`)."""

    def wait(self) -> None:
        """Average the gradients over the ranks, in place (every rank calls it once per step)."""
        for p, v in zip(self.params, self.views, strict=True):
            if p.grad is None:  # dropped since `zero_grad`: its gradient is still in the slot
                p.grad = v
            elif p.grad.data_ptr() != v.data_ptr():
                raise RuntimeError("a gradient was replaced outside shared memory (zero_grad with "
                                   "set_to_none, or an optimizer that swaps .grad): call "
                                   "SharedGradients.zero_grad before the backward")
        self.epoch += 1
        self._meet(READY)
        a, b = self.parts[self.rank]
        if b > a:
            acc = self.slots[0, a:b]
            for r in range(1, self.world):
                acc.add_(self.slots[r, a:b])
            acc.div_(self.world)
            for r in range(1, self.world):
                self.slots[r, a:b].copy_(acc)
        self._meet(DONE)

    def _meet(self, which: int) -> None:
        """Wait until every rank has reached this meeting of this step."""
        flags = self.flags[:, which, 0]
        flags[self.rank] = self.epoch
        spins = 0
        deadline = None
        while (flags < self.epoch).any():
            spins += 1
            if spins <= SPINS:
                continue
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.timeout_s
            elif now > deadline:
                late = [r for r in range(self.world) if flags[r] < self.epoch]
                raise RuntimeError(f"shared-memory gradient average: ranks {late} did not arrive "
                                   f"within {self.timeout_s:.0f} s")
            time.sleep(1e-4)


def _layout(params: Sequence[nn.Parameter], world: int) -> tuple[int, int]:
    """Bytes of the flags (with the token) and of one rank's slot."""
    flags_bytes = _round_up(world * 2 * LINE + 16, PAGE)
    numel = sum(p.numel() for p in params)
    slot_bytes = _round_up(numel * params[0].element_size(), PAGE)
    return flags_bytes, slot_bytes
