"""Rewards: ``build_reward(cfg)`` turns ``cfg.reward`` into a :class:`RewardFn`.

Kinds: ``rule`` (built-in rules by name, see :mod:`trainer.rewards.rules`), ``function`` (a
user's ``module:function`` with the RewardFn signature), ``model`` (an HF sequence classifier)
and ``remote`` (an HTTP scorer). Every kind raises :class:`RewardError` when a batch cannot be
scored, so the controller can mark the step instead of dying silently.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from trainer.config import TrainerConfig
from trainer.rewards.base import RewardError, RewardFn, checked
from trainer.rewards.remote import RemoteReward
from trainer.rewards.rules import RULES, exact_match, extract_number, format_reward

__all__ = [
    "RULES",
    "RemoteReward",
    "RewardError",
    "RewardFn",
    "build_reward",
    "exact_match",
    "extract_number",
    "format_reward",
    "load_function",
]


def load_function(spec: str) -> Callable[..., object]:
    """Import ``module:function`` (dots allowed on both sides); errors say what was not found."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise RewardError(f"reward function {spec!r} must look like 'module:function'")
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardError(f"cannot import module {module_name!r} for reward {spec!r}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RewardError(f"module {module_name!r} has no {attr!r} (reward {spec!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardError(f"reward {spec!r} is not callable")
    return obj


class _UserFunction:
    """A user's reward function, with its output checked and its exceptions made RewardErrors."""

    def __init__(self, spec: str):
        self.spec = spec
        self.fn = load_function(spec)

    def __call__(
        self, prompts: list[str], responses: list[str], answers: list[str | None]
    ) -> list[float]:
        try:
            scores = self.fn(prompts, responses, answers)
        except RewardError:
            raise
        except Exception as exc:
            raise RewardError(f"reward function {self.spec} raised {type(exc).__name__}: {exc}") from exc
        return checked(scores, len(prompts), f"reward function {self.spec}")


def build_reward(cfg: TrainerConfig) -> RewardFn:
    """The reward function ``cfg.reward`` describes."""
    r = cfg.reward
    if r.kind == "rule":
        return RULES[r.rule]
    if r.kind == "function":
        assert r.function is not None  # the config validator guarantees it
        return _UserFunction(r.function)
    if r.kind == "model":
        from trainer.rewards.model import ModelReward

        assert r.model_path is not None
        return ModelReward(r.model_path, batch_size=r.batch_size)
    assert r.url is not None
    return RemoteReward(r.url, timeout_s=r.timeout_s, retries=r.retries, batch_size=r.batch_size)
