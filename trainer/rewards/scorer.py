"""A reward scorer on its own share of a device (partial_colocate): the actor every controller
streams chunks of finished samples to while its sampler still generates.

Ray runs an actor's calls one at a time in arrival order, so the actor's mailbox is the queue:
chunks from every controller wait there and are scored as soon as the one before is done. Each
call returns the scores and the span it spent scoring, so the controllers can show scoring
overlapping generation on the timeline and measure how much of it did.
"""

from __future__ import annotations

import json
import time
from typing import Any

__all__ = ["RewardScorer"]


class RewardScorer:
    """Scores (prompt, response, answer) chunks with `cfg.reward` on device `device`."""

    def __init__(self, cfg_json: str, device: int, cores: float):
        import torch

        from trainer.config import parse_config
        from trainer.rewards import build_reward

        torch.set_num_threads(max(1, int(cores)))
        self.cfg = parse_config(json.loads(cfg_json))
        self.device = device
        self.reward_fn = build_reward(self.cfg)

    def ready(self) -> int:
        """The device it scores on, once its reward model is loaded."""
        return self.device

    def score(self, prompts: list[str], responses: list[str],
              answers: list[str | None]) -> dict[str, Any]:
        """Scores for one chunk and the span that produced them (RewardError when it fails)."""
        start = time.time()
        scores = self.reward_fn(prompts, responses, answers)
        return {"scores": list(scores),
                "span": {"device": self.device, "phase": "reward", "start": start, "end": time.time()}}
