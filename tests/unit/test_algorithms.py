"""Advantages and losses against numbers worked out by hand (in the comments)."""

import math

import pytest
import torch

from trainer.algorithms import (
    discounted_returns,
    entropy_from_logits,
    gae_advantages,
    grpo_advantages,
    kl_penalty,
    masked_mean,
    masked_whiten,
    overlong_penalty,
    pack,
    pad_values,
    policy_loss,
    reinforce_pp_advantages,
    response_logprobs,
    rloo_advantages,
    sft_loss,
    token_logprobs,
    token_rewards,
    value_loss,
)


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def close(a, b, tol=1e-5):
    assert torch.allclose(a, t(b) if not isinstance(b, torch.Tensor) else b, atol=tol), (a, b)


def test_masked_mean_ignores_padding():
    x = t([[1.0, 2.0, 100.0], [4.0, 100.0, 100.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    close(masked_mean(x, mask), 7.0 / 3)
    close(masked_mean(x, mask, dim=1), [1.5, 4.0])
    close(masked_mean(x, torch.zeros_like(mask)), 0.0)


def test_masked_whiten_zero_mean_unit_std_over_real_tokens():
    x = t([[1.0, 3.0, 50.0]])
    mask = t([[1, 1, 0]])
    # mean 2, unbiased std sqrt(2) -> (-1/sqrt2, 1/sqrt2); the padded slot comes back as 0
    close(masked_whiten(x, mask), [[-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0]])


def test_grpo_group_mean_and_std():
    rewards = t([1.0, 0.0, 1.0, 1.0])
    # groups [1,0] and [1,1]: means 0.5 and 1
    close(grpo_advantages(rewards, n=2, norm_by_std=False), [0.5, -0.5, 0.0, 0.0])
    # [1,0] has unbiased std sqrt(0.5); an all-equal group gives 0, not NaN
    s = 0.5 / math.sqrt(0.5)
    close(grpo_advantages(rewards, n=2), [s, -s, 0.0, 0.0], tol=1e-4)
    with pytest.raises(ValueError, match="multiple of n"):
        grpo_advantages(t([1.0, 2.0, 3.0]), n=2)


def test_rloo_leave_one_out_baseline():
    # [1,0,0]: baselines 0, 0.5, 0.5
    close(rloo_advantages(t([1.0, 0.0, 0.0]), n=3), [1.0, -0.5, -0.5])
    close(rloo_advantages(t([2.0, 4.0, 5.0, 5.0]), n=2), [-2.0, 2.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="at least 2"):
        rloo_advantages(t([1.0]), n=1)


MASK = t([[1, 1, 0], [1, 1, 1]])
KL = t([[0.1, 0.2, 0.3], [0.1, 0.1, 0.1]])
SCORES = t([1.0, 2.0])


def test_token_rewards_put_the_score_on_the_last_token_and_kl_everywhere():
    # row 0: [-0.05, -0.1 + 1, pad]; row 1: [-0.05, -0.05, -0.05 + 2]
    close(token_rewards(SCORES, MASK, KL, kl_coef=0.5), [[-0.05, 0.9, 0.0], [-0.05, -0.05, 1.95]])
    close(token_rewards(SCORES, MASK), [[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])


def test_discounted_returns():
    r = token_rewards(SCORES, MASK, KL, kl_coef=0.5)
    close(discounted_returns(r, MASK, gamma=1.0), [[0.85, 0.9, 0.0], [1.85, 1.9, 1.95]])
    # gamma 0.5: -0.05 + 0.5 * 0.9 = 0.4; -0.05 + 0.5 * 1.95 = 0.925; -0.05 + 0.5 * 0.925
    close(discounted_returns(r, MASK, gamma=0.5), [[0.4, 0.9, 0.0], [0.4125, 0.925, 1.95]])


def test_reinforce_pp_whitens_returns_over_the_batch():
    adv = reinforce_pp_advantages(SCORES, MASK, KL, kl_coef=0.5)
    # returns .85 .9 | 1.85 1.9 1.95: mean 1.49, unbiased var (.4096+.3481+.1296+.1681+.2116)/4
    std = math.sqrt(1.267 / 4)
    expected = [[-0.64 / std, -0.59 / std, 0.0], [0.36 / std, 0.41 / std, 0.46 / std]]
    close(adv, expected, tol=1e-4)


def test_gae_matches_hand_recursion():
    rewards = t([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    values = t([[0.5, 0.6, 0.7], [0.5, 0.6, 9.0]])  # 9.0 sits on padding and must not count
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.5)
    # row 0: deltas .1 .1 .3 -> A2 .3, A1 .1 + .5*.3 = .25, A0 .1 + .5*.25 = .225
    # row 1: deltas .1, 1 - .6 = .4 -> A1 .4, A0 .1 + .5*.4 = .3
    close(adv, [[0.225, 0.25, 0.3], [0.3, 0.4, 0.0]])
    close(ret, [[0.725, 0.85, 1.0], [0.8, 1.0, 0.0]])
    # lam = 1, gamma = 1: advantages are return - value
    adv1, _ = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    close(adv1[0], [0.5, 0.4, 0.3])


def _policy_inputs():
    ratios = t([[1.5, 0.5, 1.0, 1.1], [1.0, 1.0, 40.0, 40.0]])  # row 1 ends in padding
    adv = t([[1.0, -1.0, 2.0, -1.0], [3.0, 3.0, 5.0, 5.0]])
    mask = t([[1, 1, 1, 1], [1, 1, 0, 0]])
    old = t([[-1.0, -2.0, -0.5, -0.3], [-1.0, -1.0, -1.0, -1.0]])
    return old + ratios.log(), old, adv, mask


def test_policy_loss_clipping_and_aggregation():
    logprobs, old, adv, mask = _policy_inputs()
    # row 0 per token: max(-A r, -A clip(r)) = -1.2 (clipped), .8 (clipped), -2, 1.1
    # row 1: -3, -3
    loss, clip_frac = policy_loss(logprobs, old, adv, mask, 0.2, 0.2, "token_mean")
    close(loss, (-1.2 + 0.8 - 2.0 + 1.1 - 3.0 - 3.0) / 6)
    close(clip_frac, 2 / 6)
    loss, _ = policy_loss(logprobs, old, adv, mask, 0.2, 0.2, "seq_mean")
    close(loss, ((-1.2 + 0.8 - 2.0 + 1.1) / 4 + (-3.0 - 3.0) / 2) / 2)


def test_policy_loss_clip_higher_lets_positive_advantages_grow():
    logprobs, old, adv, mask = _policy_inputs()
    # upper clip 1.6: token 0 (ratio 1.5, A = 1) is no longer clipped -> -1.5
    loss, clip_frac = policy_loss(logprobs, old, adv, mask, 0.2, 0.6)
    close(loss, (-1.5 + 0.8 - 2.0 + 1.1 - 3.0 - 3.0) / 6)
    close(clip_frac, 1 / 6)


def test_policy_loss_gradient_vanishes_on_clipped_tokens():
    logprobs, old, adv, mask = _policy_inputs()
    logprobs.requires_grad_(True)
    loss, _ = policy_loss(logprobs, old, adv, mask, 0.2, 0.2)
    loss.backward()
    # d/dlogp (-A r) = -A r, over 6 tokens; clipped tokens and padding get 0
    close(logprobs.grad, [[0.0, 0.0, -2.0 / 6, 1.1 / 6], [-3.0 / 6, -3.0 / 6, 0.0, 0.0]])


def test_policy_loss_weights_tokens_by_truncated_importance_ratio():
    logprobs, old, adv, mask = _policy_inputs()
    # behaviour (sampler) log-probs: token 0 twice as likely under the proximal policy, token 2
    # 5x (truncated to 2 by the caller's cap), the rest equal
    is_w = t([[2.0, 1.0, 2.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    loss, clip_frac = policy_loss(logprobs, old, adv, mask, 0.2, 0.2, "token_mean", is_weights=is_w)
    close(loss, (2 * -1.2 + 0.8 + 2 * -2.0 + 1.1 - 3.0 - 3.0) / 6)
    close(clip_frac, 2 / 6)  # the weights scale terms, they do not change which one is used
    logprobs.requires_grad_(True)
    loss, _ = policy_loss(logprobs, old, adv, mask, 0.2, 0.2, is_weights=is_w)
    loss.backward()
    close(logprobs.grad, [[0.0, 0.0, 2 * -2.0 / 6, 1.1 / 6], [-3.0 / 6, -3.0 / 6, 0.0, 0.0]])


def test_policy_loss_broadcasts_sequence_advantages():
    logprobs = t([[0.0, 0.0]])
    loss, clip_frac = policy_loss(logprobs, logprobs, t([2.0]), t([[1, 1]]))
    close(loss, -2.0)
    close(clip_frac, 0.0)


def test_kl_estimators():
    lp, ref = t([-1.0, -2.0, -1.5]), t([-2.0, -1.0, -1.5])
    close(kl_penalty(lp, ref, "k1"), [1.0, -1.0, 0.0])
    # k3 = e^(ref-lp) - (ref-lp) - 1: e^-1 - (-1) - 1 = e^-1 ; e - 1 - 1
    close(kl_penalty(lp, ref, "k3"), [math.exp(-1), math.e - 2, 0.0])
    assert (kl_penalty(torch.randn(100), torch.randn(100), "k3") >= 0).all()


def test_value_loss_with_and_without_clipping():
    values, old, returns, mask = t([[1.0, 2.0, 7.0]]), t([[0.5, 0.5, 0.0]]), t([[1.5, 0.0, 0.0]]), t([[1, 1, 0]])
    # token 0: (1-1.5)^2=.25 vs clipped (.7-1.5)^2=.64 -> .64; token 1: 4 vs .49 -> 4
    loss, frac = value_loss(values, old, returns, mask, clip=0.2)
    close(loss, 0.5 * (0.64 + 4.0) / 2)
    close(frac, 0.5)
    loss, _ = value_loss(values, old, returns, mask, clip=None)
    close(loss, 0.5 * (0.25 + 4.0) / 2)


def test_entropy_logprobs_and_sft_loss():
    logits = t([[[0.0, 0.0], [0.0, math.log(3.0)]]])
    # uniform over 2: ln 2; p = (.25, .75): -(.25 ln .25 + .75 ln .75)
    close(entropy_from_logits(logits), [[math.log(2), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]])
    targets = torch.tensor([[0, 1]])
    close(token_logprobs(logits, targets), [[math.log(0.5), math.log(0.75)]])
    close(sft_loss(logits, targets, t([[1, 1]])), -(math.log(0.5) + math.log(0.75)) / 2)
    close(sft_loss(logits, targets, t([[1, 0]])), -math.log(0.5))


def test_overlong_penalty_is_soft_then_full():
    # max 20, buffer 5: free up to 15, then -(L-15)/5, past 20 -1
    close(overlong_penalty(torch.tensor([10, 15, 16, 20, 25]), 20, 5), [0.0, 0.0, -0.2, -1.0, -1.0])
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([1]), 20, 0)


def test_pack_layout_and_positions():
    batch = pack([[5, 6], [7]], [[1, 2, 3], [4]], pad_id=0)
    assert batch.prompt_width == 2
    assert batch.input_ids.tolist() == [[5, 6, 1, 2, 3], [0, 7, 4, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 0, 1, 1, 1]]
    assert batch.response_ids.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert batch.response_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert pad_values([[0.5, 0.25], [1.0]], 3).tolist() == [[0.5, 0.25, 0.0], [1.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="at least one token"):
        pack([[1]], [[]], pad_id=0)


def test_response_logprobs_padded_batch_equals_single_rows():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        initializer_range=0.5)).eval()
    prompts, responses = [[3, 4, 5, 6], [7], [8, 9]], [[10, 11], [12, 13, 14], [15]]
    batch = pack(prompts, responses, pad_id=0)
    with torch.no_grad():
        lp, ent = response_logprobs(model, batch, with_entropy=True)
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) - 1 + len(r)]
            single = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None])[:, 0]
            close(lp[i, : len(r)], single, tol=1e-5)
        hot, _ = response_logprobs(model, batch, temperature=0.5)
    assert ent is not None and (ent[batch.response_mask.bool()] > 0).all()
    assert not torch.allclose(hot, lp)
