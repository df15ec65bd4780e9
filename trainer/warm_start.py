"""The SFT warm start before RL: a fixed number of steps, or until a dev split is solved.

How far a fixed number of SFT steps gets depends on the seed: on the demo's 2-digit addition
the greedy accuracy jumps sharply somewhere between ~600 and ~1,100 steps, so 800 steps leave
one seed at 12% and another at 87%. With ``algorithm.warm_start.target_accuracy`` the warm start
instead stops at the first check where greedy exact-match accuracy on a dev split reaches the
target, ``steps`` being the budget. The dev split is the last ``dev_size`` training examples,
held out of SFT (RL may still draw them); the held-out eval set is never looked at, so the
accuracy RL starts from stays an honest measurement.

Every data-parallel rank runs this loop on its shard in lock-step (gradients are all-reduced),
and the dev accuracy is all-reduced too, so every rank stops at the same step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trainer.config import WarmStartConfig
from trainer.data import DataError, Example, sft_target

__all__ = ["WarmStartResult", "dev_split", "dev_accuracy", "run_warm_start"]

LOSS_EVERY = 25  # SFT steps between loss points (minutes of SFT on a CPU need a live curve)


@dataclass
class WarmStartResult:
    steps: int  # SFT steps taken
    loss: float | None  # the last step's loss
    dev_accuracy: float | None  # at the last check (None without a target)
    reached_target: bool | None  # None without a target
    time_s: float


def dev_split(train: list[Example], dev_size: int) -> tuple[list[Example], list[Example]]:
    """(SFT pool, dev split): the last ``dev_size`` training examples are the dev split."""
    if dev_size >= len(train):
        raise DataError(f"algorithm.warm_start.dev_size={dev_size} leaves no SFT examples "
                        f"(the train split has {len(train)})")
    dev = train[-dev_size:]
    if any(e.answer is None for e in dev):
        raise DataError("algorithm.warm_start.target_accuracy needs answers on the train split")
    return train[:-dev_size], dev


def dev_accuracy(learner: Any, examples: list[Example], max_new_tokens: int) -> float:
    """Greedy exact-match accuracy on ``examples`` (this rank's share), summed over the ranks."""
    from trainer.rewards import exact_match

    scores: list[float] = []
    # called with no examples too: a sharded learner gathers its weights on every rank
    texts = learner.greedy([e.prompt for e in examples], max_new_tokens)
    if examples:
        scores = exact_match([e.prompt for e in examples], texts, [e.answer for e in examples])
    correct, total = learner.all_reduce_sum([sum(scores), float(len(scores))])
    return correct / max(total, 1.0)


def run_warm_start(learner: Any, train: list[Example], ws: WarmStartConfig, *, rank: int,
                   world: int, seed: int, max_new_tokens: int,
                   emit: Callable[[dict[str, Any]], None] | None = None) -> WarmStartResult:
    """SFT ``learner.policy`` on ``train`` (this rank's shard of it) as ``ws`` says.

    ``emit`` receives progress records (``{"type": "progress", "step", "metrics", "message",
    "print"}``): the loss every 25 steps and the dev accuracy at every check.
    """
    from trainer.controller import PromptStream

    target = ws.target_accuracy
    pool, dev = (train, []) if target is None else dev_split(train, ws.dev_size)
    my_dev = dev[rank::world]
    stream = PromptStream(pool, rank=rank, world=world, seed=seed, salt="sft")
    opt = torch.optim.AdamW(learner.policy.parameters(), lr=ws.lr)
    per_rank = max(1, ws.batch_size // world)
    t0 = time.time()
    loss: float | None = None
    acc: float | None = None

    def report(step: int, metrics: dict[str, float], loud: bool) -> None:
        if emit is None:
            return
        parts = []
        if "warm_start/loss" in metrics:
            parts.append(f"loss {metrics['warm_start/loss']:.3f}")
        if "warm_start/dev_accuracy" in metrics:
            parts.append(f"dev accuracy {metrics['warm_start/dev_accuracy']:.3f} (target {target})")
        text = f"warm start {step}/{ws.steps}: " + ", ".join(parts)
        emit({"type": "progress", "step": step, "print": loud, "metrics": metrics, "message": text})

    done = 0
    if target is not None:  # a model that already solves the task needs no warm start
        acc = dev_accuracy(learner, my_dev, max_new_tokens)
        report(0, {"warm_start/dev_accuracy": acc}, True)

    def reached() -> bool:
        return target is not None and acc is not None and acc >= target

    while done < ws.steps and not reached():
        batch = stream.take(per_rank)
        m = learner.sft_step([e.prompt for e in batch], [sft_target(e) for e in batch], opt)
        done += 1
        loss = m["loss/sft"]
        check = target is not None and (done % ws.eval_every == 0 or done == ws.steps)
        metrics = {"warm_start/loss": loss}
        if check:
            acc = metrics["warm_start/dev_accuracy"] = dev_accuracy(learner, my_dev, max_new_tokens)
        if check or done % LOSS_EVERY == 0 or done == ws.steps:
            report(done, metrics, check or done % 100 == 0 or done == ws.steps)
    return WarmStartResult(steps=done, loss=loss, dev_accuracy=acc,
                           reached_target=None if target is None else reached(),
                           time_s=time.time() - t0)
