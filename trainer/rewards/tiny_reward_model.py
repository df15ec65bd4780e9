"""A tiny reward model for the arithmetic task (`yatt make-tiny-model DIR --preset reward`).

A Qwen2-style sequence classifier (one logit: "this answer is right"), with the same byte-level
tokenizer as the tiny policies, trained on (prompt, response) pairs labelled by `exact_match`:
half the responses are right, half are wrong in the ways a policy is wrong (off by one or ten,
a dropped or extra digit, a swapped pair of digits, a random number, no number; in training
mostly the near misses). It trains until it agrees with exact match on ≥ `target` of held-out
pairs (problems never seen in training, the policy-like mix) or its steps or time run out, and
writes what it reached to `reward_model.json`. docs/placement.md has the recipe's figures.
`reward.kind: model` with `reward.model_path: DIR` scores with it (trainer/rewards/model.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["corrupt", "labelled_pairs", "make_reward_model"]


def corrupt(answer: str, rng: random.Random, near_miss: float = 0.0) -> str:
    """A wrong response to a question whose answer is `answer` (a non-negative integer)."""
    v = int(answer)
    for _ in range(10):
        kind = rng.choice((0, 1, 4)) if near_miss and rng.random() < near_miss else rng.randrange(7)
        if kind == 0:
            out = str(v + rng.choice([-1, 1, -2, 2]))
        elif kind == 1:
            out = str(v + rng.choice([-10, 10, -100, 100]))
        elif kind == 2 and len(answer) > 1:
            i = rng.randrange(len(answer))
            out = answer[:i] + answer[i + 1 :]
        elif kind == 3:
            i = rng.randrange(len(answer) + 1)
            out = answer[:i] + str(rng.randrange(10)) + answer[i:]
        elif kind == 4 and len(answer) > 1:
            i = rng.randrange(len(answer) - 1)
            out = answer[:i] + answer[i + 1] + answer[i] + answer[i + 2 :]
        elif kind == 5:
            out = str(rng.randrange(0, 2 * v + 20))
        else:
            out = rng.choice(["", " ", "=", "+"])
        if out.lstrip("-") != answer and out != answer:
            return out
    return str(v + 1)


def labelled_pairs(examples: list[Any], rng: random.Random, k: int,
                   near_miss: float = 0.0) -> tuple[list[str], list[str], list[float]]:
    """`k` (prompt, response, exact-match label) triples, half of them right."""
    from trainer.rewards import exact_match

    prompts, responses, answers = [], [], []
    for _ in range(k):
        e = rng.choice(examples)
        prompts.append(e.prompt)
        responses.append(e.answer if rng.random() < 0.5 else corrupt(e.answer, rng, near_miss))
        answers.append(e.answer)
    labels = exact_match(prompts, responses, answers)
    return prompts, responses, labels


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Train on one thread: with matrices this small more threads only wait on each other (seven
    times the CPU seconds for the same steps on the busy 2-core machine)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def make_reward_model(out_dir: str | Path, *, digits: int = 2, ops: tuple[str, ...] = ("+",),
                      seed: int = 0, time_budget_s: float = 240.0, target: float = 0.97,
                      max_steps: int = 2000, batch_size: int = 64, lr: float = 3e-3,
                      hidden: int = 64, layers: int = 2, heads: int = 8, near_miss: float = 0.75,
                      aux_weight: float = 1.0, eval_every: int = 100,
                      log: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Train the classifier and save it at `out_dir`; returns what it reached (also written to
    `reward_model.json`). Raises FileExistsError if `out_dir` exists. It stops at `target`, or
    after `time_budget_s` seconds or `max_steps` steps, whichever comes first; the learning rate
    decays to 0 over `max_steps` (cosine, after a short warm-up).

    Besides the verdict on the last token, three throw-away heads read every position from the
    prompt's "=" on: the right answer's digit at this position, its next digit, and whether the
    response so far is a prefix of the right answer. They give labels per token instead of one
    per pair, so the network learns the sum (carries included); the first puts the right digit
    beside the response's own, where comparing them is one MLP away. Only the verdict head is
    saved. A `near_miss` share of the wrong training responses is off by one, two, ten or a
    hundred or has two digits swapped, the mistakes that are hardest to tell from right ones.
    """
    import math

    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from trainer.config import TrainerConfig
    from trainer.data import task_text
    from trainer.data.arithmetic import arithmetic_examples
    from trainer.models import EOS_TOKEN, PAD_TOKEN, _train_tokenizer

    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} already exists")
    cfg = TrainerConfig.model_validate(
        {"data": {"arithmetic": {"digits": digits, "ops": list(ops)}}})
    train, held_out = arithmetic_examples(digits=digits, ops=ops, train_size=cfg.data.arithmetic.train_size,
                                          eval_size=cfg.data.arithmetic.eval_size, seed=seed)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = _train_tokenizer(task_text(cfg), 1024)
    tokenizer.padding_side = "right"  # the classifier reads the last real token
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    # many narrow heads: each can fetch one operand digit at its own offset
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=128, tie_word_embeddings=True, num_labels=1,
                         bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id,
                         use_sliding_window=False, torch_dtype="float32")
    model = Qwen2ForSequenceClassification(config)
    end_of_answer = 10  # the digit heads' class past the answer's last digit
    digit_head = torch.nn.Linear(hidden, 11)
    next_digit_head = torch.nn.Linear(hidden, 11)
    prefix_head = torch.nn.Linear(hidden, 1)
    params = [*model.parameters(), *digit_head.parameters(), *next_digit_head.parameters(),
              *prefix_head.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    warmup = 30

    def lr_at(step: int) -> float:  # warm-up, then cosine to 0 at max_steps
        return lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / max_steps)))

    def encode(prompts: list[str], responses: list[str]) -> dict[str, torch.Tensor]:
        texts = [p + r for p, r in zip(prompts, responses, strict=True)]
        return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)

    def token_targets(prompts: list[str], responses: list[str], answers: list[str], lengths: list[int],
                      width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per token, from the prompt's last token on: the right answer's digit at this position
        (or its end; response tokens only), its next digit (or its end), and whether the text
        so far is a prefix of the right answer; -100 / -1 elsewhere.

        The task's text tokenizes one character per token (digits are split, signs stand alone);
        a row where it does not (`lengths` disagrees) gets no per-token targets."""
        digit = torch.full((len(prompts), width), -100, dtype=torch.long)
        next_digit = torch.full((len(prompts), width), -100, dtype=torch.long)
        prefix = torch.full((len(prompts), width), -1.0)
        for i, (p, r, a) in enumerate(zip(prompts, responses, answers, strict=True)):
            if lengths[i] != len(p) + len(r):
                continue
            for j in range(len(r) + 1):
                pos = len(p) - 1 + j  # the token before the response's j-th character
                if j > 0:
                    digit[i, pos] = int(a[j - 1]) if j - 1 < len(a) else end_of_answer
                next_digit[i, pos] = int(a[j]) if j < len(a) else end_of_answer
                prefix[i, pos] = float(a.startswith(r[:j]))
        return digit, next_digit, prefix

    eval_p, eval_r, eval_y = labelled_pairs(held_out, random.Random(seed + 1), 1024)
    eval_enc = encode(eval_p, eval_r)
    eval_labels = torch.tensor(eval_y)

    def agreement() -> float:
        model.eval()
        with torch.no_grad():
            logits = model(**eval_enc).logits[:, 0]
        model.train()
        return float(((logits > 0).float() == eval_labels).float().mean())

    t0, cpu0 = time.time(), time.process_time()
    step, acc, history = 0, 0.0, []
    bce = torch.nn.BCEWithLogitsLoss()
    ce = torch.nn.CrossEntropyLoss(ignore_index=-100)
    answer_of = {e.prompt: e.answer for e in train}
    with _one_torch_thread():
        while True:
            p, r, y = labelled_pairs(train, rng, batch_size, near_miss)
            enc = encode(p, r)
            hidden_states = model.model(**enc).last_hidden_state
            last = enc["attention_mask"].sum(dim=1) - 1  # right padding: the last real token
            verdict = model.score(hidden_states[torch.arange(len(p)), last])[:, 0]
            loss = bce(verdict, torch.tensor(y))
            if aux_weight > 0:
                digit_t, next_t, prefix_t = token_targets(p, r, [answer_of[q] for q in p],
                                                          enc["attention_mask"].sum(dim=1).tolist(),
                                                          hidden_states.shape[1])
                mask = prefix_t >= 0
                loss = loss + aux_weight * (
                    ce(digit_head(hidden_states).flatten(0, 1), digit_t.flatten())
                    + ce(next_digit_head(hidden_states).flatten(0, 1), next_t.flatten())
                    + bce(prefix_head(hidden_states)[..., 0][mask], prefix_t[mask]))
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            over = time.time() - t0 > time_budget_s or step >= max_steps
            if step % eval_every == 0 or over:
                acc = agreement()
                history.append((step, round(time.time() - t0, 1), acc))
                log(f"reward model step {step} ({time.time() - t0:.0f}s, "
                    f"{time.process_time() - cpu0:.0f} CPU s): loss {loss.item():.3f}, "
                    f"held-out agreement {acc:.1%}")
                if acc >= target or over:
                    break
    report = {"held_out_agreement": acc, "held_out_pairs": len(eval_y), "steps": step,
              "train_time_s": time.time() - t0, "train_cpu_s": time.process_time() - cpu0,
              "target": target, "history": history,
              "recipe": {"hidden": hidden, "layers": layers, "heads": heads, "batch_size": batch_size,
                         "lr": lr, "schedule": f"cosine to 0 at step {max_steps}",
                         "near_miss": near_miss, "aux_weight": aux_weight},
              "task": {"digits": digits, "ops": list(ops), "seed": seed},
              "labels": "exact_match of the response against the problem's answer"}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "reward_model.json").write_text(json.dumps(report, indent=2))
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report
