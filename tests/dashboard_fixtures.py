"""Runs to look at, for the dashboard's tests (AppTest and the real browser).

The API is the live one of tests/conftest.py (`start_api`: API only, so nothing is dispatched
and runs stay where the seed puts them). Every run, metric point, event and state move is made
over HTTP through `YattClient`, as the trainer and the dispatcher send them: state moves with an
admin token, telemetry with the run token of the run's attempt.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from backend.client import YattClient
from tests.conftest import LiveServer

BIG_RUN_POINTS = 200_000
DEVICES = 2


@dataclass
class SeededApi:
    url: str
    token: str  # admin of the seeded project
    read_token: str
    runs: dict[str, int] = field(default_factory=dict)  # role in the seed -> run id
    run_tokens: dict[int, str] = field(default_factory=dict)  # run id -> its attempt's run token
    mint_run_token: Callable[[int], str] | None = None  # a started run's attempt token, as the dispatcher mints it


def step_metrics(step: int, t: float) -> list[dict[str, Any]]:
    """The metrics a trainer step reports (DESIGN.md §3.7), with plausible shapes."""
    reward = 0.2 + 0.6 * (1 - math.exp(-step / 15))
    values = {
        "throughput/gen_tokens_per_s": 2800 + 300 * math.sin(step / 3),
        "throughput/samples_per_s": 15 + math.sin(step / 4),
        "reward/mean": reward,
        "reward/std": 0.3 - 0.1 * reward,
        "kl/mean": 0.001 * step,
        "loss/policy": -0.05 + 0.02 * math.cos(step),
        "loss/total": 0.1 / (1 + step / 10),
        "response/length_mean": 6 + math.sin(step / 5),
        "sampling/valid_fraction": 0.7 + 0.2 * math.sin(step / 7),
        "sampling/oversample_ratio": 1.3 - 0.2 * math.sin(step / 7),
        "sampling/kept_groups": 12 + step % 4,
        "time/rollout": 1.2, "time/train": 0.8, "entropy": 1.5 - step / 100,
    }
    for d in range(DEVICES):
        values[f"device/{d}/util_pct"] = 60 + 30 * math.sin(step / 2 + d)
        values[f"device/{d}/memory_mb"] = 900 + 20 * d + step
        values[f"device/{d}/busy_frac"] = 0.8 - 0.05 * d
    return [{"key": k, "step": step, "value": v, "time": t} for k, v in values.items()]


def _spans(step: int, t0: float) -> dict[str, Any]:
    spans = []
    for d in range(DEVICES):
        t = t0
        for phase, dur in (("rollout", 1.0 + 0.2 * d), ("reward", 0.15), ("train", 0.7),
                           ("weight_sync", 0.1)):
            spans.append({"device": d, "phase": phase, "start": t, "end": t + dur, "step": step})
            t += dur
    return {"kind": "phase_spans", "message": f"step {step}", "data": {"spans": spans}}


def _report_steps(c: YattClient, run_id: int, steps: int, t0: float) -> None:
    points: list[dict[str, Any]] = []
    for step in range(steps):
        points += step_metrics(step, t0 + 2.5 * step)
    c.post_metrics(run_id, points)
    c.post_events(run_id, [
        {"kind": "placement", "message": "colocate on 2 devices",
         "data": {"mode": "colocate", "devices": DEVICES, "train_devices": list(range(DEVICES)),
                  "local_sampler_devices": list(range(DEVICES)), "rollout_devices": [],
                  "reward_devices": []}},
        *(_spans(step, t0 + 2.5 * step) for step in range(steps)),
    ])
    c.post_checkpoint(run_id, step=steps - 1, path=f"runs/{run_id}/checkpoints/step-{steps - 1}",
                      size_bytes=73_400_320, metrics={"reward/mean": 0.5})


def seed(c: YattClient, *, run_token: Callable[[int], str], big: bool = True) -> dict[str, int]:
    """Runs in every state a person meets and (with `big`) one with 200,000 metric points;
    returns their ids by role ("succeeded", "failed", "cancelled", "big", "running").
    `run_token(run_id)` mints the token of a started run's attempt (the dispatcher's job)."""
    t0 = time.time() - 3600
    cfg = {"train": {"max_steps": 40}, "placement": {"devices": DEVICES}}
    ids: dict[str, int] = {}

    def new(role: str, **kw: Any) -> int:
        run = c.create_run(experiment=kw.pop("experiment", "dash-seed"), name=role,
                           config=kw.pop("config", cfg), **kw)
        ids[role] = run["id"]
        return int(run["id"])

    def start(run_id: int) -> YattClient:
        c.report_state(run_id, "starting")
        c.report_state(run_id, "running")
        return YattClient(c.api_url, run_token(run_id), timeout=120)

    done = new("succeeded", tags=["baseline"], config={**cfg, "train": {"max_steps": 40,
                                                                        "lr": 5e-5}})
    with start(done) as trainer:
        _report_steps(trainer, done, 30, t0)
    c.report_state(done, "succeeded", summary={"reward/mean": 0.78})

    failed = new("failed", tags=["ci"], ci={"provider": "gitlab", "commit": "3f2a9c1e77",
                                           "branch": "main",
                                           "pipeline_url": "https://ci.example/p/812"})
    with start(failed) as trainer:
        _report_steps(trainer, failed, 5, t0 + 600)
    c.report_state(failed, "failed", reason="controller 1 died: out of memory at step 5")

    cancelled = new("cancelled")
    c.cancel_run(cancelled)  # a queued run is cancelled at once

    if big:
        big_run = new("big", experiment="dash-big", tags=["long"])
        with start(big_run) as trainer:
            _seed_big_run(trainer, big_run, t0)
        c.report_state(big_run, "succeeded", summary={"reward/mean": 0.99})

    running = new("running", tags=["baseline"])
    with start(running) as trainer:
        _report_steps(trainer, running, 12, time.time() - 30)
    return ids


def _seed_big_run(c: YattClient, run_id: int, t0: float) -> None:
    keys = ("reward/mean", "throughput/gen_tokens_per_s")
    per_key = BIG_RUN_POINTS // len(keys)
    batch: list[dict[str, Any]] = []
    for step in range(per_key):
        for i, key in enumerate(keys):
            batch.append({"key": key, "step": step,
                          "value": (1 - math.exp(-step / 20_000)) * (1 + i * 2800)
                          + 0.05 * math.sin(step / 5_000),
                          "time": t0 + step * 0.01})
        if len(batch) >= 10_000:  # the API's batch limit
            c.post_metrics(run_id, batch)
            batch = []
    if batch:
        c.post_metrics(run_id, batch)


def seed_project(server: LiveServer, *, big: bool = True) -> SeededApi:
    """A new project on a live API (tests/conftest.py's `start_api`), seeded by `seed`."""
    project = f"dash-{uuid.uuid4().hex[:8]}"
    admin = server.make_token(project, "admin")
    reader = server.make_token(project, "read")
    tokens: dict[int, str] = {}

    def run_token(run_id: int) -> str:
        tokens[run_id] = server.run_token(run_id)
        return tokens[run_id]

    with YattClient(server.url, admin, timeout=120) as c:
        ids = seed(c, run_token=run_token, big=big)
    return SeededApi(server.url, admin, reader, ids, tokens, run_token)
