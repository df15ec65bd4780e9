"""The unit of training data: a prompt and, for verifiable tasks, its reference answer."""

from __future__ import annotations

from dataclasses import dataclass


class DataError(ValueError):
    """Training data that cannot be loaded; the message says which file or key is wrong."""


@dataclass(frozen=True)
class Example:
    """One prompt; ``answer`` is the reference answer (None when the task has none)."""

    prompt: str
    answer: str | None = None


def sft_target(example: Example) -> str:
    """The completion an SFT warm start teaches for ``example`` (the tokenizer adds EOS)."""
    if example.answer is None:
        raise DataError(f"SFT needs an answer, and prompt {example.prompt[:60]!r} has none")
    return example.answer
