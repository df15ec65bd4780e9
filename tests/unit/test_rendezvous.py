"""A group's rendezvous port is bound when its address is handed out, and the group rank 0 builds
there takes that bound store (trainer/rendezvous.py)."""

from __future__ import annotations

import socket
from typing import Any

import torch
import torch.multiprocessing as mp

from trainer import rendezvous
from trainer.learner import DataParallelGroup


def _rank(port: int, rank: int, out: Any) -> None:
    group = DataParallelGroup("127.0.0.1", port, rank, 3, timeout_s=120)
    t = torch.tensor([float(rank + 1)])
    group.all_reduce(t)
    out.put((rank, float(t)))


def test_the_port_handed_out_is_held_until_rank_0_builds_its_group_there():
    # this process made a group before (as pytest's own does after other tests) and the ranks it
    # spawns did not: the group's name, which prefixes its keys in the store, must still agree
    _, earlier = rendezvous.host("127.0.0.1")
    DataParallelGroup("127.0.0.1", earlier, 0, 1)
    addr, port = rendezvous.host("127.0.0.1")
    # held from now on: another process looking for a port cannot take it in the meantime
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            pass
        else:
            raise AssertionError(f"port {port} was free after host() handed it out")
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
