"""Why does a run not learn? Reads a `yatt train` run directory and a model, prints the evidence.

    PYTHONPATH=. .venv/bin/python bench/seed_diagnosis.py runs/demo-s1 [--model DIR]

1. The RL signal, step by step, from the run's metrics.jsonl: reward, the fraction of prompt
   groups whose `n` rewards are not all equal (`sampling/valid_fraction`: only those carry a
   GRPO advantage), the mean |advantage| and the policy-gradient norm.
2. What the model answers on the run's held-out eval prompts (default model: the run's
   `final/`, or `--model`): the greedy answers sorted into formats (right; right length but a
   wrong digit, and which digit; wrong length; no number; no EOS within max_new_tokens), and,
   sampling `n` answers per prompt at the rollout temperature, how many prompts get 0, 1..n-1
   or n right (a prompt with 0 or n right gives GRPO nothing).

Measured 2026-11-30 (load average 17-25 from other work) on the issue-13 case: the demo as it
shipped then (a fixed 800-step warm start) with `--set seed=1`, model built with seed 0:
- held-out accuracy 14.5% -> 14.1% after 100 GRPO steps (328 s).
- The RL step had a signal and used it: 52% of prompt groups had mixed rewards (first 10
  steps; 53% over the last 10), mean |advantage| 0.36-0.39, policy-gradient norm 0.67-1.02
  (clip 1.0), responses 3.6 tokens, none truncated. Reward stayed at 0.09-0.13.
- The answers had the right format: every greedy answer ends with EOS, a bare number, the right
  number of digits in 99.2%; 78.9% had only the units digit wrong (tens and hundreds, carry
  included, right), 6.2% units and tens wrong, 14.1% right. Sampled (n=8, T=1): 11.3% right,
  i.e. the units digit at chance (1 in 10).
- Control, bench/trl_control.py: TRL 1.16's GRPOTrainer from the same model (the run's final
  policy, 14.1%) on the same prompts with the same settings (16 x 8, lr 1e-4, no KL, 100 steps):
  reward 0.097 (first 10 steps) -> 0.113 (last 10), held-out 14.1% -> 12.1%. Neither learns.
So the warm start stopped before the model learned the units digit (SFT's sharp accuracy jump,
between ~600 and ~1,100 steps depending on the seed). The right answers GRPO saw were lucky
guesses of that digit, not a rule to reinforce: 100 steps of ~10 such hits at lr 1e-4 cannot
teach what 800 x 64 labelled examples at lr 1e-3 had not. The fix is the warm start that ends
on a dev-split accuracy target (`algorithm.warm_start.target_accuracy`), not the RL step.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch


def rl_signal(run: Path) -> None:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] > 0]
    keys = ["reward/mean", "sampling/valid_fraction", "advantage/abs_mean", "grad_norm",
            "response/length_mean", "response/truncated_frac"]
    print("step  " + "  ".join(f"{k.split('/')[-1]:>14}" for k in keys))
    for r in rows:
        if r["step"] <= 3 or r["step"] % 10 == 0:
            print(f"{r['step']:>4}  " + "  ".join(f"{r.get(k, float('nan')):>14.3f}" for k in keys))
    for name, part in (("first 10", rows[:10]), ("last 10", rows[-10:])):
        means = {k: sum(r.get(k, 0.0) for r in part) / max(1, len(part)) for k in keys}
        print(f"mean over {name} steps: " + ", ".join(f"{k} {v:.3f}" for k, v in means.items()))


def classify(text: str, hit_eos: bool, answer: str) -> str:
    import re

    if not hit_eos:
        return "no EOS"
    m = re.search(r"-?\d+", text)
    if m is None:
        return "no number"
    got = m.group(0)
    if got == answer:
        return "right" if text.strip() == answer else "right, extra text"
    if len(got) != len(answer):
        return f"wrong length ({len(got)} digits for {len(answer)})"
    wrong = [i for i, (a, b) in enumerate(zip(got[::-1], answer[::-1], strict=True)) if a != b]
    place = {0: "units", 1: "tens", 2: "hundreds"}
    return "wrong digit: " + "+".join(place.get(i, str(i)) for i in wrong)


@torch.no_grad()
def formats(model_dir: Path, cfg_dict: dict, n: int) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.config import parse_config
    from trainer.data import load_task

    cfg = parse_config(cfg_dict)
    _train, evals = load_task(cfg)
    evals = evals[: cfg.eval.size]
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    eos, T = tok.eos_token_id, cfg.rollout.max_new_tokens
    enc = tok([e.prompt for e in evals], return_tensors="pt", padding=True, add_special_tokens=False)

    def answers(sample: bool) -> list[tuple[str, bool]]:
        out = model.generate(**enc, max_new_tokens=T, do_sample=sample,
                             temperature=cfg.rollout.temperature if sample else None, top_p=None,
                             top_k=None, num_return_sequences=n if sample else 1,
                             pad_token_id=tok.pad_token_id, eos_token_id=eos)
        new = out[:, enc.input_ids.shape[1]:]
        return [(tok.decode(row, skip_special_tokens=True), bool((row == eos).any())) for row in new]

    greedy = answers(False)
    kinds = Counter(classify(t, e, ex.answer) for (t, e), ex in zip(greedy, evals, strict=True))
    print(f"greedy answers of {model_dir} on {len(evals)} held-out prompts:")
    for kind, count in kinds.most_common():
        print(f"  {count:>4} ({count / len(evals):6.1%})  {kind}")
    for (t, _), ex in list(zip(greedy, evals, strict=True))[:8]:
        print(f"    {ex.prompt}{t!r:<10} (want {ex.answer})")
    torch.manual_seed(0)
    sampled = answers(True)
    right = [sum(classify(t, e, ex.answer).startswith("right") for t, e in sampled[i * n:(i + 1) * n])
             for i, ex in enumerate(evals)]
    hist = Counter(right)
    mixed = sum(v for k, v in hist.items() if 0 < k < n) / len(evals)
    acc = sum(right) / (n * len(evals))
    print(f"sampled n={n} at temperature {cfg.rollout.temperature}: accuracy {acc:.1%}; "
          f"prompts with k of {n} right: " + ", ".join(f"{k}: {hist[k]}" for k in range(n + 1)))
    print(f"groups with mixed rewards (a GRPO signal): {mixed:.1%}")
    kinds = Counter(classify(t, e, ex.answer) for i, ex in enumerate(evals)
                    for t, e in sampled[i * n:(i + 1) * n])
    print("sampled formats: " + ", ".join(f"{k} {v / len(sampled):.1%}" for k, v in kinds.most_common()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--model", type=Path, default=None, help="default: RUN/final")
    ap.add_argument("--n", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if (args.run / "metrics.jsonl").exists():
        rl_signal(args.run)
    cfg = json.loads((args.run / "config.json").read_text())
    formats(args.model or args.run / "final", cfg, args.n)


if __name__ == "__main__":
    main()
