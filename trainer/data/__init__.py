"""Prompts and answers for training: the built-in arithmetic task and prompt files.

``load_task(cfg)`` returns ``(train, eval)`` lists of :class:`Example`; ``sft_target`` is the
completion an SFT warm start teaches; ``task_text`` is the corpus a tiny model's tokenizer is
trained on.
"""

from __future__ import annotations

from trainer.data.arithmetic import arithmetic_examples
from trainer.data.examples import DataError, Example, sft_target
from trainer.data.files import load_rows
from trainer.data.task import load_task, task_text

__all__ = [
    "DataError",
    "Example",
    "arithmetic_examples",
    "load_rows",
    "load_task",
    "sft_target",
    "task_text",
]
