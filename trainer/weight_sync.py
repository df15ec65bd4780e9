"""Moving the policy's weights from the trainer to its rollout engines: the one module for it.

Two ways, chosen by where an engine lives (DESIGN.md §3.3):

- **in place** — the engine shares the trainer's process and device (colocate): the learner's
  tensors go straight into the engine's loader (`load_in_place`), no copy beyond the loader's own.
- **broadcast** — the engines live on other devices or nodes (disaggregated, the single-controller
  baseline): one bucketed collective broadcast per step from the source training rank to every
  rollout engine (`WeightBroadcaster` → `WeightReceiver`), over a torch.distributed group of its
  own (`WeightSyncGroup`: gloo on CPU, NCCL on GPU; its own TCPStore port and prefix, apart from
  the training ranks' all-reduce group). One copy per step for all engines, never one per
  controller, never through the Ray object store.

What goes in is an iterator of ``(name, tensor)`` in the policy's HF names, consumed once and in
order: a plain learner passes its state dict; a sharded (FSDP) learner yields
``param.full_tensor()`` one parameter at a time, so only one gathered parameter (plus one bucket)
is alive at a time. The gather is a collective across the training ranks, so with a sharded
learner every training rank iterates its weights — `drain_weights` does it on the ranks that
send nowhere.

Wire format of one broadcast (every buffer a 1-D tensor on the group's device):
  for each bucket:  header int64[3] = (version, meta_len, payload_len)
                    payload uint8[payload_len] = JSON metadata | padding | tensor bytes
  then:             header (version, -1, 0) — the end of this version
Receivers learn bucket sizes from the headers, so sender and receivers share no layout in
advance and a learner may change which tensors it sends. Each receiver loads a bucket into its
engine as it arrives: the engine's loader pulls from a lazy iterator that receives the next
bucket only when it has used the last one.

Fresh pages: on a CPU group a bucket the size of a small policy (35 MB) is above glibc's mmap
threshold, so a buffer allocated for it comes from a new mapping whose pages the kernel faults
in, zeroed, on first touch: the sender's packing and the receiver's transfer paid for that on
every round (19 against 4 ms to cast the `small` policy into a fresh buffer and into a used one,
on one Zen 4 core), while the other side waited. The sender packs into one buffer it keeps; the
receiver, whose loader may keep views of a bucket, takes a fresh buffer per bucket but touches
the next round's right after a round, when nobody waits on it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from trainer import rendezvous

__all__ = ["SyncStats", "TrainerWeightSync", "WeightBroadcaster", "WeightReceiver",
           "WeightSyncGroup", "bucket_weights", "connect_broadcast", "drain_weights",
           "load_in_place", "sampler_wire_dtype"]

# tensor offsets inside a payload are multiples of this (a uint8 slice can then be viewed as
# any dtype, and GPU copies stay aligned)
_ALIGN = 64
_END = -1


@dataclass
class SyncStats:
    """What one weight movement did: for metrics (`weight_sync/*`) and the phase timeline."""

    version: int
    bytes: int = 0  # tensor bytes moved once (a broadcast's payload, not times its receivers)
    tensors: int = 0
    buckets: int = 0
    wait_s: float = 0.0  # before the first byte: receivers still busy (e.g. generating)
    start: float = 0.0  # wall clock of the first byte moved
    end: float = 0.0
    bucket_s: list[float] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.start)

    def metrics(self) -> dict[str, float]:
        """`weight_sync/*` figures of this movement."""
        out = {"weight_sync/bytes": float(self.bytes), "weight_sync/buckets": float(self.buckets)}
        if self.seconds > 0:
            out["weight_sync/bytes_per_s"] = self.bytes / self.seconds
        if self.bucket_s:
            out["weight_sync/bucket_s_mean"] = sum(self.bucket_s) / len(self.bucket_s)
            out["weight_sync/bucket_s_max"] = max(self.bucket_s)
        return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def bucket_weights(named: Iterable[tuple[str, torch.Tensor]],
                   bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of `named` of at most `bucket_bytes` tensor bytes each, in order
    (a tensor larger than a bucket travels alone). Lazy: pulls one tensor past each bucket."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        n = _aligned(_nbytes(tensor))
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
    if bucket:
        yield bucket


def load_in_place(engine: Any, named: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncStats:
    """Load the learner's tensors into a sampler that shares its process and device (colocate):
    the engine's loader reads them directly; nothing is copied on the way."""
    stats = SyncStats(version=version, start=time.time())

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named:
            stats.bytes += _nbytes(tensor)
            stats.tensors += 1
            yield name, tensor.detach()

    engine.update_weights(counted())  # a sleeping engine wakes its weights for it, not its cache
    stats.end = time.time()
    return stats


def sampler_wire_dtype(cfg: Any, device_type: str) -> torch.dtype:
    """The dtype a run's rollout engines compute in (`trainer.precision.sampler_dtype`; on a
    ``gpu`` or ``cpu`` device), in which the policy is broadcast to them: a bf16 sampler's weights
    travel in half the bytes of the learner's fp32 ones, cast once by the sender instead of by
    every receiver's loader (measured 2026-12-07, `small` model, disaggregated on 2 cores: 70 MB
    in 67 ms a step before)."""
    from trainer.precision import sampler_dtype

    return getattr(torch, sampler_dtype(cfg, "cuda" if device_type == "gpu" else "cpu"))


def drain_weights(named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Iterate a learner's weights without sending them: a training rank that is not the source
    still takes part in a sharded learner's per-parameter gathers, in the same order."""
    for _ in named:
        pass


class WeightSyncGroup:
    """The broadcast group: rank 0 is the source training rank, ranks 1.. are rollout engines.

    Built on its own TCPStore (hosted by rank 0) and key prefix, so it never meets the training
    ranks' all-reduce group nor the default group an in-process vLLM engine initializes.
    """

    def __init__(self, master_addr: str, master_port: int, rank: int, world: int, *,
                 backend: str = "gloo", timeout_s: float = 600.0):
        import torch.distributed as dist

        if world < 2:
            raise ValueError("a weight broadcast needs a source and at least one receiver")
        timeout = timedelta(seconds=timeout_s)
        self.rank, self.world, self.backend = rank, world, backend
        self.store = rendezvous.store(master_addr, master_port, rank, world, timeout_s=timeout_s)
        prefixed = dist.PrefixStore("yatt-weights", self.store)
        if backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.pg: Any = dist.ProcessGroupNCCL(prefixed, rank, world)
        else:
            self.device = torch.device("cpu")
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world, timeout)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """`tensor` from rank 0 to every rank, in place (blocks until done here)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self.pg.broadcast([tensor], opts).wait()

    def close(self) -> None:
        """Drop the group (its peers' next collective fails instead of hanging)."""
        self.pg = None


class WeightBroadcaster:
    """The source side: one bucketed broadcast of the policy per version, to every receiver."""

    def __init__(self, group: WeightSyncGroup, *, bucket_bytes: int):
        if group.rank != 0:
            raise ValueError("the broadcaster is rank 0 of its group")
        self.group = group
        self.bucket_bytes = bucket_bytes
        self._round = 0
        # every bucket is packed into this one buffer, kept from round to round (see "Fresh
        # pages" in the module's docstring)
        self._buffer: torch.Tensor | None = None

    def _payload(self, size: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < size:
            self._buffer = None  # the old one freed before its successor is allocated
            self._buffer = torch.empty(size, dtype=torch.uint8, device=self.group.device)
        return self._buffer[:size]

    def _wait_for_receivers(self, still_waiting: Callable[[], None] | None) -> None:
        """Block until every receiver has entered `receive` for this round; between polls,
        `still_waiting()` may raise (a receiver died) instead of letting the broadcast hang."""
        keys = [f"ready/{self._round}/{r}" for r in range(1, self.group.world)]
        while True:
            try:
                self.group.store.wait(keys, timedelta(seconds=1))
                break
            except RuntimeError:  # the store's wait timed out: ask whether to keep waiting
                if still_waiting is not None:
                    still_waiting()
        for k in keys:
            self.group.store.delete_key(k)

    def broadcast(self, version: int, named: Iterable[tuple[str, torch.Tensor]], *,
                  still_waiting: Callable[[], None] | None = None,
                  dtype: torch.dtype | None = None) -> SyncStats:
        """Send `named` as policy `version` to every receiver; returns when all have loaded it.

        ``dtype``: floating-point tensors travel in it, cast while packed (the receivers'
        engines compute in it and would cast them on load anyway); other tensors as they are.
        """
        stats = SyncStats(version=version)
        t = time.time()
        self._wait_for_receivers(still_waiting)
        stats.start = time.time()
        stats.wait_s = stats.start - t
        device = self.group.device
        for bucket in bucket_weights(named, self.bucket_bytes):
            b0 = time.time()
            entries, wire, offset = [], [], 0
            for name, tensor in bucket:
                sent = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
                entries.append([name, str(sent).removeprefix("torch."), list(tensor.shape), offset])
                wire.append(sent)
                offset = _aligned(offset + tensor.numel() * sent.itemsize)
            meta = json.dumps(entries).encode()
            data_start = _aligned(len(meta))
            payload = self._payload(data_start + offset)  # sent before the next is packed
            payload[: len(meta)].copy_(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
            for (_name, tensor), entry, sent in zip(bucket, entries, wire, strict=True):
                at = data_start + entry[3]
                nbytes = tensor.numel() * sent.itemsize
                # copied (and cast, where `dtype` asks) straight into the payload
                payload[at : at + nbytes].view(sent).copy_(tensor.detach().reshape(-1))
                stats.bytes += nbytes
            self.group.broadcast(torch.tensor([version, len(meta), payload.numel()],
                                              dtype=torch.int64, device=device))
            self.group.broadcast(payload)
            stats.tensors += len(bucket)
            stats.buckets += 1
            stats.bucket_s.append(time.time() - b0)
        self.group.broadcast(torch.tensor([version, _END, 0], dtype=torch.int64, device=device))
        stats.end = time.time()
        self._round += 1
        return stats


class WeightReceiver:
    """A rollout engine's side: takes each broadcast and loads it bucket by bucket."""

    def __init__(self, group: WeightSyncGroup):
        if group.rank == 0:
            raise ValueError("rank 0 of a weight-sync group is the source, not a receiver")
        self.group = group
        self._round = 0
        # buffers for the next round's buckets, one per bucket of the last round's sizes: each
        # fresh, since the loader may keep views of the last ones, but with its pages touched
        # after a round rather than during the next one's transfer ("Fresh pages" above; CPU)
        self._spares: list[torch.Tensor | None] = []

    def _buffer(self, bucket: int, size: int) -> torch.Tensor:
        spare = self._spares[bucket] if bucket < len(self._spares) else None
        if spare is not None and spare.numel() == size:
            self._spares[bucket] = None
            return spare
        return torch.empty(size, dtype=torch.uint8, device=self.group.device)

    def _prepare_spares(self, sizes: list[int]) -> None:
        self._spares = []
        if self.group.device.type == "cpu":
            self._spares = [torch.empty(n, dtype=torch.uint8).fill_(0) for n in sizes]

    def _header(self) -> tuple[int, int, int]:
        header = torch.zeros(3, dtype=torch.int64, device=self.group.device)
        self.group.broadcast(header)
        version, meta_len, payload_len = (int(x) for x in header.tolist())
        return version, meta_len, payload_len

    def receive(self, load: Callable[[Iterable[tuple[str, torch.Tensor]]], None]) -> SyncStats:
        """Take the next broadcast, handing its tensors to `load` (an engine's `update_weights`)
        as each bucket arrives; returns when the whole version is loaded."""
        self.group.store.set(f"ready/{self._round}/{self.group.rank}", "1")
        self._round += 1
        stats = SyncStats(version=-1)
        done = False
        sizes: list[int] = []

        def arriving() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal done
            while True:
                version, meta_len, payload_len = self._header()
                if not stats.start:
                    stats.start, stats.version = time.time(), version
                elif version != stats.version:
                    raise RuntimeError(f"weight broadcast mixed versions {stats.version} and {version}")
                if meta_len == _END:
                    done = True
                    return
                b0 = time.time()
                # a fresh buffer per bucket: the loader may keep views
                payload = self._buffer(len(sizes), payload_len)
                sizes.append(payload_len)
                self.group.broadcast(payload)
                entries = json.loads(bytes(payload[:meta_len].cpu().numpy()))
                data_start = _aligned(meta_len)
                stats.buckets += 1
                stats.bucket_s.append(time.time() - b0)
                for name, dtype, shape, offset in entries:
                    dt = getattr(torch, dtype)
                    numel = 1
                    for s in shape:
                        numel *= s
                    at = data_start + offset
                    nbytes = numel * dt.itemsize
                    stats.bytes += nbytes
                    stats.tensors += 1
                    yield name, payload[at : at + nbytes].view(dt).view(shape)

        incoming = arriving()
        try:
            load(incoming)
        except Exception:
            if not done:  # take the rest anyway, so the source is not left blocked mid-broadcast
                try:
                    for _ in incoming:
                        pass
                except Exception:
                    pass
            raise
        if not done:  # the loader stopped early: take the rest so the group stays in step
            leftover = sum(1 for _ in incoming)
            raise RuntimeError(f"the engine's loader stopped before the end of the weights "
                               f"({leftover} tensors left unread)")
        stats.end = time.time()
        self._prepare_spares(sizes)  # after the round: the source is no longer waiting on us
        return stats


# ---------------------------------------------------------------------- the trainer's side, on Ray


class TrainerWeightSync:
    """A training rank's end of weight movement: in place into its own sampler (colocate) and, on
    the source rank, one broadcast to every rollout worker of the run (a Ray actor with
    `receive_weights`, see trainer.controller.RolloutWorker)."""

    def __init__(self, *, device: int, engine: Any = None, bucket_bytes: int,
                 wire_dtype: torch.dtype | None = None):
        self.device = device
        self.engine = engine
        self.bucket_bytes = bucket_bytes
        # the policy's floating-point tensors travel to the rollout workers in the dtype their
        # engines compute in (`sampler_wire_dtype`); the frozen reference travels as it is, since
        # the workers' copy of it computes at the learner's precision
        self.wire_dtype = wire_dtype
        self.broadcaster: WeightBroadcaster | None = None
        self.receivers: list[Any] = []
        self._receiving: list[Any] = []  # this round's receive_weights calls
        self._pending: list[Any] = []  # receive calls whose spans are not collected yet

    def open_broadcast(self, master_addr: str, master_port: int, receivers: list[Any], *,
                       backend: str) -> None:
        """Become rank 0 of the broadcast group whose other ranks are `receivers`, in order."""
        group = WeightSyncGroup(master_addr, master_port, 0, len(receivers) + 1, backend=backend)
        self.broadcaster = WeightBroadcaster(group, bucket_bytes=self.bucket_bytes)
        self.receivers = list(receivers)

    @property
    def has_destination(self) -> bool:
        return self.engine is not None or self.broadcaster is not None

    def _receivers_alive(self) -> None:
        import ray

        done, _ = ray.wait(self._receiving, num_returns=len(self._receiving), timeout=0)
        for ref in done:
            ray.get(ref)  # a receiver that died raises here instead of hanging the broadcast

    def push(self, version: int, weights: Callable[[], Iterable[tuple[str, torch.Tensor]]], *,
             reference: bool = False) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Move policy `version` to this rank's destinations; `weights()` yields it by HF name.
        With ``reference``, the frozen reference instead, to the rollout workers only (their
        `receive_reference`; once per run, `placement.reference_on_rollout`).

        Returns the step's `weight_sync/*` metrics and this device's phase spans
        (`weight_sync`; `rollout_wait` while receivers finish the rollout they are generating).
        """
        metrics: dict[str, float] = {}
        spans: list[dict[str, Any]] = []
        moved: list[SyncStats] = []
        if self.engine is not None and not reference:
            moved.append(load_in_place(self.engine, weights(), version))
        if self.broadcaster is not None:
            self._receiving = [(w.receive_reference if reference else w.receive_weights).remote()
                               for w in self.receivers]
            self._pending.extend(self._receiving)
            stats = self.broadcaster.broadcast(version, weights(), still_waiting=self._receivers_alive,
                                               dtype=None if reference else self.wire_dtype)
            if stats.wait_s > 0:
                spans.append(self._span("rollout_wait", stats.start - stats.wait_s, stats.start))
            moved.append(stats)
            metrics["weight_sync/receivers"] = float(len(self.receivers))
        for stats in moved:
            spans.append(self._span("weight_sync", stats.start, stats.end))
            for k, v in stats.metrics().items():
                metrics[k] = metrics.get(k, 0.0) + v if k in ("weight_sync/bytes",
                                                              "weight_sync/buckets") else v
        return metrics, spans

    def receiver_spans(self) -> list[dict[str, Any]]:
        """The receivers' own `weight_sync` spans of finished rounds (never blocks)."""
        import ray

        if not self._pending:
            return []
        done, self._pending = ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
        return list(ray.get(done))

    def _span(self, phase: str, start: float, end: float) -> dict[str, Any]:
        return {"device": self.device, "phase": phase, "start": start, "end": end}


def connect_broadcast(source: Any, receivers: list[Any], *, backend: str,
                      timeout_s: float = 600.0) -> None:
    """Form the broadcast group between a source training-rank actor (`address`,
    `open_weight_broadcast`) and rollout-worker actors (`open_weight_sync`): all join at once."""
    import ray

    addr, port = ray.get(source.address.remote(), timeout=timeout_s)  # its store bound already
    world = len(receivers) + 1
    ray.get([source.open_weight_broadcast.remote(addr, port, receivers, backend)]
            + [w.open_weight_sync.remote(addr, port, i + 1, world, backend)
               for i, w in enumerate(receivers)], timeout=timeout_s)
