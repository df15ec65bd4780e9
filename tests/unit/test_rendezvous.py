"""A group's rendezvous port is bound when its address is handed out, and the group rank 0 builds
there takes that bound store (trainer/rendezvous.py)."""

from __future__ import annotations

import socket
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from tests.ranks import leave
from trainer import rendezvous
from trainer.learner import DataParallelGroup


def _assert_held(port: int) -> None:
    """The port is bound: another process looking for a free one cannot take it."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return
    raise AssertionError(f"port {port} was free after host() handed it out")


def _rank(port: int, rank: int, out: Any) -> None:
    group = DataParallelGroup("127.0.0.1", port, rank, 3, timeout_s=120)
    t = torch.tensor([float(rank + 1)])
    group.all_reduce(t)
    out.put((rank, float(t)))
    leave(group.barrier, out)


def test_the_port_handed_out_is_held_until_rank_0_builds_its_group_there():
    # this process made a group before (as pytest's own does after other tests) and the ranks it
    # spawns did not: the group's name, which prefixes its keys in the store, must still agree
    _, earlier = rendezvous.host("127.0.0.1")
    DataParallelGroup("127.0.0.1", earlier, 0, 1)
    addr, port = rendezvous.host("127.0.0.1")
    _assert_held(port)  # from now on: no process looking for a port can take it in the meantime
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(port, r, out)) for r in (1, 2)]
    for p in procs:
        p.start()
    try:
        group = DataParallelGroup(addr, port, 0, 3, timeout_s=120)  # takes the bound store
        t = torch.tensor([1.0])
        group.all_reduce(t)
        got = dict(out.get(timeout=120) for _ in procs)
        group.barrier()  # the ranks leave past it
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    assert float(t) == 6.0 and got == {1: 6.0, 2: 6.0}
    assert [p.exitcode for p in procs] == [0, 0]


def test_each_address_is_its_own_store_and_is_taken_once():
    _, a = rendezvous.host("127.0.0.1")
    _, b = rendezvous.host("127.0.0.1")
    assert a != b
    first = rendezvous.store("127.0.0.1", a, 0, 1)
    first.set("k", "v")
    # a group of one on the same port later cannot take the same server again: it is not hosted any
    # more, so binding it anew fails while the first still holds it
    try:
        rendezvous.store("127.0.0.1", a, 0, 1, timeout_s=5)
    except Exception:  # noqa: BLE001 - torch raises DistNetworkError (a RuntimeError)
        pass
    else:
        raise AssertionError("the same hosted store was handed out twice")
    assert first.get("k") == b"v"
    assert rendezvous.store("127.0.0.1", b, 0, 1).port == b


def _library_rank(rank: int, hosted: Any, go: Any, out: Any) -> None:
    """A rank of a library's group that meets through env:// (as a tensor-parallel vLLM engine's
    does): rank 0 hosts the store first and publishes its port; both meet once ``go`` is set."""
    import os

    import torch.distributed as dist

    if rank == 0:
        _, hosted.value = rendezvous.host("127.0.0.1", library=True)
    assert go.wait(timeout=120)
    port = hosted.value
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=2)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out.put((rank, float(t)))
    leave(dist.barrier, out)


def test_a_library_group_meets_through_env_on_the_store_its_rank_0_hosted():
    """`host(library=True)`: the port is held from the moment it is handed out, and torch's own
    env:// rendezvous in the hosting process then takes that server (it would fail to bind a
    port this process already held with a plain store: EADDRINUSE)."""
    ctx = mp.get_context("spawn")
    hosted, out, go = ctx.Value("i", 0), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_library_rank, args=(r, hosted, go, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 120
        while not hosted.value and time.monotonic() < deadline:
            time.sleep(0.05)
        port = hosted.value
        assert port, "rank 0 hosted no store"
        _assert_held(port)
        go.set()
        got = dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    assert got == {0: 3.0, 1: 3.0}
    assert [p.exitcode for p in procs] == [0, 0]
