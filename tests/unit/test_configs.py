"""Every shipped config validates and starts with the command that runs it."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_there_are_configs():
    assert len(CONFIGS) >= 3


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_validates_and_names_its_command(path):
    cfg = load_config(path)
    first = path.read_text().splitlines()[0]
    assert first.startswith("# yatt train ") or first.startswith("# yatt submit ")
    assert path.name in first
    assert cfg.train.batch_size % cfg.data_parallel_size == 0


@pytest.mark.parametrize(("changes", "wanted"), [
    ({"rollout": {"tensor_parallel_size": 2, "engine": "hf"}}, "needs rollout.engine=vllm"),
    ({"rollout": {"tensor_parallel_size": 2}, "placement": {"mode": "disaggregated", "devices": 4}},
     "placement.mode=colocate"),
    ({"rollout": {"tensor_parallel_size": 2}, "controller": {"mode": "single"}}, "controller.mode=parallel"),
    ({"rollout": {"tensor_parallel_size": 3}, "placement": {"devices": 4}}, "must divide placement.devices=4"),
])
def test_tensor_parallel_engines_that_cannot_be_placed_are_refused_naming_the_field(changes, wanted):
    from trainer.config import ConfigError, parse_config

    with pytest.raises(ConfigError) as err:
        parse_config(changes)
    assert "rollout.tensor_parallel_size" in str(err.value) and wanted in str(err.value)
    assert parse_config({"rollout": {"tensor_parallel_size": 2}, "placement": {"devices": 4}})


@pytest.mark.parametrize("bad", [0, -16, "sixteen", 2.5])
def test_a_shape_bucket_that_is_not_auto_or_a_positive_whole_number_is_refused_naming_the_field(bad):
    from trainer.config import ConfigError, parse_config

    with pytest.raises(ConfigError) as err:
        parse_config({"train": {"pad_to_multiple": bad}})
    assert "pad_to_multiple" in str(err.value)
    assert parse_config({"train": {"pad_to_multiple": 64}}).train.pad_to_multiple == 64
    assert parse_config({}).train.pad_to_multiple == "auto"
