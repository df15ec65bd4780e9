"""Dynamic sampling: zero-variance groups are dropped, refills are bounded, the ratio follows an EMA."""

from __future__ import annotations

import random

import pytest

from trainer.config import SamplingConfig
from trainer.sampling import DynamicSampler, Group, is_informative


def make_draw(valid_every: int, log: list[int]):
    """A draw whose every `valid_every`-th group has mixed rewards; records each request size."""
    counter = {"i": 0}

    def draw(k: int) -> list[Group]:
        log.append(k)
        out = []
        for _ in range(k):
            counter["i"] += 1
            mixed = counter["i"] % valid_every == 0
            out.append(Group(counter["i"], ["a", "b"], [1.0, 0.0] if mixed else [1.0, 1.0]))
        return out

    return draw


def test_is_informative():
    assert is_informative([0.0, 1.0])
    assert not is_informative([1.0, 1.0, 1.0])
    assert not is_informative([0.5])


def test_disabled_keeps_the_draw_as_it_is_but_reports_the_valid_fraction():
    log: list[int] = []
    s = DynamicSampler(enabled=False)
    kept, m = s.fill(8, make_draw(2, log))
    assert log == [8] and len(kept) == 8
    assert m["sampling/valid_fraction"] == 0.5
    assert m["sampling/refills"] == 0


def test_drops_zero_variance_groups_and_refills_until_full():
    log: list[int] = []
    s = DynamicSampler(enabled=True, max_refills=10, ema_decay=0.5, max_oversample=4.0)
    kept, m = s.fill(4, make_draw(2, log))
    assert len(kept) == 4
    assert all(is_informative(g.rewards) for g in kept)
    assert log[0] == 4  # the first step knows nothing yet: ratio 1
    assert m["sampling/refills"] == len(log) - 1 >= 1
    assert m["sampling/generated_groups"] == sum(log)
    assert m["sampling/batch_fill"] == 1.0
    # half the groups were valid: the EMA moves from 1 halfway to 0.5, and the ratio follows
    assert s.ema_valid == pytest.approx(0.75)
    assert s.oversample_ratio == pytest.approx(1 / 0.75)
    assert s.request_size(6) == 8


def test_refills_are_bounded_and_the_step_trains_on_what_it_has():
    log: list[int] = []
    s = DynamicSampler(enabled=True, max_refills=2, ema_decay=0.0, max_oversample=3.0)
    kept, m = s.fill(8, make_draw(1000, log))  # nothing is informative
    assert kept == []
    assert len(log) == 3 and m["sampling/refills"] == 2
    assert m["sampling/batch_fill"] == 0.0
    assert s.oversample_ratio == 3.0  # capped at max_oversample


def test_prefetched_first_draw_is_used_before_drawing_more():
    log: list[int] = []
    s = DynamicSampler(enabled=True, max_refills=3)
    first = [Group(i, ["a", "b"], [0.0, 1.0]) for i in range(5)]
    kept, m = s.fill(4, make_draw(1, log), first=first)
    assert log == [] and len(kept) == 4
    assert m["sampling/dropped_groups"] == 1  # one surplus group beyond the batch


def test_ratio_tracks_a_changing_valid_fraction_and_round_trips_through_state():
    rng = random.Random(0)
    s = DynamicSampler(**SamplingConfig(dynamic=True, ema_decay=0.8).model_dump(exclude={"dynamic"}),
                       enabled=True)

    def draw(k: int) -> list[Group]:
        return [Group(i, [0, 1], [1.0, 0.0] if rng.random() < 0.25 else [0.0, 0.0]) for i in range(k)]

    for _ in range(30):
        s.fill(16, draw)
    assert 0.1 < s.ema_valid < 0.45
    assert s.oversample_ratio == pytest.approx(min(4.0, 1 / s.ema_valid))
    clone = DynamicSampler(enabled=True)
    clone.load_state_dict(s.state_dict())
    assert clone.ema_valid == s.ema_valid


def test_ranks_sharing_a_sampler_refill_in_lockstep_a_full_rank_drawing_nothing():
    """Two ranks of one tensor-parallel engine: every generate is a collective, so a rank whose
    batch is full keeps joining (draw(0)) while its peer refills, and neither waits forever."""
    import threading

    barrier = threading.Barrier(2)
    wants: dict[int, bool] = {}
    lock = threading.Lock()

    def agree_for(rank: int):
        def agree(mine: bool) -> bool:
            with lock:
                wants[rank] = mine
            barrier.wait(timeout=10)
            anyone = any(wants.values())
            barrier.wait(timeout=10)  # both have read before the next round writes
            return anyone
        return agree

    logs: dict[int, list[int]] = {0: [], 1: []}
    kept: dict[int, int] = {}
    refills: dict[int, float] = {}

    def run(rank: int, valid_every: int) -> None:
        s = DynamicSampler(enabled=True, max_refills=3)
        groups, m = s.fill(4, make_draw(valid_every, logs[rank]), agree=agree_for(rank))
        kept[rank], refills[rank] = len(groups), m["sampling/refills"]

    # rank 0: every group informative (full at once); rank 1: one in three (needs refills)
    threads = [threading.Thread(target=run, args=(0, 1)), threading.Thread(target=run, args=(1, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert len(logs[0]) == len(logs[1]) > 1  # as many generate calls on both ranks
    assert logs[0][0] == 4 and set(logs[0][1:]) == {0}  # the full rank joined with no prompts
    assert all(k > 0 for k in logs[1]) and len(logs[1]) == 1 + refills[1]
    assert kept[0] == 4 and refills[0] == 0 and kept[1] >= 1
