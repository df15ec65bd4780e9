"""Fault drills (issue #10 item 11): real servers, as processes, stopped and started while real
runs train, and the numbers that matter counted afterwards (docs/reliability.md).

One stack for the module: a throwaway PostgreSQL cluster and a throwaway Redis (tests/
fault_servers.py), a Ray head that offers no devices plus one worker node that offers two (so
every run's controllers live on a node the drill can kill), the API and the worker.

1. PostgreSQL restarted mid-run: while it is down the API answers 503 with a readable message,
   the trainer's reporter spools; afterwards every metric point, event and checkpoint the trainer
   reported is stored exactly once and the run succeeds.
2. Redis (the broker) killed and restarted while runs train and others are queued or posted:
   the worker reconnects, every run ends `succeeded` on its first attempt with one Ray job.
3. The Ray worker node holding a run's controllers killed mid-run (a replacement node joins):
   the run resumes from its newest checkpoint (or retries) and succeeds, every step stored once.

Each drill records its figures; with YATT_DRILL_FIGURES=<file> they are appended there as JSON
lines (bench/fault_drills.py prints them as the table in docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests.fault_servers import RayWorkerNode, ThrowawayPostgres, ThrowawayRedis
from tests.integration.test_dispatch import events_of, ray_jobs_of, submit, tiny_config, wait_state
from tests.stack import Stack

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

TERMINAL = {"succeeded", "failed", "cancelled"}
# Events the API writes itself (state moves, checkpoint notes, admission): not the trainer's reports.
SERVER_EVENT_KINDS = {"state", "checkpoint", "admission"}
# Deadlines, not expectations: a quiet machine needs a tenth of them; a shared one under load all.
STARTUP_S, FINISH_S = 600.0, 900.0


@dataclass
class Drill:
    """The drill's stack and the servers it may stop."""

    stack: Stack
    postgres: ThrowawayPostgres
    broker: ThrowawayRedis
    node: RayWorkerNode
    api: httpx.Client
    model_dir: Path

    def sql(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        """Rows straight from the drill's database (not through the API under test)."""
        with psycopg.connect(self.postgres.dsn) as conn:
            return list(conn.execute(query, params).fetchall())


@pytest.fixture(scope="module")
def drill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Drill]:
    root = tmp_path_factory.mktemp("drill")
    postgres, broker = ThrowawayPostgres(), ThrowawayRedis()
    node: RayWorkerNode | None = None
    stack: Stack | None = None
    try:
        postgres.start()
        postgres.create_database("yatt")
        broker.start()
        stack = Stack(root, database_url=postgres.url_for("yatt"), broker_url=broker.url)
        stack.yatt("db", "upgrade")
        for tries_left in (4, 3, 2, 1, 0):
            try:
                stack.start_ray(devices=0)
                break
            except RuntimeError:  # Ray gives its raylet 30 s to register: a loaded machine misses it
                if not tries_left:
                    raise
        node = RayWorkerNode(stack.head.gcs_address, devices=2, log_path=root / "ray-node.log")
        node.start()
        wait_devices(stack, 2)
        stack.start("api")
        stack.start("worker")
        token = stack.token()
        with httpx.Client(base_url=f"{stack.api_url}/api/v1", headers={"Authorization": f"Bearer {token}"},
                          timeout=30) as api:
            drill = Drill(stack, postgres, broker, node, api, root / "models" / "nano")
            yield drill
            node = drill.node  # the drill may have replaced it
    finally:
        if node is not None:
            node.kill()
        if stack is not None:
            stack.down()
        broker.destroy()
        postgres.destroy()


def wait_devices(stack: Stack, devices: int, timeout_s: float = 120) -> None:
    """Wait until the cluster's alive nodes offer `devices` yatt devices."""
    from backend.dispatch.ray_cluster import RayCluster
    from backend.dispatch.service import cluster_devices

    deadline = time.monotonic() + timeout_s
    with RayCluster(stack.head.dashboard_url) as cluster:
        while time.monotonic() < deadline:
            if cluster_devices(cluster)[0] == devices:
                return
            time.sleep(0.5)
    raise TimeoutError(f"the Ray cluster does not offer {devices} devices; see {stack.root}")


def record(figures: dict[str, Any]) -> None:
    """Print a drill's figures, and append them to $YATT_DRILL_FIGURES when set."""
    print(json.dumps(figures))
    if path := os.environ.get("YATT_DRILL_FIGURES"):
        with open(path, "a") as f:
            f.write(json.dumps(figures) + "\n")


# --- what the trainer reported against what was stored ----------------------------------------


def reported_points(run_dir: Path) -> dict[tuple[str, int], float]:
    """Every (key, step) the trainer reported, with the last value it reported for it."""
    points: dict[tuple[str, int], float] = {}
    for name in ("warm_start.jsonl", "metrics.jsonl"):
        path = run_dir / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            for key, value in rec.items():
                if key not in ("step", "time"):
                    points[(key, int(rec["step"]))] = float(value)
    return points


def reported_events(run_dir: Path) -> tuple[Counter[tuple[str, str]], Counter[int]]:
    """(the trainer's events by (kind, message), its checkpoints by step) from events.jsonl."""
    events: Counter[tuple[str, str]] = Counter()
    checkpoints: Counter[int] = Counter()
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "checkpoint":
            checkpoints[int(rec["data"]["step"])] += 1
        elif rec["kind"] != "state":
            events[(rec["kind"], rec["message"])] += 1
    return events, checkpoints


def delivery(drill: Drill, run_id: int, run_dir: Path) -> dict[str, int]:
    """Points, events and checkpoints lost, doubled or wrong between the trainer and the database."""
    reported = reported_points(run_dir)
    stored_rows = drill.sql("SELECT key, step, value FROM metric_points WHERE run_id = %s", run_id)
    stored_count = Counter((key, int(step)) for key, step, _ in stored_rows)
    stored_value = {(key, int(step)): value for key, step, value in stored_rows}
    events, checkpoints = reported_events(run_dir)
    trainer_kinds = {kind for kind, _ in events}
    stored_events = Counter(
        (kind, message)
        for kind, message in drill.sql("SELECT kind, message FROM run_events WHERE run_id = %s", run_id)
        if kind in trainer_kinds and kind not in SERVER_EVENT_KINDS
    )
    stored_ckpts = Counter(int(step) for (step,) in drill.sql("SELECT step FROM checkpoints WHERE run_id = %s", run_id))
    return {
        "points_reported": len(reported),
        "points_lost": sum(1 for p in reported if p not in stored_count),
        "points_doubled": sum(n - 1 for n in stored_count.values() if n > 1),
        "points_unreported": sum(1 for p in stored_count if p not in reported),
        "points_wrong_value": sum(1 for p, v in reported.items() if p in stored_value and stored_value[p] != v),
        "events_reported": sum(events.values()),
        "events_lost": sum((events - stored_events).values()),
        "events_doubled": sum((stored_events - events).values()),
        "checkpoints_reported": sum(checkpoints.values()),
        "checkpoints_lost": sum((checkpoints - stored_ckpts).values()),
        "checkpoints_doubled": sum((stored_ckpts - checkpoints).values()),
    }


def assert_delivered_once(figures: dict[str, Any]) -> None:
    bad = {k: v for k, v in figures.items()
           if k.endswith(("_lost", "_doubled", "_unreported", "_wrong_value")) and v}
    assert not bad, figures


def wait_for(what: str, check: Any, timeout_s: float, interval_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")


def stored_max_step(drill: Drill, run_id: int, key: str = "reward/mean") -> int:
    rows = drill.sql("SELECT max(step) FROM metric_points WHERE run_id = %s AND key = %s", run_id, key)
    return int(rows[0][0] or 0)


# --- the drills ---------------------------------------------------------------------------------


def test_postgres_restarted_mid_run_loses_and_doubles_nothing(drill: Drill) -> None:
    run = submit(drill.api, tiny_config(drill.model_dir, steps=150, checkpoint__every_steps=10))
    running = wait_state(drill.api, run["id"], {"running"}, drill.stack, timeout_s=STARTUP_S)
    run_dir = Path(running["run_dir"])
    spool = run_dir / "spool" / "attempt-1"
    wait_for("the first stored checkpoint", lambda: drill.sql(
        "SELECT 1 FROM checkpoints WHERE run_id = %s", run["id"]), STARTUP_S)
    at_stop = stored_max_step(drill, run["id"])

    t_stop = time.monotonic()
    drill.postgres.stop("fast")
    # While it is down: a readable 503 at once, never a 500 or a hang; the trainer spools.
    answers = []
    for _ in range(3):
        t0 = time.monotonic()
        resp = drill.api.get(f"/runs/{run['id']}", timeout=10)
        answers.append((resp.status_code, resp.json().get("detail"), time.monotonic() - t0))
        time.sleep(0.5)
    ready = httpx.get(f"{drill.stack.api_url}/readyz", timeout=10)
    spooled = wait_for("the trainer to spool a report", lambda: len(list(spool.glob("*.json"))), 120)
    time.sleep(max(0.0, 6 - (time.monotonic() - t_stop)))  # about six seconds of outage
    drill.postgres.start()
    t_up = time.monotonic()
    wait_for("/readyz after the restart", lambda: httpx.get(f"{drill.stack.api_url}/readyz", timeout=5)
             .status_code == 200, 60)
    ready_s = time.monotonic() - t_up
    wait_for("the spool to drain", lambda: not list(spool.glob("*.json")), FINISH_S)
    drained_s = time.monotonic() - t_up

    done = wait_state(drill.api, run["id"], TERMINAL, drill.stack, timeout_s=FINISH_S)
    assert done["state"] == "succeeded", done.get("error")
    assert done["attempt"] == 1
    wait_for("the trainer's last reports", lambda: not list(spool.glob("*.json")), 60)
    figures = {
        "drill": "postgres_restart", "outage_s": round(t_up - t_stop, 1),
        "step_at_fault": at_stop, "spooled_batches_seen": spooled,
        "answers_while_down": sorted({code for code, _, _ in answers}),
        "slowest_answer_while_down_s": round(max(s for _, _, s in answers), 2),
        "api_ready_after_s": round(ready_s, 1), "spool_drained_after_s": round(drained_s, 1),
        **delivery(drill, run["id"], run_dir),
        "runs": 1, "runs_doubled": len(ray_jobs_of(drill.stack, run["id"])) - 1, "runs_stuck": 0,
    }
    record(figures)
    assert all(code == 503 and "database unavailable" in detail for code, detail, _ in answers), answers
    assert figures["slowest_answer_while_down_s"] < 5, answers
    assert ready.status_code == 503 and ready.json()["detail"] == "database unavailable"
    assert figures["points_reported"] > 0 and figures["checkpoints_reported"] > 0
    assert_delivered_once(figures)
    assert figures["runs_doubled"] == 0


def worker_answers_ping(broker_url: str) -> bool:
    """The Celery worker answers a broadcast ping over the broker (it is connected and consuming)."""
    from celery import Celery

    app = Celery("drill-ping", broker=broker_url)
    try:
        return bool(app.control.ping(timeout=2))
    except Exception:  # the broker itself is not there yet
        return False
    finally:
        app.close()


def test_redis_restarted_with_runs_training_and_queued_doubles_and_strands_none(drill: Drill) -> None:
    # two runs hold both devices, two more wait queued; the broker dies under them
    runs = [submit(drill.api, tiny_config(drill.model_dir, steps=30)) for _ in range(4)]
    wait_for("a run training", lambda: sum(
        drill.api.get(f"/runs/{r['id']}").json()["state"] == "running" for r in runs) >= 1, STARTUP_S, 0.5)
    assert wait_for("the worker on the broker", lambda: worker_answers_ping(drill.broker.url), 30)

    t_kill = time.monotonic()
    drill.broker.stop()
    # runs posted while the broker is down are stored (the message is lost; the reconciler re-drives)
    post_s = []
    for _ in range(2):
        t0 = time.monotonic()
        runs.append(submit(drill.api, tiny_config(drill.model_dir, steps=4)))
        post_s.append(time.monotonic() - t0)
    time.sleep(max(0.0, 5 - (time.monotonic() - t_kill)))
    drill.broker.start()
    t_up = time.monotonic()
    wait_for("the worker to reconnect to the broker", lambda: worker_answers_ping(drill.broker.url), 120, 0.5)
    reconnect_s = time.monotonic() - t_up

    finals = {r["id"]: wait_state(drill.api, r["id"], TERMINAL, drill.stack, timeout_s=FINISH_S) for r in runs}
    all_done_s = time.monotonic() - t_up
    jobs = {run_id: ray_jobs_of(drill.stack, run_id) for run_id in finals}
    figures = {
        "drill": "redis_restart", "outage_s": round(t_up - t_kill, 1), "runs": len(runs),
        "runs_posted_while_down": 2, "slowest_post_while_down_s": round(max(post_s), 2),
        "worker_reconnected_after_s": round(reconnect_s, 1), "all_runs_done_after_s": round(all_done_s, 1),
        "runs_succeeded": sum(r["state"] == "succeeded" for r in finals.values()),
        "runs_doubled": sum(max(0, len(j) - r["attempt"]) for r, j in
                            ((finals[i], jobs[i]) for i in finals)),
        "runs_retried": sum(r["attempt"] > 1 for r in finals.values()),
        "runs_stuck": sum(r["state"] not in TERMINAL for r in finals.values()),
    }
    record(figures)
    assert figures["runs_succeeded"] == len(runs), {i: (r["state"], r.get("error")) for i, r in finals.items()}
    assert figures["runs_doubled"] == 0 and figures["runs_retried"] == 0, jobs
    assert all(len(j) == 1 for j in jobs.values()), jobs
    assert figures["slowest_post_while_down_s"] < 5


def test_ray_node_killed_mid_run_resumes_from_checkpoint_with_every_step_once(drill: Drill) -> None:
    steps = 150
    run = submit(drill.api, tiny_config(drill.model_dir, steps=steps, checkpoint__every_steps=10), max_attempts=2)
    running = wait_state(drill.api, run["id"], {"running"}, drill.stack, timeout_s=STARTUP_S)
    run_dir = Path(running["run_dir"])
    # kill once a checkpoint is stored (the driver has then taken every report up to it, so the
    # resume point is at least there); what is stored lags what is trained by tens of steps on a
    # quiet machine, so the run is long enough (a 60-step run was over by then: nothing restarted)
    newest = wait_for("a stored checkpoint", lambda: drill.sql(
        "SELECT max(step) FROM checkpoints WHERE run_id = %s HAVING count(*) > 0", run["id"]), STARTUP_S)[0][0]
    at_kill = stored_max_step(drill, run["id"])

    t_kill = time.monotonic()
    killed = drill.node.kill()
    # the node is gone for good; a replacement joins, as an autoscaler or an operator would add one
    drill.node = RayWorkerNode(drill.stack.head.gcs_address, devices=2, log_path=drill.stack.root / "ray-node-2.log")
    drill.node.start()
    wait_for("training to go past the step of the kill", lambda: stored_max_step(drill, run["id"]) > at_kill, FINISH_S, 0.5)
    recover_s = time.monotonic() - t_kill

    done = wait_state(drill.api, run["id"], TERMINAL, drill.stack, timeout_s=FINISH_S)
    assert done["state"] == "succeeded", done.get("error")
    wait_for("the trainer's last reports", lambda: not list((run_dir / "spool").glob("*/*.json")), 60)
    restarts = [e for e in events_of(drill.api, run["id"], "restart") if "resume_step" in (e.get("data") or {})]
    jobs = ray_jobs_of(drill.stack, run["id"])
    steps_stored = Counter(int(s) for (s,) in drill.sql(
        "SELECT step FROM metric_points WHERE run_id = %s AND key = 'reward/mean'", run["id"]))
    figures = {
        "drill": "ray_node_killed", "processes_killed": len(killed), "step_at_fault": at_kill,
        "newest_checkpoint_at_fault": newest, "attempts": done["attempt"],
        "resumed_from_steps": sorted({int(e["data"]["resume_step"]) for e in restarts}),
        "recovered_after_s": round(recover_s, 1),
        "steps_lost": sum(1 for s in range(1, steps + 1) if s not in steps_stored),
        "steps_repeated": sum(n - 1 for n in steps_stored.values() if n > 1),
        **delivery(drill, run["id"], run_dir),
        "runs": 1, "runs_doubled": len(jobs) - done["attempt"], "runs_stuck": 0,
    }
    record(figures)
    assert killed and figures["resumed_from_steps"], figures
    # resumed from a checkpoint (every 10 steps), none older than the newest at the kill; how soon
    # the loss is noticed varies (a CI run on merged main resumed from step 40 after a kill at
    # step 10: see docs/reliability.md), what must not vary is that no step is lost or repeated
    assert all(s % 10 == 0 and newest <= s for s in figures["resumed_from_steps"]), figures
    assert figures["steps_lost"] == 0 and figures["steps_repeated"] == 0, figures
    assert figures["runs_doubled"] == 0, jobs
    # an attempt that died with its node may leave reports it never sent; none may be doubled
    if done["attempt"] == 1:
        assert_delivered_once(figures)
    else:
        assert figures["points_doubled"] == figures["events_doubled"] == figures["checkpoints_doubled"] == 0, figures
