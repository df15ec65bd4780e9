"""From a TrainerConfig to train and eval examples, and to a tokenizer corpus."""

from __future__ import annotations

import random

from trainer.config import TrainerConfig
from trainer.data.arithmetic import arithmetic_examples
from trainer.data.examples import Example
from trainer.data.files import load_rows


def load_task(cfg: TrainerConfig) -> tuple[list[Example], list[Example]]:
    """(train, eval) examples for ``cfg.data``; deterministic in ``cfg.seed``, eval held out.

    ``data.path`` wins over ``data.task``. Without ``data.eval_path`` the eval set is split
    off the file's rows: ``eval.size`` rows, at most a tenth of them.
    """
    data = cfg.data
    if data.path is not None:
        keys = {"prompt_key": data.prompt_key, "answer_key": data.answer_key}
        train = load_rows(data.path, **keys)
        if data.eval_path is not None:
            return train, load_rows(data.eval_path, split="test", **keys)
        order = list(range(len(train)))
        random.Random(f"split:{cfg.seed}").shuffle(order)
        held = min(cfg.eval.size, len(train) // 10)
        eval_idx = set(order[:held])
        return (
            [ex for i, ex in enumerate(train) if i not in eval_idx],
            [train[i] for i in sorted(eval_idx)],
        )
    arith = data.arithmetic
    return arithmetic_examples(
        digits=arith.digits,
        ops=arith.ops,
        train_size=arith.train_size,
        eval_size=arith.eval_size,
        seed=cfg.seed,
    )


def task_text(cfg: TrainerConfig, *, limit: int = 50_000) -> list[str]:
    """Texts (prompt + answer) a tiny model's tokenizer is trained on; at most ``limit``."""
    train, evals = load_task(cfg)
    return [ex.prompt + (ex.answer or "") for ex in (train + evals)[:limit]]
