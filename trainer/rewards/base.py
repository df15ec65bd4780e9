"""What every reward is: a batch function from (prompts, responses, answers) to floats."""

from __future__ import annotations

import math
from typing import Protocol


class RewardError(RuntimeError):
    """Scoring failed for a whole batch (scorer down, bad output); the controller marks the step."""


class RewardFn(Protocol):
    def __call__(
        self, prompts: list[str], responses: list[str], answers: list[str | None]
    ) -> list[float]: ...


def checked(scores: object, n: int, source: str) -> list[float]:
    """``scores`` as n finite floats, or a RewardError naming ``source``."""
    if not isinstance(scores, list | tuple):
        raise RewardError(f"{source} returned {type(scores).__name__}, expected a list of floats")
    if len(scores) != n:
        raise RewardError(f"{source} returned {len(scores)} scores for {n} responses")
    try:
        out = [float(s) for s in scores]
    except (TypeError, ValueError) as exc:
        raise RewardError(f"{source} returned a score that is not a number: {exc}") from exc
    if not all(math.isfinite(s) for s in out):
        raise RewardError(f"{source} returned a non-finite score")
    return out
