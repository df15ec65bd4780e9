"""Control for a run that does not learn: TRL's GRPOTrainer from the same model on the same prompts.

    PYTHONPATH=. .venv/bin/python bench/trl_control.py runs/demo-s1 [--model DIR] [--steps 100]

Takes the run's config (prompts, seed, n, lr, temperature, max_new_tokens, prompts per step)
and a model directory (default: the run's `final/`), trains it with TRL's `GRPOTrainer`
(default loss, group-scaled rewards, no KL, like the demo) with the same reward (exact match),
and prints held-out greedy accuracy before and after plus TRL's per-step reward. If TRL lifts
the model where yatt did not, the fault is in yatt's RL step; if neither does, it is the model.
Needs TRL (the `bench` extra).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


@torch.no_grad()
def greedy_accuracy(model, tok, examples, max_new_tokens: int) -> float:
    from trainer.rewards import exact_match

    model.eval()
    enc = tok([e.prompt for e in examples], return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    texts = tok.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
    scores = exact_match([e.prompt for e in examples], texts, [e.answer for e in examples])
    return sum(scores) / len(scores)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--model", type=Path, default=None, help="default: RUN/final")
    ap.add_argument("--steps", type=int, default=None, help="default: the run's train.max_steps")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from trainer.config import parse_config
    from trainer.data import load_task
    from trainer.rewards import exact_match

    cfg = parse_config(json.loads((args.run / "config.json").read_text()))
    model_dir = args.model or args.run / "final"
    train, evals = load_task(cfg)
    evals = evals[: cfg.eval.size]
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    n, prompts = cfg.rollout.n, cfg.train.batch_size
    start = greedy_accuracy(model, tok, evals, cfg.rollout.max_new_tokens)
    print(f"model {model_dir}: held-out greedy accuracy {start:.3f}", flush=True)

    def reward(prompts: list[str], completions: list[str], answer: list[str], **_: object) -> list[float]:
        return exact_match(prompts, completions, answer)

    data = Dataset.from_list([{"prompt": e.prompt, "answer": e.answer} for e in train])
    with tempfile.TemporaryDirectory(prefix="trl-control-") as out:
        conf = GRPOConfig(
            output_dir=out, learning_rate=cfg.train.lr, lr_scheduler_type="constant",
            warmup_steps=0, max_grad_norm=cfg.train.grad_clip, weight_decay=0.0,
            per_device_train_batch_size=prompts * n, gradient_accumulation_steps=1,
            num_generations=n, max_completion_length=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature, top_p=1.0, beta=cfg.algorithm.kl_coef,
            max_steps=args.steps or cfg.train.max_steps, logging_steps=1, report_to="none",
            use_cpu=True, seed=cfg.seed, save_strategy="no", disable_tqdm=True,
            dataloader_num_workers=0, bf16=False,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=conf, train_dataset=data,
                              processing_class=tok)
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    end = greedy_accuracy(trainer.model, tok, evals, cfg.rollout.max_new_tokens)
    k = max(1, len(rewards) // 10)
    print(f"TRL GRPO {len(rewards)} steps x {prompts} prompts x {n} in {wall:.0f}s: mean reward "
          f"first {k} steps {sum(rewards[:k]) / k:.3f}, last {k} steps {sum(rewards[-k:]) / k:.3f}")
    print(f"held-out greedy accuracy {start:.3f} -> {end:.3f} ({100 * (end - start):+.1f} points)")


if __name__ == "__main__":
    main()
