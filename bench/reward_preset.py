"""The reward preset's recipe, measured: held-out agreement as it trains, and which wrong answers
the saved classifier still takes for right, scored through `reward.kind: model`.

    PYTHONPATH=$PWD .venv/bin/python bench/reward_preset.py --steps 2000 --seed 0
    PYTHONPATH=$PWD .venv/bin/python bench/reward_preset.py --steps 2000 --near-miss 0   # ablation

Trains `make_reward_model` for all `--steps` (no early stop; the learning rate decays over
them) with any recipe knob overridden, prints the held-out agreement every `--eval-every` steps
with the CPU seconds so far (one torch thread; compare recipes by CPU seconds on a busy
machine), then scores `--pairs` pairs of the held-out problems (`labelled_pairs(held_out,
random.Random(123), N)`, the CI test's draw) and prints the mistakes by kind of response. The
figures in docs/placement.md ("Reward model preset") came from this script.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from collections import Counter
from pathlib import Path


def kind_of(response: str, answer: str) -> str:
    """Which sort of response this is, for the breakdown of mistakes."""
    if response == answer:
        return "right"
    if not response.strip().isdigit():
        return "not a number"
    delta = abs(int(response) - int(answer))
    if delta <= 2:
        return "off by 1-2"
    if delta in (10, 100):
        return "off by 10/100"
    if len(response) != len(answer):
        return "wrong length"
    if sorted(response) == sorted(answer):
        return "digits swapped"
    return "other number"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--pairs", type=int, default=4000)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--near-miss", type=float)
    args = ap.parse_args()

    from trainer.config import parse_config
    from trainer.data.arithmetic import arithmetic_examples
    from trainer.rewards import build_reward
    from trainer.rewards.tiny_reward_model import labelled_pairs, make_reward_model

    knobs = {k: v for k, v in {"heads": args.heads, "batch_size": args.batch_size, "lr": args.lr,
                               "near_miss": args.near_miss}.items() if v is not None}
    out = Path(tempfile.mkdtemp()) / "rm"
    report = make_reward_model(out, seed=args.seed, max_steps=args.steps, target=1.01, time_budget_s=3600,
                               eval_every=args.eval_every, log=print, **knobs)
    _train, held_out = arithmetic_examples(digits=2, ops=["+"], train_size=20_000, eval_size=256,
                                           seed=args.seed)
    answer_of = {e.prompt: e.answer for e in held_out}
    prompts, responses, labels = labelled_pairs(held_out, random.Random(123), args.pairs)
    reward = build_reward(parse_config({"reward": {"kind": "model", "model_path": str(out)}}))
    scores = reward(prompts, responses, [None] * len(prompts))
    seen, missed = Counter(), Counter()
    for p, r, y, s in zip(prompts, responses, labels, scores, strict=True):
        k = kind_of(r, answer_of[p])
        seen[k] += 1
        missed[k] += (s > 0) != (y > 0.5)
    print(json.dumps({"recipe": report["recipe"], "seed": args.seed, "steps": report["steps"],
                      "train_cpu_s": round(report["train_cpu_s"], 1),
                      "held_out_agreement": report["held_out_agreement"],
                      f"agreement_{args.pairs}_pairs": 1 - sum(missed.values()) / len(labels),
                      "mistakes": {k: f"{missed[k]}/{seen[k]}" for k in sorted(seen)}}, indent=1))


if __name__ == "__main__":
    main()
