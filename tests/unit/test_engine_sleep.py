"""`EngineSleep`: how a colocated vLLM engine on a GPU sleeps and wakes (`rollout.sleep_level`),
against a stand-in for `vllm.LLM` that records the calls. The run-level order (one sleep a step,
after dynamic sampling's refills) is in tests/integration/test_colocated_sleep.py."""

from __future__ import annotations

import pytest

from trainer.config import parse_config
from trainer.rollout.vllm_engine import EngineSleep


class _LLM:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str]) -> None:
        self.calls.append(("wake_up", tuple(tags)))


def test_level_1_keeps_the_weights_and_wakes_the_cache_only_for_a_generate():
    llm = _LLM()
    s = EngineSleep(llm, 1, active=True)
    s.ready()  # awake from the start: nothing to wake
    s.sleep()
    s.sleep()  # asleep already
    s.wake(("weights",))  # a weight load
    s.wake(("weights",))
    s.ready()  # a generate: the cache comes back, the weights are awake already
    assert llm.calls == [("sleep", 1), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",))]
    s.sleep()
    s.ready()  # level 1: generating again without a load is fine (the weights were offloaded)
    assert llm.calls[3:] == [("sleep", 1), ("wake_up", ("weights", "kv_cache"))]


def test_level_2_refuses_to_generate_until_a_policy_is_loaded():
    llm = _LLM()
    s = EngineSleep(llm, 2, active=True)
    s.sleep()
    with pytest.raises(RuntimeError, match="level-2 sleep"):
        s.ready()
    assert llm.calls == [("sleep", 2)]  # it woke nothing before refusing
    s.wake(("weights",))
    with pytest.raises(RuntimeError, match="update_weights"):
        s.ready()  # the memory is back, but it holds no policy yet
    s.loaded()
    s.ready()
    assert llm.calls == [("sleep", 2), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",))]


def test_on_vllms_cpu_backend_nothing_sleeps():
    llm = _LLM()
    s = EngineSleep(llm, 2, active=False)
    s.sleep()
    s.ready()
    s.wake(("weights",))
    assert llm.calls == [] and not s.weights_lost


def test_sleep_level_is_1_or_2():
    assert parse_config({"rollout": {"sleep_level": 2}}).rollout.sleep_level == 2
    with pytest.raises(ValueError, match="sleep_level"):
        parse_config({"rollout": {"sleep_level": 3}})
