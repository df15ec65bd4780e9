"""trainer.weight_sync without Ray: buckets, and the broadcast itself between real processes over
a real gloo group (the Ray and vLLM path is tests/integration/test_weight_sync.py)."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from trainer import rendezvous
from trainer.weight_sync import (
    WeightBroadcaster,
    WeightReceiver,
    WeightSyncGroup,
    bucket_weights,
)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(40, 16, generator=g),  # 2,560 bytes: a bucket of its own
        "layer.0.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "layer.0.bias": torch.randn(8, generator=g),
        "layer.1.weight": torch.randn(8, 8, generator=g).t(),  # not contiguous
        "steps": torch.tensor(seed, dtype=torch.int64),  # 0-dim
        "mask": torch.rand(5, generator=g) > 0.5,
    }


def test_buckets_keep_order_and_size_and_a_big_tensor_travels_alone():
    w = _weights(0)
    buckets = list(bucket_weights(w.items(), bucket_bytes=512))
    assert [n for b in buckets for n, _ in b] == list(w)
    assert buckets[0] == [("embed.weight", w["embed.weight"])]  # larger than a bucket: alone
    for b in buckets[1:]:
        assert sum(-(-t.numel() * t.element_size() // 64) * 64 for _, t in b) <= 512
    assert len(buckets) >= 3
    assert len(list(bucket_weights(w.items(), bucket_bytes=1 << 30))) == 1
    with pytest.raises(ValueError):
        list(bucket_weights(w.items(), bucket_bytes=0))


def _receiver(port: int, rank: int, world: int, rounds: list[str], out: Any) -> None:
    torch.set_num_threads(1)
    receiver = WeightReceiver(WeightSyncGroup("127.0.0.1", port, rank, world, timeout_s=300))
    for how in rounds:
        got: dict[str, torch.Tensor] = {}

        def load(named: Any, how: str = how, got: dict[str, torch.Tensor] = got) -> None:
            for i, (name, tensor) in enumerate(named):
                got[name] = tensor.clone()
                if how == "stop_early" and i == 1:
                    return  # a loader that gives up: the receiver must still drain the rest

        try:
            stats = receiver.receive(load)
            out.put((rank, stats.version, stats.buckets, stats.bytes, _as_bytes(got), None))
        except RuntimeError as exc:
            out.put((rank, None, None, None, _as_bytes(got), str(exc)))


def _as_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """Tensors as plain bytes: a tensor put on a torch queue lives in this process's shared
    memory, which is gone once the child exits."""
    buf = io.BytesIO()
    torch.save(tensors, buf)
    return buf.getvalue()


def test_broadcast_reaches_every_receiver_bit_exact_bucket_by_bucket():
    # this process is rank 0: its store is bound before the receivers start (trainer.rendezvous)
    _, port = rendezvous.host("127.0.0.1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    rounds = ["load", "stop_early", "load"]
    procs = [ctx.Process(target=_receiver, args=(port, r, 3, rounds, out)) for r in (1, 2)]
    for p in procs:
        p.start()
    try:
        sender = WeightBroadcaster(WeightSyncGroup("127.0.0.1", port, 0, 3, timeout_s=300),
                                   bucket_bytes=512)
        sent = {}
        for version, seed in ((7, 1), (8, 2), (9, 3)):
            sent[version] = _weights(seed)
            stats = sender.broadcast(version, sent[version].items())
            assert stats.version == version and stats.buckets >= 3
            assert stats.bytes == sum(t.numel() * t.element_size() for t in sent[version].values())
            assert stats.metrics()["weight_sync/bytes"] == stats.bytes
        results = [out.get(timeout=120) for _ in range(6)]
    finally:
        for p in procs:
            p.join(timeout=60)
    by_rank: dict[int, list[Any]] = {1: [], 2: []}
    for r in results:
        by_rank[r[0]].append(r[1:])
    for rank, rs in by_rank.items():
        (v1, buckets, nbytes, got1, err1), (_, _, _, _, err2), (v3, _, _, got3, err3) = rs
        assert err1 is None and err3 is None, (rank, err1, err3)
        assert v1 == 7 and v3 == 9 and buckets >= 3 and nbytes == sum(
            t.numel() * t.element_size() for t in sent[7].values())
        for version, raw in ((7, got1), (9, got3)):
            got = torch.load(io.BytesIO(raw))
            assert list(got) == list(sent[version])
            for name, tensor in sent[version].items():
                assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
                assert torch.equal(got[name], tensor), (rank, version, name)
        # the loader that stopped early is an error, and the group stays in step for round 3
        assert err2 is not None and "stopped before the end" in err2


def test_a_wire_dtype_sends_floating_tensors_cast_and_the_rest_as_they_are():
    # a bf16 sampler's weights travel in bf16: the receiver gets exactly what its loader's own
    # cast of the fp32 tensor would give, integer and boolean tensors untouched, half the bytes
    _, port = rendezvous.host("127.0.0.1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, 1, 2, ["load"], out))
    proc.start()
    try:
        sender = WeightBroadcaster(WeightSyncGroup("127.0.0.1", port, 0, 2, timeout_s=300),
                                   bucket_bytes=512)
        sent = _weights(4)
        stats = sender.broadcast(3, sent.items(), dtype=torch.bfloat16)
        _rank, version, _buckets, nbytes, raw, err = out.get(timeout=120)
    finally:
        proc.join(timeout=60)
    assert err is None and version == 3
    got = torch.load(io.BytesIO(raw))
    assert list(got) == list(sent)
    wire = 0
    for name, tensor in sent.items():
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
        wire += want.numel() * want.element_size()
    assert stats.bytes == nbytes == wire
    assert wire < sum(t.numel() * t.element_size() for t in sent.values()) * 0.6


def _keeping_receiver(port: int, rounds: int, out: Any) -> None:
    # a loader that keeps the views it is handed (as vLLM's in-place CPU loader may), unread
    # until every round is in: a receiver that filled a bucket buffer of an earlier round again
    # would change what they show
    torch.set_num_threads(1)
    receiver = WeightReceiver(WeightSyncGroup("127.0.0.1", port, 1, 2, timeout_s=300))
    kept: list[dict[str, torch.Tensor]] = []
    for _ in range(rounds):
        views: dict[str, torch.Tensor] = {}
        receiver.receive(lambda named, views=views: views.update(named))
        kept.append(views)
    # copied only now, after the last round (views of one buffer in several dtypes cannot be saved)
    out.put([_as_bytes({name: t.clone() for name, t in views.items()}) for views in kept])


def test_rounds_of_changing_sizes_arrive_whole_and_views_a_loader_kept_stay_valid():
    # the sender packs every round into one buffer it keeps (grown when a round needs more), the
    # receiver prepares the next round's buffers after each round: neither may leak one round
    # into another, whether the next round's buckets are the same sizes, larger or fewer
    _, port = rendezvous.host("127.0.0.1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    bigger = {**_weights(2), "embed.weight": torch.randn(90, 16)}  # a larger first bucket
    fewer = {"embed.weight": torch.randn(40, 16), "layer.0.bias": torch.randn(8)}
    rounds = [_weights(1), bigger, _weights(3), fewer, _weights(5)]
    proc = ctx.Process(target=_keeping_receiver, args=(port, len(rounds), out))
    proc.start()
    try:
        sender = WeightBroadcaster(WeightSyncGroup("127.0.0.1", port, 0, 2, timeout_s=300),
                                   bucket_bytes=512)
        for version, weights in enumerate(rounds):
            sender.broadcast(version, weights.items())
        kept = out.get(timeout=120)
    finally:
        proc.join(timeout=60)
    assert len(kept) == len(rounds)
    for version, (raw, sent) in enumerate(zip(kept, rounds, strict=True)):
        got = torch.load(io.BytesIO(raw))
        assert list(got) == list(sent), version
        for name, tensor in sent.items():
            assert torch.equal(got[name], tensor), (version, name)
