"""`yatt make-tiny-model` and `yatt train`'s config errors, through the real CLI app."""

from __future__ import annotations

from typer.testing import CliRunner

from backend.cli import app

runner = CliRunner()


def test_make_tiny_model_builds_a_loadable_model_once(tmp_path):
    out = tmp_path / "nano"
    result = runner.invoke(app, ["make-tiny-model", str(out), "--preset", "nano"])
    assert result.exit_code == 0, result.output
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out).num_parameters() > 0
    again = runner.invoke(app, ["make-tiny-model", str(out), "--preset", "nano"])
    assert again.exit_code == 1 and "already exists" in again.output
    bad = runner.invoke(app, ["make-tiny-model", str(tmp_path / "x"), "--preset", "huge"])
    assert bad.exit_code == 2 and "unknown preset" in bad.output


def test_train_refuses_a_bad_config_with_the_field_path(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  max_steps: 0\n")
    result = runner.invoke(app, ["train", str(cfg), "--set", "rollout.nn=3"])
    assert result.exit_code == 2
    assert "rollout.nn: unknown key" in result.output
    assert "train.max_steps" in result.output
