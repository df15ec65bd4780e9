"""The sampler's dtype (`rollout.dtype: auto`) and the torch-free memory check that reads it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trainer import precision
from trainer.config import parse_config


@pytest.mark.parametrize(("native", "rollout", "want"), [
    (True, {}, "bfloat16"),                          # vLLM on an AMX/AVX512-BF16 CPU
    (False, {}, "float32"),                          # no native bf16: the model's dtype
    (True, {"engine": "hf"}, "float32"),             # HF generate on a CPU keeps fp32
    (True, {"dtype": "float32"}, "float32"),         # an explicit setting wins
    (False, {"dtype": "bfloat16"}, "bfloat16"),
])
def test_auto_sampler_dtype_follows_the_cpu(monkeypatch, native, rollout, want):
    monkeypatch.setattr(precision, "cpu_native_bf16", lambda: native)
    assert precision.sampler_dtype(parse_config({"rollout": rollout}), "cpu") == want


def test_auto_keeps_a_half_precision_model_as_it_is(monkeypatch):
    monkeypatch.setattr(precision, "cpu_native_bf16", lambda: True)
    cfg = parse_config({"model": {"dtype": "float16"}})
    assert precision.sampler_dtype(cfg, "cpu") == "float16"


def test_the_memory_check_before_launch_does_not_import_torch():
    """The API refuses a placement that cannot fit on every POST /runs: that path stays light."""
    code = ("import sys; from trainer.config import parse_config; "
            "from trainer.placement.memory import estimate_memory; "
            "from trainer.placement.memory import ModelShape; "
            "est = estimate_memory(parse_config({}), device_type='cpu', "
            "shape=ModelShape(layers=2, hidden=64, intermediate=256, vocab=300, heads=2, kv_heads=1)); "
            "assert est is not None and est.peak_bytes > 0; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
