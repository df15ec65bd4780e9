"""Small pure torch functions: masked statistics, advantages, losses.

Shapes: ``B`` sequences, ``T`` response tokens. ``mask`` is ``[B, T]`` (1 for a real response
token, 0 for padding). Sequence-level rewards are ``[B]`` with the ``n`` samples of a prompt
consecutive (``B = prompts * n``), as rollout engines return them.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

# --------------------------------------------------------------------------- masked statistics


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` where ``mask`` is set (over everything, or along ``dim``)."""
    m = mask.to(x.dtype)
    return (x * m).sum() if dim is None else (x * m).sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over masked entries; 0 where nothing is masked in."""
    m = mask.to(x.dtype)
    total = m.sum() if dim is None else m.sum(dim)
    return masked_sum(x, m, dim) / total.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over all masked entries (Bessel-corrected when ``unbiased``)."""
    m = mask.to(x.dtype)
    mean = masked_mean(x, m)
    n = m.sum()
    var = masked_sum((x - mean) ** 2, m)
    denom = (n - 1).clamp(min=1) if unbiased else n.clamp(min=1)
    return var / denom


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / std`` over masked entries; padding comes back as 0."""
    mean = masked_mean(x, mask)
    std = masked_var(x, mask).sqrt()
    out = (x - mean) / (std + eps) if shift_mean else x / (std + eps)
    return out * mask.to(x.dtype)


# --------------------------------------------------------------------------- advantages


def _groups(rewards: Tensor, n: int) -> Tensor:
    if rewards.dim() != 1 or rewards.numel() % n:
        raise ValueError(f"rewards must be 1-D with a multiple of n={n} entries, got {tuple(rewards.shape)}")
    return rewards.view(-1, n)


def grpo_advantages(rewards: Tensor, n: int, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO: reward minus its group's mean, divided by the group's (unbiased) std if asked. ``[B]``."""
    g = _groups(rewards, n)
    adv = g - g.mean(dim=1, keepdim=True)
    if norm_by_std:
        std = g.std(dim=1, keepdim=True) if n > 1 else torch.zeros_like(g[:, :1])
        adv = adv / (std + eps)
    return adv.reshape(-1)


def rloo_advantages(rewards: Tensor, n: int) -> Tensor:
    """RLOO: reward minus the mean of the other ``n - 1`` samples of its prompt. ``[B]``."""
    if n < 2:
        raise ValueError("RLOO needs at least 2 samples per prompt (rollout.n >= 2)")
    g = _groups(rewards, n)
    others = (g.sum(dim=1, keepdim=True) - g) / (n - 1)
    return (g - others).reshape(-1)


def token_rewards(
    scores: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """Per-token rewards ``[B, T]``: ``-kl_coef * kl`` on every token, the score on the last one."""
    rewards = torch.zeros_like(mask, dtype=scores.dtype)
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl.to(scores.dtype)
    lengths = mask.long().sum(dim=1)
    if (lengths == 0).any():
        raise ValueError("every sequence needs at least one response token")
    rows = torch.arange(mask.shape[0], device=mask.device)
    rewards[rows, lengths - 1] += scores
    return rewards * mask.to(scores.dtype)


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` along each sequence, 0 on padding. ``[B, T]``."""
    m = mask.to(rewards.dtype)
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = (rewards[:, t] + gamma * running) * m[:, t]
        out[:, t] = running
    return out


def reinforce_pp_advantages(
    scores: Tensor,
    mask: Tensor,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
) -> Tensor:
    """REINFORCE++: returns of the KL-shaped token rewards, whitened over the whole batch. ``[B, T]``."""
    returns = discounted_returns(token_rewards(scores, mask, kl, kl_coef), mask, gamma)
    return masked_whiten(returns, mask)


def gae_advantages(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """PPO's generalized advantage estimate from token rewards and values ``[B, T]``.

    The value after a sequence's last token is 0. Returns ``(advantages, returns)`` with
    ``returns = advantages + values``, both 0 on padding (advantages are not whitened here).
    """
    m = mask.to(rewards.dtype)
    values = values * m
    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])
    steps = rewards.shape[1]
    for t in reversed(range(steps)):
        next_value = values[:, t + 1] if t + 1 < steps else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = (delta + gamma * lam * last) * m[:, t]
        adv[:, t] = last
    return adv, (adv + values) * m


def overlong_penalty(lengths: Tensor, max_length: int, buffer: int) -> Tensor:
    """DAPO's soft overlong penalty ``[B]``: 0 up to ``max_length - buffer``, then linear to -1.

    Lengths past ``max_length`` (truncated responses) get -1. Add ``weight * penalty`` to rewards.
    """
    if buffer <= 0 or buffer > max_length:
        raise ValueError("buffer must be in 1..max_length")
    free = max_length - buffer
    lengths = lengths.to(torch.float32)
    penalty = (free - lengths) / buffer
    return penalty.clamp(min=-1.0, max=0.0)


# --------------------------------------------------------------------------- losses


def aggregate(loss: Tensor, mask: Tensor, agg: Literal["token_mean", "seq_mean"]) -> Tensor:
    """``token_mean``: every token weighs the same (DAPO); ``seq_mean``: every sequence does."""
    if agg == "token_mean":
        return masked_mean(loss, mask)
    if agg == "seq_mean":
        return masked_mean(loss, mask, dim=1).mean()
    raise ValueError(f"unknown loss aggregation {agg!r}")


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: Literal["token_mean", "seq_mean"] = "token_mean",
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate, with separate low/high clip (``clip_high > clip_low``: DAPO clip-higher).

    ``advantages`` is ``[B, T]`` or ``[B]`` (broadcast over tokens). ``is_weights`` (``[B, T]``,
    no gradient) scale each token's term: the truncated importance ratio of the proximal policy
    over the sampler's. Returns ``(loss, clip_frac)``, ``clip_frac`` being the fraction of tokens
    whose clipped term is the one used.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(logprobs)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    clip_frac = masked_mean((clipped > unclipped).to(logprobs.dtype), mask).detach()
    return aggregate(per_token, mask, agg), clip_frac


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: Literal["k1", "k3"] = "k3") -> Tensor:
    """Per-token KL estimate of the policy from the reference (Schulman's k1 / k3)."""
    if kind == "k1":
        return logprobs - ref_logprobs
    if kind == "k3":
        log_ratio = ref_logprobs - logprobs
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}")


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float | None = 0.2,
) -> tuple[Tensor, Tensor]:
    """Critic loss ``0.5 * (V - R)^2`` (PPO value clipping around ``old_values`` when ``clip``).

    Returns ``(loss, clip_frac)`` with the loss a token mean.
    """
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * masked_mean(unclipped, mask), torch.zeros((), dtype=values.dtype)
    v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    clipped = (v_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask)
    return loss, masked_mean((clipped > unclipped).to(values.dtype), mask).detach()


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax over the last dimension: ``logsumexp(z) - sum(p * z)``."""
    logits = logits.float()
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(dim=-1)


def token_logprobs(logits: Tensor, ids: Tensor) -> Tensor:
    """``log softmax(logits)[ids]`` for aligned ``logits [B, T, V]`` and ``ids [B, T]``."""
    logits = logits.float()
    picked = torch.gather(logits, -1, ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def sft_loss(logits: Tensor, target_ids: Tensor, mask: Tensor) -> Tensor:
    """Token-mean cross entropy of aligned ``logits [B, T, V]`` on ``target_ids`` where ``mask``."""
    return -masked_mean(token_logprobs(logits, target_ids), mask)
