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
