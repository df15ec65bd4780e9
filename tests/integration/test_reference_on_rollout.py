"""Reference log-probs computed beside the sampler (`placement.reference_on_rollout`): a rollout
worker's `FrozenReference` gives the learner's own reference pass, and a batch that carries them
trains exactly as one whose reference pass the learner ran."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainer.config import parse_config
from trainer.models import ensure_model

pytestmark = pytest.mark.slow


def _cfg(model_dir) -> dict:
    return {
        "model": {"path": str(model_dir), "preset": "nano"},
        "data": {"arithmetic": {"train_size": 200, "eval_size": 8}},
        "algorithm": {"name": "grpo", "kl_coef": 0.05},
        "train": {"lr": 3e-3, "micro_batch_size": 3, "mixed_precision": "fp32"},
        # temperature != 1: the reference's log-probs are those of the sampling distribution
        "rollout": {"engine": "hf", "n": 2, "max_new_tokens": 6, "temperature": 0.7},
        "placement": {"device_type": "cpu", "devices": 2, "mode": "disaggregated"},
    }


@pytest.fixture(scope="module")
def nano(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("models") / "nano"
    return ensure_model(parse_config(_cfg(model_dir)))


def _batch(vocab: int, rows: int = 8):
    from trainer.learner import RLBatch

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, vocab, (3 + i % 3,), generator=g).tolist() for i in range(rows)]
    responses = [torch.randint(2, vocab, (2 + (i * 3) % 6,), generator=g).tolist() for i in range(rows)]
    logprobs = [(-torch.rand(len(r), generator=g) * 4).tolist() for r in responses]
    return RLBatch(prompt_ids=prompts, response_ids=responses, scores=[float(i % 2) for i in range(rows)],
                   n=2, truncated=[False] * rows, sample_logprobs=logprobs, staleness=[1] * rows)


def _moved(learner, seed: int) -> None:
    """Move the policy off the model directory's weights, reproducibly."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in learner.policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def _learner(cfg, nano):
    from trainer.learner import Learner

    learner = Learner(cfg, nano)
    _moved(learner, 1)
    learner.sync_reference_to_policy()  # the reference leaves the model directory (a warm start's doing)
    _moved(learner, 2)  # and the policy leaves the reference
    return learner


def test_a_workers_frozen_reference_gives_the_learners_reference_logprobs(nano):
    from trainer.learner import FrozenReference

    cfg = parse_config(_cfg(nano))
    learner = _learner(cfg, nano)
    batch = _batch(learner.policy.config.vocab_size)
    worker = FrozenReference(cfg, nano)
    from_model_dir = worker.logprobs(batch.prompt_ids, batch.response_ids)
    worker.load(learner.iter_named_weights(reference=True))
    given = worker.logprobs(batch.prompt_ids, batch.response_ids)
    ids, attn, index, mask = learner._layout(batch.prompt_ids, batch.response_ids)
    with torch.no_grad():
        own = learner._chunk_logprobs(learner.reference, ids, attn, index, mask,
                                      torch.arange(len(batch)), temperature=0.7)[0]
    moved = 0.0
    for i, r in enumerate(batch.response_ids):
        assert len(given[i]) == len(r)
        torch.testing.assert_close(torch.tensor(given[i]), own[i, : len(r)], rtol=0, atol=2e-5)
        moved = max(moved, float((torch.tensor(from_model_dir[i]) - own[i, : len(r)]).abs().max()))
    assert moved > 1e-2, "the model directory's weights gave the reference's log-probs: load proved nothing"
    # a tensor that is not the model's, or one left out, is an error rather than a silent mix
    with pytest.raises(KeyError):
        worker.load([("model.not_a_layer.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="missing"):
        worker.load(list(learner.iter_named_weights(reference=True))[1:])


def test_a_batch_carrying_reference_logprobs_trains_like_the_learners_own_pass(nano):
    from trainer.learner import FrozenReference

    cfg = parse_config(_cfg(nano))
    own, given, wrong = (_learner(cfg, nano) for _ in range(3))
    batch = _batch(own.policy.config.vocab_size)
    worker = FrozenReference(cfg, nano)
    worker.load(own.iter_named_weights(reference=True))
    refs = worker.logprobs(batch.prompt_ids, batch.response_ids)
    half = [r if i % 2 == 0 else [] for i, r in enumerate(refs)]  # a worker scored some rows only
    start = {name: t.clone() for name, t in own.policy.state_dict().items()}  # the same in all three
    m_own = own.rl_step(batch)
    m_given = given.rl_step(dataclasses.replace(batch, ref_logprobs=half))
    m_wrong = wrong.rl_step(dataclasses.replace(batch, ref_logprobs=[[x + 0.5 for x in r] for r in half]))
    assert m_own["reference/rows"] == 8 and m_own["reference/given_frac"] == 0.0
    assert m_given["reference/rows"] == 4 and m_given["reference/given_frac"] == 0.5
    assert m_own["kl/mean"] > 1e-4  # the policy is off the reference: the KL has something to show
    assert m_given["kl/mean"] == pytest.approx(m_own["kl/mean"], rel=1e-4)
    assert m_given["loss/total"] == pytest.approx(m_own["loss/total"], rel=1e-4, abs=1e-6)
    assert abs(m_wrong["kl/mean"] - m_own["kl/mean"]) > 0.05  # the given values are the ones used
    # The worker's log-probs match the learner's to float rounding (its passes cut other micro-batch
    # shapes), and Adam's first update, lr * g / (|g| + eps), turns that into a few percent of an
    # element's update where its gradient is near eps (an AVX-512 Xeon: 2.4e-5 apart on 1 element of
    # 16,384): each tensor is compared by how far apart it ends against how far it moved.
    states = zip(own.policy.state_dict().items(), given.policy.state_dict().values(),
                 wrong.policy.state_dict().values(), strict=True)
    for (name, a), b, w in states:
        moved = float((a - start[name]).norm())
        assert moved > 0, f"{name} did not train"
        assert float((a - b).norm()) <= 1e-3 * moved, f"{name} trained apart"
        assert float((a - w).norm()) >= 0.1 * moved, f"{name}: wrong reference log-probs trained it the same"


def test_reference_logprobs_travel_with_their_rows_when_groups_are_dealt():
    from trainer.learner import RLBatch, _decode_rows, _encode_rows

    batch = RLBatch(prompt_ids=[[5, 6], [7]], response_ids=[[8, 9, 10], [11]], scores=[1.0, 0.0], n=2,
                    truncated=[True, False], sample_logprobs=[[-0.1, -0.2, -0.3], [-0.4]],
                    staleness=[1, 0], ref_logprobs=[[-1.5, -2.5, -3.5], []])
    ints, floats = _encode_rows(batch)
    rows = _decode_rows(ints, floats, 2)
    assert rows[0] == ([5, 6], [8, 9, 10], 1.0, True, [-0.1, -0.2, -0.3], 1, [-1.5, -2.5, -3.5])
    assert rows[1] == ([7], [11], 0.0, False, [-0.4], 0, [])
