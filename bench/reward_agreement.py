"""Does a run's reward model still agree with exact match on the policy's own samples?

A reward model is trained on pairs labelled by exact match; the policy it trains then writes
responses of its own, and where the two disagree the policy is paid for a wrong answer (the run
that fell 85% → 23% held-out with an 85.9%-agreement model). For each policy a finished run with
`reward.kind: model` kept (its last checkpoints, then `final/`), this samples the run's held-out prompts as the run did (temperature
`rollout.temperature`, `rollout.max_new_tokens`), scores every sample with the run's reward
model and with exact match, and prints how often they agree, the wrong answers the reward model
pays for (its score > 0) and the right ones it refuses.

    PYTHONPATH=$PWD .venv/bin/python bench/reward_agreement.py RUN_DIR [--n 4]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def sample(policy_dir: Path, prompts: list[str], *, n: int, max_new_tokens: int,
           temperature: float, seed: int) -> list[str]:
    """`n` sampled responses per prompt, prompt-major."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(policy_dir))
    tok.padding_side = "left"  # a decoder continues the prompt's last token
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(policy_dir)).eval()
    torch.manual_seed(seed)
    out: list[str] = []
    with torch.no_grad():
        for i in range(0, len(prompts), 64):
            enc = tok(prompts[i:i + 64], return_tensors="pt", padding=True, add_special_tokens=False)
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True,
                                 temperature=temperature, num_return_sequences=n,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            out += tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return out


def main() -> None:
    import torch

    from trainer.config import parse_config
    from trainer.data.task import load_task
    from trainer.rewards import exact_match
    from trainer.rewards.model import ModelReward

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--n", type=int, default=4, help="samples per held-out prompt")
    args = ap.parse_args()
    torch.set_num_threads(1)  # a shared 2-core machine; the models are tiny
    cfg = parse_config(json.loads((args.run / "config.json").read_text()))
    if cfg.reward.kind != "model" or cfg.reward.model_path is None:
        raise SystemExit(f"{args.run}: reward.kind is {cfg.reward.kind!r}, not a reward model")
    _, held_out = load_task(cfg)
    reward = ModelReward(cfg.reward.model_path)
    checkpoints = sorted((args.run / "checkpoints").glob("step_*/policy"))
    policies = [(p.parent.name, p) for p in checkpoints] + [("final", args.run / "final")]
    print(f"{args.run}: reward model {cfg.reward.model_path}, {len(held_out)} held-out prompts "
          f"× {args.n} samples at temperature {cfg.rollout.temperature}")
    for name, path in policies:
        prompts = [e.prompt for e in held_out for _ in range(args.n)]
        answers = [e.answer for e in held_out for _ in range(args.n)]
        texts = sample(path, [e.prompt for e in held_out], n=args.n,
                       max_new_tokens=cfg.rollout.max_new_tokens,
                       temperature=cfg.rollout.temperature, seed=cfg.seed)
        right = exact_match(prompts, texts, answers)
        scores = reward(prompts, texts, answers)
        paid = [s > 0 for s in scores]
        agree = sum(p == (r > 0) for p, r in zip(paid, right, strict=True)) / len(texts)
        wrong_paid = sum(p and not r for p, r in zip(paid, right, strict=True))
        right_refused = sum(bool(r) and not p for p, r in zip(paid, right, strict=True))
        n_right = int(sum(right))
        print(f"  {name}: samples right {n_right / len(texts):.1%}; reward model agrees with exact "
              f"match on {agree:.1%}; pays {wrong_paid} of {len(texts) - n_right} wrong answers, "
              f"refuses {right_refused} of {n_right} right ones")


if __name__ == "__main__":
    main()
