"""Gradients averaged through shared memory (trainer/shm_grads.py), ranks as threads of one
process on a real TCPStore: the average's bits, uneven parts over three ranks, the fallback when
rank 0 cannot make the segment, and a rank that never arrives."""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from trainer import shm_grads
from trainer.shm_grads import SharedGradients


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Group:
    """What `SharedGradients.open` reads of a `DataParallelGroup`."""

    rank: int
    world: int
    store: Any
    backend: str = "gloo"
    timeout_s: float = 30.0
    opened: list = field(default_factory=list)


def _groups(world: int, timeout_s: float = 30.0) -> list[Group]:
    port = _free_port()
    stores = [dist.TCPStore("127.0.0.1", port, world, True, timeout=timedelta(seconds=30),
                            wait_for_workers=False)]
    stores += [dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=30))
               for _ in range(world - 1)]
    return [Group(r, world, stores[r], timeout_s=timeout_s) for r in range(world)]


def _on_ranks(world: int, fn, timeout_s: float = 30.0) -> list[Any]:
    """fn(rank, group) on a thread per rank; their results, or the first error raised."""
    groups = _groups(world, timeout_s)
    results: list[Any] = [None] * world

    def run(r: int) -> None:
        try:
            results[r] = fn(r, groups[r])
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            results[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a rank hung"
    return results


def _params(seed: int) -> list[nn.Parameter]:
    """Odd sizes, so that the ranks' parts cut through tensors and the last part is short."""
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(shape, generator=g)) for shape in ((37, 29), (1000,), (7,), (3, 5, 11))]


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_holds_the_average_of_the_ranks_gradients_bit_for_bit(world):
    grads = [[torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * r + i))
              for i, p in enumerate(_params(0))] for r in range(world)]
    # what gloo's sum then `GradientBuckets`' division give: the ranks' gradients in rank order
    expected = []
    for i in range(len(grads[0])):
        total = grads[0][i].clone()
        for r in range(1, world):
            total += grads[r][i]
        expected.append(total / world)

    def rank_main(r: int, group: Group) -> list[torch.Tensor]:
        params = _params(0)
        shared, why_not = SharedGradients.open(group, params, key="grads/0")
        assert shared is not None, why_not
        out = []
        for scale in (3.0, 2.0, 1.0):  # the same segment step after step; the last one checked
            shared.zero_grad()
            for p, g in zip(params, grads[r], strict=True):
                assert p.grad is not None and not p.grad.any()
                p.grad.add_(g * scale)  # what the backward does: accumulate in place
            shared.wait()
            out = [p.grad.clone() for p in params]
        return out

    results = _on_ranks(world, rank_main)
    for r, got in enumerate(results):
        assert not isinstance(got, BaseException), got
        for g, e in zip(got, expected, strict=True):
            assert torch.equal(g, e), f"rank {r}: not the ranks' average"
    assert not [f for f in os.listdir(shm_grads.SHM_DIR) if f.startswith(f"yatt-grads-{os.getpid()}-")], \
        "the segment's name was left in /dev/shm"


def test_no_segment_for_rank_0_means_gloo_on_every_rank_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(shm_grads, "SHM_DIR", str(tmp_path / "missing"))

    def rank_main(r: int, group: Group):
        return SharedGradients.open(group, _params(0), key="grads/0")

    results = _on_ranks(2, rank_main)
    for shared, why_not in results:
        assert shared is None
        assert why_not.startswith("rank 0:") and "missing" in why_not


def test_a_rank_that_never_arrives_is_an_error_naming_it_not_a_hang():
    ready = threading.Barrier(2)

    def rank_main(r: int, group: Group):
        shared, why_not = SharedGradients.open(group, _params(0), key="grads/0")
        assert shared is not None, why_not
        shared.zero_grad()
        if r == 1:  # set up, then gone before the step's average
            ready.wait()
            return None
        ready.wait()
        with pytest.raises(RuntimeError, match=r"ranks \[1\] did not arrive"):
            shared.wait()
        return "raised"

    results = _on_ranks(2, rank_main, timeout_s=0.5)
    assert results == ["raised", None]


def test_a_gradient_replaced_outside_the_segment_is_an_error():
    def rank_main(r: int, group: Group):
        params = _params(0)
        shared, why_not = SharedGradients.open(group, params, key="grads/0")
        assert shared is not None, why_not
        shared.zero_grad()
        params[1].grad = torch.zeros_like(params[1])  # as optimizer.zero_grad + a backward would
        with pytest.raises(RuntimeError, match="replaced outside shared memory"):
            shared.wait()
        return "raised"

    assert _on_ranks(2, rank_main) == ["raised", "raised"]
