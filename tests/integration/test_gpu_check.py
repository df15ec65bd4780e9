"""bench/gpu_check.py on CPU with tiny shapes: the same code path the GPU run takes (FSDP2 over a
one-rank group, bf16 compute, HF engine loading the streamed weights), minus the GPU."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.slow


def test_gpu_check_runs_end_to_end_on_cpu_with_tiny_shapes(capsys):
    from bench import gpu_check

    rows = gpu_check.main(["--tiny"])
    assert len(rows) == 1
    row = rows[0]
    assert row["model"] == "tiny" and row["params"] > 0
    for key in ("train_tokens_per_s", "gen_tokens_per_s", "step_s", "est_train_gib"):
        assert math.isfinite(row[key]) and row[key] > 0, key
    assert row["mfu"] is None and row["train_peak_gib"] is None  # no GPU: not measured, not faked
    out = capsys.readouterr().out
    assert "| tiny |" in out and "total" in out


def test_mfu_counts_three_forwards_for_training_and_one_for_the_reference():
    from bench.gpu_check import QWEN25_05B, Workload, block_params, step_flops

    # Qwen2.5-0.5B: 494M parameters, 136M of them the (tied) embedding
    assert block_params(QWEN25_05B) + QWEN25_05B.vocab * QWEN25_05B.hidden == pytest.approx(494e6, rel=0.01)
    work = Workload(rows=1, prompt_tokens=0, response_tokens=1, micro_batch=1, steps=1,
                    gen_prompts=1, gen_n=1, gen_tokens=1)
    one_token = 2 * (block_params(QWEN25_05B) + QWEN25_05B.hidden * QWEN25_05B.vocab
                     + QWEN25_05B.layers * QWEN25_05B.hidden)
    assert step_flops(QWEN25_05B, work) == pytest.approx(4 * one_token)
