"""The sampler's interface: what every rollout engine promises the controller."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

FinishReason = Literal["stop", "length"]
# what an engine's ``sleep`` gives back, by vLLM's names for its parts
SLEEP_TAGS = ("weights", "kv_cache")


@dataclass
class Sample:
    """One sampled response.

    ``response_ids`` are the generated tokens, the EOS token included when generation ended on
    it (so training teaches the model to stop); ``response_text`` is the decoded response with
    EOS and any matched stop string removed. ``logprobs[i]`` is the log-probability of
    ``response_ids[i]`` under the sampling distribution (after temperature and top-p).
    """

    prompt: str
    prompt_ids: list[int]
    response_ids: list[int]
    response_text: str
    logprobs: list[float]
    finish_reason: FinishReason
    extra: dict[str, object] = field(default_factory=dict)
    # the frozen reference's log-prob of each response token, when a rollout worker computed it
    # (`placement.reference_on_rollout`); None: the learner's reference pass computes it
    ref_logprobs: list[float] | None = None


class RolloutEngine(Protocol):
    """Generates responses; ``generate`` returns ``n`` consecutive samples per prompt, in order."""

    def generate(self, prompts: list[str], n: int) -> list[Sample]: ...

    def generate_stream(self, prompts: list[str], n: int) -> Iterator[list[tuple[int, Sample]]]:
        """``generate``'s samples as they finish: batches of (index in ``generate``'s order,
        sample), so a consumer can start on the first ones while the rest still decode."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights (HF parameter names) in place, without touching disk."""
        ...

    def sleep(self) -> None:
        """Release what generation holds (KV cache) while the trainer uses the device."""
        ...

    def wake(self, tags: Sequence[str] = SLEEP_TAGS) -> None:
        """Re-acquire what ``sleep`` released (``tags``: the parts, as vLLM names them: a weight
        load needs only ``weights``); ``generate`` needs everything back."""
        ...

    def close(self) -> None: ...
