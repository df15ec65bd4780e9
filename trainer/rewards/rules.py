"""Rule rewards for tasks with verifiable answers.

A response is scored on its text as the rollout engine returns it: already cut at EOS or at a
stop string. ``exact_match`` compares the first number in the response with the reference
answer's number (a GSM8K-style ``#### 72`` or ``\\boxed{72}`` marker, when present, names the
number instead); ``format`` rewards a response that is a bare number and nothing else.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

from trainer.rewards.base import RewardError

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_MARKED = re.compile(r"(?:####\s*|\\boxed\{\s*)(-?\d[\d,]*(?:\.\d+)?)")
_BARE_NUMBER = re.compile(r"\s*-?\d+(?:\.\d+)?\s*")


def extract_number(text: str) -> Decimal | None:
    """The number a text answers with: after ``####`` / inside ``\\boxed{}`` if any, else the first."""
    match = _MARKED.search(text) or _NUMBER.search(text)
    if match is None:
        return None
    raw = (match.group(1) if match.re is _MARKED else match.group(0)).replace(",", "")
    try:
        return Decimal(raw)
    except InvalidOperation:
        return None


def exact_match(prompts: list[str], responses: list[str], answers: list[str | None]) -> list[float]:
    """1.0 when the response's number equals the reference answer's number, else 0.0."""
    out = []
    for prompt, response, answer in zip(prompts, responses, answers, strict=True):
        if answer is None:
            raise RewardError(f"exact_match needs reference answers; prompt {prompt[:60]!r} has none")
        want = extract_number(answer)
        got = extract_number(response)
        if want is None:  # a non-numeric reference: compare the stripped text
            out.append(float(response.strip() == answer.strip()))
        else:
            out.append(float(got is not None and got == want))
    return out


def format_reward(
    prompts: list[str], responses: list[str], answers: list[str | None]
) -> list[float]:
    """1.0 when the response is a bare number (optional sign and decimals), else 0.0."""
    return [float(_BARE_NUMBER.fullmatch(r) is not None) for r in responses]


FORMAT_WEIGHT = 0.1


def exact_match_and_format(
    prompts: list[str], responses: list[str], answers: list[str | None]
) -> list[float]:
    """``exact_match + 0.1 * format``: a right bare number scores 1.1, a wrong one 0.1."""
    em = exact_match(prompts, responses, answers)
    fm = format_reward(prompts, responses, answers)
    return [e + FORMAT_WEIGHT * f for e, f in zip(em, fm, strict=True)]


RULES: dict[str, Callable[[list[str], list[str], list[str | None]], list[float]]] = {
    "exact_match": exact_match,
    "format": format_reward,
    "exact_match+format": exact_match_and_format,
}
