"""From token lists to padded tensors, and a causal LM's log-probs of the response tokens.

Layout: prompts left-padded to a common width ``P``, responses right-padded to ``T``, so the
response tokens of every row sit in the same columns ``P .. P+T-1`` and the logits that predict
them in ``P-1 .. P+T-2``. Position ids count only real tokens, so left padding does not shift
rotary positions (the same positions vLLM and ``generate`` use).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.algorithms.core import entropy_from_logits, token_logprobs


@dataclass
class TokenBatch:
    input_ids: Tensor  # [B, P+T]
    attention_mask: Tensor  # [B, P+T]
    position_ids: Tensor  # [B, P+T]
    response_ids: Tensor  # [B, T]
    response_mask: Tensor  # [B, T] float, 1 on real response tokens
    prompt_width: int  # P

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, rows: slice | Tensor) -> TokenBatch:
        """A sub-batch (micro-batch) of these rows, same column layout."""
        return TokenBatch(
            input_ids=self.input_ids[rows],
            attention_mask=self.attention_mask[rows],
            position_ids=self.position_ids[rows],
            response_ids=self.response_ids[rows],
            response_mask=self.response_mask[rows],
            prompt_width=self.prompt_width,
        )

    def to(self, device: str | torch.device) -> TokenBatch:
        return TokenBatch(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            position_ids=self.position_ids.to(device),
            response_ids=self.response_ids.to(device),
            response_mask=self.response_mask.to(device),
            prompt_width=self.prompt_width,
        )


def pack(
    prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], pad_id: int
) -> TokenBatch:
    """Pad prompt/response token lists into a :class:`TokenBatch` (every response non-empty)."""
    if len(prompt_ids) != len(response_ids) or not prompt_ids:
        raise ValueError("need as many prompts as responses, and at least one")
    if any(len(r) == 0 for r in response_ids):
        raise ValueError("every response needs at least one token")
    width = max(len(p) for p in prompt_ids)
    length = max(len(r) for r in response_ids)
    rows = len(prompt_ids)
    input_ids = torch.full((rows, width + length), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, width + length), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        start = width - len(p)
        input_ids[i, start:width] = torch.tensor(list(p), dtype=torch.long)
        input_ids[i, width : width + len(r)] = torch.tensor(list(r), dtype=torch.long)
        attention[i, start : width + len(r)] = 1
    position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)
    return TokenBatch(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=position_ids,
        response_ids=input_ids[:, width:].clone(),
        response_mask=attention[:, width:].float(),
        prompt_width=width,
    )


def pad_values(rows: Sequence[Sequence[float]], length: int) -> Tensor:
    """Right-pad per-token floats (e.g. sampling log-probs) to ``[B, length]`` with zeros."""
    out = torch.zeros((len(rows), length), dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(list(row), dtype=torch.float32)
    return out


def response_logits(model: torch.nn.Module, batch: TokenBatch) -> Tensor:
    """Logits ``[B, T, V]`` that predict each response token."""
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    )
    width, length = batch.prompt_width, batch.response_ids.shape[1]
    return out.logits[:, width - 1 : width - 1 + length]


def response_logprobs(
    model: torch.nn.Module, batch: TokenBatch, *, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs ``[B, T]`` of the response under ``model`` (logits / temperature).

    Dividing by the sampling temperature makes these comparable with the engines' log-probs.
    Returns ``(logprobs, entropy or None)``; padding positions hold garbage, mask them.
    """
    logits = response_logits(model, batch).float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logprobs = token_logprobs(logits, batch.response_ids)
    entropy = entropy_from_logits(logits) if with_entropy else None
    return logprobs, entropy


def sft_batch(tokenizer, prompts: Sequence[str], targets: Sequence[str]) -> TokenBatch:
    """Prompt + target + EOS, tokenized the way rollouts are (prompt and response separately)."""
    eos = tokenizer.eos_token_id
    p_ids = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    r_ids = [tokenizer(t, add_special_tokens=False).input_ids + [eos] for t in targets]
    return pack(p_ids, r_ids, tokenizer.pad_token_id)
