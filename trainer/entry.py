"""`python -m trainer.entry`: the trainer as a Ray job (and the body of `yatt train`).

As a job, the dispatcher passes everything in environment variables (docs/contracts.md):
YATT_CONFIG_JSON, YATT_RUN_ID, YATT_ATTEMPT, YATT_API_URL, YATT_RUN_TOKEN, YATT_RUN_DIR. The
job connects to its cluster with `ray.init(address="auto")`; a retry of the run (a new attempt
with the same YATT_RUN_DIR) resumes from the newest checkpoint found there.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.config import ConfigError, TrainerConfig, parse_config

__all__ = ["connect_ray", "run_training", "main"]

PROJECT_ROOT = Path(__file__).resolve().parent.parent

# Progress bars of model loading and saving would drown the progress lines.
for _k, _v in (("HF_HUB_DISABLE_PROGRESS_BARS", "1"), ("TRANSFORMERS_VERBOSITY", "error")):
    os.environ.setdefault(_k, _v)


def connect_ray(cfg: TrainerConfig, address: str | None = None) -> str:
    """Connect to Ray: `address` (or RAY_ADDRESS, set for a job, or YATT_RAY_ADDRESS), else start
    a local head of our own whose CPU devices are declared as the `yatt_device` resource.

    A cluster merely found running on this machine is not joined: on a shared machine it may
    belong to someone else and go away mid-run. Returns how it connected, for the log."""
    import ray

    from trainer.placement import DEVICE_RESOURCE

    if ray.is_initialized():
        return "already connected"
    quiet = {"logging_level": "WARNING", "log_to_driver": True}
    address = address or os.environ.get("RAY_ADDRESS") or os.environ.get("YATT_RAY_ADDRESS")
    if address:
        ray.init(address=address, **quiet)
        return f"connected to {address}"
    runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(
        p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")) if p)}}
    p = cfg.placement
    cpus = max(os.cpu_count() or 1, int(p.devices * p.cpus_per_device + 0.999))
    resources = {} if p.device_type == "gpu" else {DEVICE_RESOURCE: float(p.devices)}
    ray.init(address="local", num_cpus=cpus, resources=resources, include_dashboard=False,
             runtime_env=runtime_env, **quiet)
    return f"started a local Ray head ({cpus} CPUs, {resources or 'GPUs'})"


def run_training(cfg: TrainerConfig, run_dir: str | Path, *, address: str | None = None,
                 env: dict[str, str] | None = None,
                 on_step: Callable[..., None] | None = None,
                 on_message: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run `cfg` to the end with outputs under `run_dir`; returns the summary."""
    from trainer.driver import Driver
    from trainer.telemetry import make_reporter

    driver_cls = Driver
    if cfg.controller.mode == "single":  # the verl-style baseline: the driver holds the loop
        from trainer.single_controller import SingleControllerDriver

        driver_cls = SingleControllerDriver

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    reporter = make_reporter(run_dir, flush_interval_s=cfg.report.flush_interval_s,
                             max_batch=cfg.report.max_batch, env=env)
    try:
        how = connect_ray(cfg, address)
        if on_message:
            on_message(how)
        (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
        driver = driver_cls(cfg, run_dir, reporter=reporter, on_step=on_step, on_message=on_message)
        return driver.run()
    except BaseException as exc:
        if not isinstance(exc, Exception) or "driver" not in locals():
            # failures before the driver took over (bad Ray address, ...) still reach the API
            reporter.set_state("failed", reason=f"{type(exc).__name__}: {exc}"[:4000])
        raise
    finally:
        reporter.close(timeout_s=30)


def main() -> int:
    env = dict(os.environ)
    run_dir = env.get("YATT_RUN_DIR") or f"runs/run-{env.get('YATT_RUN_ID', 'local')}"
    try:
        cfg = parse_config(json.loads(env.get("YATT_CONFIG_JSON") or "{}"))
    except (ConfigError, json.JSONDecodeError) as exc:
        from trainer.telemetry import make_reporter

        reporter = make_reporter(run_dir, env=env)
        reporter.set_state("failed", reason=f"invalid YATT_CONFIG_JSON: {exc}")
        reporter.close(timeout_s=30)
        print(f"invalid YATT_CONFIG_JSON: {exc}", file=sys.stderr)
        return 2
    # A job is started by Ray with RAY_ADDRESS set: connect to that cluster.
    address = "auto" if env.get("RAY_ADDRESS") else None
    print(f"yatt run {env.get('YATT_RUN_ID', '-')} attempt {env.get('YATT_ATTEMPT', '1')} "
          f"→ {run_dir}", flush=True)
    try:
        summary = run_training(cfg, run_dir, address=address, env=env,
                               on_step=_print_step, on_message=lambda m: print(m, flush=True))
    except Exception:
        traceback.print_exc()
        return 1
    print(json.dumps(summary, indent=2), flush=True)
    return 0


def format_step(step: int, total: int, m: dict[str, float]) -> str:
    """One progress line: step, reward, tokens/s and the phase times."""
    parts = [f"step {step:>4}/{total}"]
    if "reward/mean" in m:
        parts.append(f"reward {m['reward/mean']:.3f}")
    if "loss/sft" in m:
        parts.append(f"sft loss {m['loss/sft']:.3f}")
    parts.append(f"{m.get('throughput/tokens_per_s', 0.0):,.0f} tok/s")
    phases = [(k.split("/", 1)[1], v) for k, v in m.items()
              if k.startswith("time/") and k not in ("time/step",) and v >= 0.005]
    parts.append(" ".join(f"{name} {v:.2f}s" for name, v in phases))
    parts.append(f"step {m.get('time/step', 0.0):.2f}s")
    return " | ".join(p for p in parts if p)


def _print_step(step: int, metrics: dict[str, float], driver: Any) -> None:
    print(format_step(step, driver.cfg.train.max_steps, metrics), flush=True)


if __name__ == "__main__":
    sys.exit(main())
