"""Dynamic sampling (DAPO): keep only prompt groups that carry a learning signal.

A group is the `n` responses to one prompt. When every response got the same reward, the
group-relative advantage is zero for all of them and the group only costs time, so it is
dropped and the batch is refilled from more prompts. How many prompts to ask for is the batch
size times an over-sampling ratio that follows an exponential moving average of the fraction of
valid groups (capped at `max_oversample`); refills are bounded by `max_refills`, after which the
step trains on what it has.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Group", "DynamicSampler", "is_informative"]


@dataclass
class Group:
    """One prompt with its sampled responses and their rewards."""

    example: Any
    samples: list[Any]
    rewards: list[float]
    extra: dict[str, Any] = field(default_factory=dict)


def is_informative(rewards: Sequence[float], tol: float = 1e-8) -> bool:
    """True when the rewards of a group are not all equal (there is something to learn)."""
    return len(rewards) > 1 and (max(rewards) - min(rewards)) > tol


class DynamicSampler:
    """Fills a batch of `need` groups; with `enabled=False` it takes the first draw as it is."""

    def __init__(self, *, enabled: bool, max_refills: int = 3, ema_decay: float = 0.9,
                 max_oversample: float = 4.0):
        self.enabled = enabled
        self.max_refills = max_refills
        self.ema_decay = ema_decay
        self.max_oversample = max_oversample
        self.ema_valid = 1.0

    @classmethod
    def from_config(cls, cfg: Any) -> DynamicSampler:
        return cls(enabled=cfg.dynamic, max_refills=cfg.max_refills, ema_decay=cfg.ema_decay,
                   max_oversample=cfg.max_oversample)

    @property
    def oversample_ratio(self) -> float:
        """Prompts to ask for per group needed: 1 / expected valid fraction, capped."""
        if not self.enabled:
            return 1.0
        return min(self.max_oversample, 1.0 / max(self.ema_valid, 1.0 / self.max_oversample))

    def request_size(self, need: int) -> int:
        return max(1, math.ceil(need * self.oversample_ratio)) if need > 0 else 0

    def fill(self, need: int, draw: Callable[[int], list[Group]],
             first: list[Group] | None = None,
             agree: Callable[[bool], bool] | None = None) -> tuple[list[Group], dict[str, float]]:
        """Draw groups until `need` informative ones are kept or refills run out.

        `draw(k)` samples and scores k new prompts. `first`, when given, is a draw already made
        (a rollout prefetched while the previous step trained) and is used before drawing more.
        `agree(wants_more)`, when given, tells whether any peer still draws: ranks that share a
        sampler (a tensor-parallel engine) refill in lockstep, a full rank joining with draw(0).
        """
        ratio = self.oversample_ratio
        groups = first if first is not None else draw(self.request_size(need))
        generated = len(groups)
        valid_total = sum(is_informative(g.rewards) for g in groups)
        if not self.enabled:
            kept = list(groups)
            refills = 0
        else:
            kept = [g for g in groups if is_informative(g.rewards)]
            refills = 0
            while True:
                wants = len(kept) < need and refills < self.max_refills
                if not (wants if agree is None else agree(wants)):
                    break
                if not wants:  # a peer still refills: take part in its draw with no prompts
                    draw(0)
                    continue
                refills += 1
                more = draw(max(1, math.ceil((need - len(kept)) * self.oversample_ratio)))
                generated += len(more)
                valid = [g for g in more if is_informative(g.rewards)]
                valid_total += len(valid)
                kept.extend(valid)
            frac = valid_total / generated if generated else 0.0
            self.ema_valid = self.ema_decay * self.ema_valid + (1 - self.ema_decay) * frac
            kept = kept[:need]
        metrics = {
            "sampling/valid_fraction": valid_total / generated if generated else 0.0,
            "sampling/ema_valid_fraction": self.ema_valid,
            "sampling/oversample_ratio": ratio,
            "sampling/refills": float(refills),
            "sampling/generated_groups": float(generated),
            "sampling/kept_groups": float(len(kept)),
            "sampling/dropped_groups": float(generated - len(kept)),
            "sampling/batch_fill": len(kept) / need if need else 1.0,
        }
        return kept, metrics

    def state_dict(self) -> dict[str, float]:
        return {"ema_valid": self.ema_valid}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.ema_valid = float(state.get("ema_valid", 1.0))
