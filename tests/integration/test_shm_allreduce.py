"""The shared-memory gradient all-reduce (trainer/shm_allreduce.py) between real processes joined
by a `DataParallelGroup`: every rank gets the rank-ordered sum bit for bit, whatever the tensors'
sizes, dtypes and strides against the slot, and a segment the ranks cannot share is a clean fall
back to gloo on every rank, not an error or a SIGBUS."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.slow

SLOT = 4096  # bytes per rank: small, so packs hold several tensors and large ones are split


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tensors(rank: int, call: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + call)
    return [
        torch.randn(10, generator=g),
        torch.randn(3000, generator=g),  # 12 KB: over a 4 KB slot, split across packs
        torch.randn(5, 7, generator=g).t(),  # not contiguous
        torch.randn(100, generator=g).to(torch.bfloat16),
        torch.randn(3, generator=g, dtype=torch.float64),
        torch.randn(1024, generator=g),  # exactly one slot
    ]


def _rank_main(rank: int, world: int, port: int, out: str, fail_fallocate: bool) -> None:
    import trainer.learner as L

    torch.set_num_threads(1)
    L.SHM_SLOT_BYTES = SLOT
    if fail_fallocate and rank == 0:
        def full(*_args):
            raise OSError(28, "No space left on device")

        os.posix_fallocate = full
    group = L.DataParallelGroup("127.0.0.1", port, rank, world, timeout_s=120)
    results = []
    if group.shm is not None:
        for call in range(3):  # the two slot sets alternate across calls too
            ts = _tensors(rank, call)
            group.shm.all_reduce_(ts)
            results.append(ts)
    torch.save({"shm": group.shm is not None, "results": results}, out)


def _run(tmp_path, world: int, fail_fallocate: bool = False) -> list[dict]:
    ctx = mp.get_context("spawn")
    port = _free_port()
    outs = [str(tmp_path / f"{fail_fallocate}-{r}.pt") for r in range(world)]
    before = set(os.listdir("/dev/shm"))
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, outs[r], fail_fallocate))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    assert set(os.listdir("/dev/shm")) - before == set(), "a segment was left behind"
    return [torch.load(o) for o in outs]


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_rank_ordered_sum_bit_for_bit(tmp_path, world):
    runs = _run(tmp_path, world)
    assert all(r["shm"] for r in runs)
    for call in range(3):
        inputs = [_tensors(r, call) for r in range(world)]
        for i in range(len(inputs[0])):
            expected = inputs[0][i].clone()
            for r in range(1, world):  # ((t0 + t1) + t2): the order every rank adds in
                expected += inputs[r][i]
            for run in runs:
                got = run["results"][call][i]
                assert got.dtype == expected.dtype and got.shape == expected.shape
                assert torch.equal(got, expected), (world, call, i)
        # and it is a sum: nothing left as one rank's own values
        assert not torch.equal(runs[0]["results"][call][1], inputs[0][1])


def test_a_segment_rank_0_cannot_make_falls_back_to_gloo_on_every_rank(tmp_path):
    runs = _run(tmp_path, 2, fail_fallocate=True)
    assert [r["shm"] for r in runs] == [False, False]


def test_yatt_shm_allreduce_0_keeps_gloo(tmp_path, monkeypatch):
    monkeypatch.setenv("YATT_SHM_ALLREDUCE", "0")  # spawned ranks inherit it
    runs = _run(tmp_path, 2)
    assert [r["shm"] for r in runs] == [False, False]
