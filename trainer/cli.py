"""`yatt train` and `yatt make-tiny-model`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    @app.command("train")
    def train(
        config: Annotated[Path, typer.Argument(help="Experiment config (YAML).", exists=True,
                                               dir_okay=False)],
        set_: Annotated[list[str] | None, typer.Option(
            "--set", help="Override a field: --set train.max_steps=5 (repeatable).")] = None,
        out: Annotated[Path | None, typer.Option(
            "--out", help="Run directory (default runs/<config>-<time>).")] = None,
    ) -> None:
        """Train standalone on a local Ray (started when none is running)."""
        from trainer.config import ConfigError, load_config
        from trainer.entry import format_step, run_training
        from trainer.placement.link import config_link_calibration
        from trainer.placement.memory import check_memory

        try:
            cfg = load_config(config, set_ or [])
            check_memory(cfg, probe_gpu=True)  # refuse a placement that cannot fit, before Ray
            config_link_calibration(cfg)  # and a link calibration that cannot be read
        except ConfigError as exc:
            for path, msg in exc.errors:
                typer.echo(f"config error: {path or '<top>'}: {msg}", err=True)
            raise typer.Exit(2) from None
        run_dir = out or Path("runs") / f"{config.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        typer.echo(f"yatt train {config} → {run_dir}  ({cfg.algorithm.name}, {cfg.placement.mode} "
                   f"on {cfg.placement.devices} devices, {cfg.controller.mode} controller, "
                   f"{cfg.rollout.engine} rollouts)")

        def on_step(step: int, metrics: dict[str, float], driver: object) -> None:
            typer.echo(format_step(step, cfg.train.max_steps, metrics))

        try:
            summary = run_training(cfg, run_dir, env={}, on_step=on_step,
                                   on_message=lambda m: typer.echo(m))
        except Exception as exc:
            typer.echo(f"training failed: {exc}", err=True)
            raise typer.Exit(1) from None
        start, end = summary.get("eval/accuracy_start"), summary.get("eval/accuracy_end")
        if start is not None and end is not None:
            typer.echo(f"held-out accuracy: start {start:.1%} → end {end:.1%} "
                       f"({(end - start) * 100:+.1f} points)")
        typer.echo(f"done in {summary['wall_time_s']:.0f}s; "
                   f"{summary.get('throughput/tokens_per_s_mean', 0):,.0f} generated tok/s; "
                   f"outputs in {run_dir}")

    @app.command("make-tiny-model")
    def make_tiny_model_cmd(
        out_dir: Annotated[Path, typer.Argument(help="Directory to create.")],
        preset: Annotated[str, typer.Option("--preset", help="nano | micro | small | reward")] = "micro",
        config: Annotated[Path | None, typer.Option(
            "--config", help="Train the tokenizer on this config's task (default: arithmetic).")] = None,
        seed: Annotated[int, typer.Option("--seed")] = 0,
        time_budget_s: Annotated[float, typer.Option(
            "--time-budget-s", help="reward: stop training after this long if not yet accurate.")] = 240.0,
        max_steps: Annotated[int, typer.Option(
            "--max-steps", help="reward: train this many steps, the learning rate decaying to 0 "
            "by the last (the same model on any machine, however busy), unless the time budget "
            "or 97% held-out agreement ends it first.")] = 2000,
    ) -> None:
        """Build a small random-init causal LM with a tokenizer trained on the task's text, or
        (`--preset reward`) train a small reward model that agrees with exact match."""
        from trainer.config import TrainerConfig, load_config
        from trainer.data import task_text
        from trainer.models import PRESETS, make_tiny_model

        if preset == "reward":
            _make_reward_model(out_dir, config, seed, time_budget_s, max_steps)
            return
        if preset not in PRESETS:
            typer.echo(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}, reward", err=True)
            raise typer.Exit(2)
        cfg = load_config(config) if config else TrainerConfig()
        try:
            path = make_tiny_model(out_dir, preset, task_text(cfg), seed=seed)
        except FileExistsError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(1) from None
        typer.echo(f"built {preset} model at {path}")


def _make_reward_model(out_dir: Path, config: Path | None, seed: int, time_budget_s: float,
                       max_steps: int) -> None:
    from trainer.config import TrainerConfig, load_config
    from trainer.rewards.tiny_reward_model import make_reward_model

    cfg = load_config(config) if config else TrainerConfig()
    if cfg.data.task != "arithmetic" or cfg.data.path is not None:
        typer.echo("--preset reward trains on the built-in arithmetic task only", err=True)
        raise typer.Exit(2)
    a = cfg.data.arithmetic
    try:
        report = make_reward_model(out_dir, digits=a.digits, ops=tuple(a.ops), seed=seed,
                                   time_budget_s=time_budget_s, max_steps=max_steps, log=typer.echo)
    except FileExistsError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    agree = report["held_out_agreement"]
    typer.echo(f"built reward model at {out_dir}: agrees with exact match on {agree:.1%} of "
               f"{report['held_out_pairs']} held-out pairs after {report['steps']} steps "
               f"({report['train_time_s']:.0f}s, {report['train_cpu_s']:.0f} CPU s)")
    if agree < 0.95:
        typer.echo("warning: below 95% agreement; rerun with a larger --time-budget-s", err=True)
