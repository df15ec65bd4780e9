"""Synthetic arithmetic with verifiable answers: prompts like ``"12+35="``, answers like ``"47"``.

Difficulty knobs: ``digits`` per operand (exactly that many: 2 means 10..99; 1 means 0..9)
and the set of ``ops``. The split is deterministic in
the seed, and the held-out eval problems never appear in the train set. Subtraction keeps the
larger operand first, so every answer is a non-negative integer (short targets a ~1M-parameter
model learns in seconds).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from trainer.data.examples import DataError, Example

# Below this many distinct problems, enumerate them all and shuffle (exact, no rejection loop).
_ENUMERATE_LIMIT = 2_000_000


def _render(a: int, op: str, b: int) -> Example:
    if op == "-" and b > a:
        a, b = b, a
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return Example(prompt=f"{a}{op}{b}=", answer=str(value))


def arithmetic_examples(
    *, digits: int, ops: Sequence[str], train_size: int, eval_size: int, seed: int
) -> tuple[list[Example], list[Example]]:
    """Disjoint (train, eval) problem lists; train is capped by how many distinct problems exist."""
    if digits < 1:
        raise DataError("data.arithmetic.digits must be at least 1")
    bad = [op for op in ops if op not in ("+", "-", "*")]
    if bad or not ops:
        raise DataError(f"data.arithmetic.ops must be a non-empty subset of + - *, got {list(ops)}")
    ops = sorted(set(ops), key="+-*".index)
    low, top = (10 ** (digits - 1) if digits > 1 else 0), 10**digits
    span = top - low
    # Subtraction renders (a, b) and (b, a) the same, so count canonical problems per op.
    per_op = {"+": span * span, "*": span * span, "-": span * (span + 1) // 2}
    total = sum(per_op[op] for op in ops)
    if eval_size >= total:
        raise DataError(
            f"data.arithmetic.eval_size={eval_size} leaves no training problems: only {total} "
            f"distinct problems exist with {digits} digit(s) and ops {ops}"
        )
    rng = random.Random(f"arithmetic:{seed}:{digits}:{''.join(ops)}")
    wanted = min(total, eval_size + train_size)
    if total <= _ENUMERATE_LIMIT:
        problems = [
            (a, op, b)
            for op in ops
            for a in range(low, top)
            for b in (range(low, a + 1) if op == "-" else range(low, top))
        ]
        rng.shuffle(problems)
        chosen = problems[:wanted]
    else:
        seen: set[tuple[int, str, int]] = set()
        chosen = []
        while len(chosen) < wanted:
            op = rng.choice(ops)
            a, b = rng.randrange(low, top), rng.randrange(low, top)
            if op == "-" and b > a:
                a, b = b, a
            if (a, op, b) not in seen:
                seen.add((a, op, b))
                chosen.append((a, op, b))
    examples = [_render(a, op, b) for a, op, b in chosen]
    return examples[eval_size:], examples[:eval_size]
