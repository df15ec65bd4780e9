"""The run lifecycle end to end on real parts: PostgreSQL, a Redis broker, a local Ray head, the
API and the Celery worker in their own processes, and the real trainer as a Ray job.

Every scenario of the dispatch issue: a CI-style submit that succeeds with metrics, events and a
checkpoint; cancel; the worker killed mid-run; the trainer killed mid-run (retry resumes from
its checkpoint); one Idempotency-Key → one Ray job; the API restarted mid-run → no point lost.
"""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import redis

from tests.stack import REDIS_URL, Stack, create_pg_database, drop_pg_database

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

REDIS_DB = 11


def tiny_config(model_dir: Path, *, steps: int = 6, **overrides: Any) -> dict[str, Any]:
    """A run of a few seconds: nano model, HF rollouts, one device, a checkpoint every 2 steps."""
    cfg: dict[str, Any] = {
        "model": {"path": str(model_dir), "preset": "nano"},
        "data": {"task": "arithmetic", "arithmetic": {"digits": 1, "train_size": 200, "eval_size": 16}},
        "algorithm": {"name": "grpo"},
        "train": {"max_steps": steps, "lr": 1e-4, "batch_size": 4},
        "rollout": {"engine": "hf", "n": 4, "max_new_tokens": 4},
        "placement": {"mode": "colocate", "devices": 1},
        "checkpoint": {"every_steps": 2},
        "eval": {"size": 16},
        "seed": 0,
    }
    for dotted, value in overrides.items():
        node = cfg
        *parents, last = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return cfg


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    url, name = create_pg_database("yatt_dispatch")
    broker = f"{REDIS_URL}/{REDIS_DB}"
    redis.Redis.from_url(broker).flushdb()
    st = Stack(tmp_path_factory.mktemp("stack"), database_url=url, broker_url=broker)
    try:
        st.up()
        yield st
    finally:
        st.down()
        drop_pg_database(name)
        redis.Redis.from_url(broker).flushdb()


@pytest.fixture(scope="module")
def api(stack: Stack) -> Iterator[httpx.Client]:
    token = stack.token()
    with httpx.Client(
        base_url=f"{stack.api_url}/api/v1", headers={"Authorization": f"Bearer {token}"}, timeout=30
    ) as client:
        yield client


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models") / "nano"


def submit(api: httpx.Client, config: dict[str, Any], **extra: Any) -> dict[str, Any]:
    headers = extra.pop("headers", {})
    resp = api.post("/runs", json={"experiment": "dispatch-tests", "config": config, **extra}, headers=headers)
    assert resp.status_code in (200, 201), resp.text
    return resp.json()


def wait_state(api: httpx.Client, run_id: int, states: set[str], stack: Stack, timeout_s: float = 240) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    run: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            run = api.get(f"/runs/{run_id}").json()
        except httpx.HTTPError:  # the API may be restarting
            time.sleep(0.5)
            continue
        if run["state"] in states:
            return run
        time.sleep(0.5)
    events = api.get(f"/runs/{run_id}/events").json()
    pytest.fail(f"run {run_id} is {run.get('state')}, not {states}\nevents: {events}\n{stack.logs()}")


def wait_metric(api: httpx.Client, run_id: int, key: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        series = api.get(f"/runs/{run_id}/metrics", params={"keys": key}).json()["series"]
        if series.get(key):
            return
        time.sleep(0.5)
    pytest.fail(f"run {run_id} reported no {key}")


def events_of(api: httpx.Client, run_id: int, kind: str) -> list[dict[str, Any]]:
    body = api.get(f"/runs/{run_id}/events", params={"limit": 1000}).json()
    items = body["items"] if isinstance(body, dict) else body
    return [e for e in items if e["kind"] == kind or not kind]


def ray_jobs_of(stack: Stack, run_id: int) -> list[dict[str, Any]]:
    from backend.dispatch.ray_cluster import RayCluster

    with RayCluster(stack.head.dashboard_url) as ray:
        return [j for j in ray.jobs() if (j.get("metadata") or {}).get("yatt_run_id") == str(run_id)]


def trainer_processes(stack: Stack, run_id: int) -> list[psutil.Process]:
    """The Ray job driver of a run of `stack`: the process whose environment says YATT_RUN_ID=<id>
    and reports to this stack's API (another stack on the machine, a fault drill's, has its own
    run 1)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if "trainer.entry" not in " ".join(proc.info.get("cmdline") or []):
            continue
        try:
            env = proc.environ()
            if env.get("YATT_RUN_ID") == str(run_id) and env.get("YATT_API_URL") == stack.api_url:
                found.append(proc)
        except psutil.Error:
            pass
    return found


def test_ci_submit_runs_to_success_with_metrics_events_and_checkpoint(
    stack: Stack, api: httpx.Client, model_dir: Path
) -> None:
    t0 = time.monotonic()
    run = submit(api, tiny_config(model_dir), ci={"commit": "abc123", "pipeline_url": "https://ci/p/1"},
                 tags=["ci"])
    assert run["state"] == "queued"
    running = wait_state(api, run["id"], {"running", "succeeded", "failed"}, stack)
    to_running = time.monotonic() - t0
    print(f"POST /runs -> {running['state']}: {to_running:.1f} s")
    done = wait_state(api, run["id"], {"succeeded", "failed"}, stack)
    assert done["state"] == "succeeded", done.get("error")
    keys = api.get(f"/runs/{run['id']}/metric-keys").json()
    names = {k["key"] if isinstance(k, dict) else k for k in (keys["items"] if isinstance(keys, dict) and "items" in keys else keys)}
    assert {"reward/mean", "throughput/gen_tokens_per_s", "time/rollout"} <= names
    ckpts = api.get(f"/runs/{run['id']}/checkpoints").json()
    assert ckpts and max(c["step"] for c in (ckpts["items"] if isinstance(ckpts, dict) else ckpts)) >= 2
    states = [e["data"]["to"] for e in events_of(api, run["id"], "state")]
    assert states[:3] == ["queued", "starting", "running"] and states[-1] == "succeeded"
    assert events_of(api, run["id"], "phase_spans")
    # the log outlives the Ray job: the reconciler stores it
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = api.get(f"/runs/{run['id']}/logs").text
        if "step" in text:
            break
        time.sleep(1)
    assert "step" in text


def test_cancel_a_running_run(stack: Stack, api: httpx.Client, model_dir: Path) -> None:
    run = submit(api, tiny_config(model_dir, steps=400))
    wait_state(api, run["id"], {"running"}, stack)
    wait_metric(api, run["id"], "reward/mean")
    resp = api.post(f"/runs/{run['id']}/cancel")
    assert resp.status_code == 200 and resp.json()["state"] in ("cancelling", "cancelled")
    done = wait_state(api, run["id"], {"cancelled", "failed", "succeeded"}, stack, timeout_s=120)
    assert done["state"] == "cancelled"
    jobs = ray_jobs_of(stack, run["id"])
    assert [j["status"] for j in jobs] == ["STOPPED"]
    assert api.post(f"/runs/{run['id']}/cancel").json()["state"] == "cancelled"  # idempotent


def test_same_idempotency_key_twice_launches_one_ray_job(stack: Stack, api: httpx.Client, model_dir: Path) -> None:
    cfg = tiny_config(model_dir, steps=2)
    first = submit(api, cfg, headers={"Idempotency-Key": "pipeline-812-job-3"})
    second = submit(api, cfg, headers={"Idempotency-Key": "pipeline-812-job-3"})
    assert first["id"] == second["id"]
    wait_state(api, first["id"], {"succeeded"}, stack)
    assert len(ray_jobs_of(stack, first["id"])) == 1


def test_worker_killed_mid_run_and_restarted(stack: Stack, api: httpx.Client, model_dir: Path) -> None:
    run = submit(api, tiny_config(model_dir, steps=8))
    wait_state(api, run["id"], {"running"}, stack)
    stack.kill("worker")
    # a run posted while no worker runs waits in the broker (and the reconciler re-drives it)
    waiting = submit(api, tiny_config(model_dir, steps=2))
    time.sleep(3)
    assert api.get(f"/runs/{waiting['id']}").json()["state"] == "queued"
    stack.start("worker")
    assert wait_state(api, run["id"], {"succeeded", "failed"}, stack)["state"] == "succeeded"
    assert wait_state(api, waiting["id"], {"succeeded", "failed"}, stack)["state"] == "succeeded"
    assert len(ray_jobs_of(stack, waiting["id"])) == 1


def test_trainer_killed_mid_run_is_retried_and_resumes_from_checkpoint(
    stack: Stack, api: httpx.Client, model_dir: Path
) -> None:
    # long enough (a nano step takes ~50 ms) that the kill lands while it trains
    run = submit(api, tiny_config(model_dir, steps=300, checkpoint__every_steps=20), max_attempts=2)
    wait_state(api, run["id"], {"running"}, stack)
    # wait for a checkpoint, then kill the trainer's Ray job driver outright
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        ckpts = api.get(f"/runs/{run['id']}/checkpoints").json()
        if ckpts:
            break
        time.sleep(0.5)
    assert ckpts, stack.logs()
    procs = trainer_processes(stack, run["id"])
    assert procs, "no trainer process found"
    killed_at = max(c["step"] for c in ckpts)
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
    done = wait_state(api, run["id"], {"succeeded"}, stack, timeout_s=300)
    assert done["attempt"] == 2
    attempts = [e for e in events_of(api, run["id"], "state") if e["data"]["to"] == "failed"]
    assert attempts and attempts[0]["data"]["reason"]
    deadline = time.monotonic() + 30  # the success report can overtake the last events
    resumed: list[dict[str, Any]] = []
    while time.monotonic() < deadline and not resumed:
        resumed = [e for e in events_of(api, run["id"], "restart") if e["attempt"] == 2]
        time.sleep(0.5)
    kinds = [(e["attempt"], e["kind"], e["message"][:80]) for e in events_of(api, run["id"], "")]
    assert resumed, "\n".join(map(str, kinds))
    assert killed_at <= resumed[0]["data"]["resume_step"] < 300, resumed
    deadline = time.monotonic() + 60  # the trainer reports success just before its job exits
    while time.monotonic() < deadline:
        statuses = sorted(j["status"] for j in ray_jobs_of(stack, run["id"]))
        if statuses == ["FAILED", "SUCCEEDED"]:
            break
        time.sleep(1)
    assert statuses == ["FAILED", "SUCCEEDED"]


def test_api_restarted_mid_run_loses_no_metric_point(stack: Stack, api: httpx.Client, model_dir: Path) -> None:
    run = submit(api, tiny_config(model_dir, steps=10))
    wait_state(api, run["id"], {"running"}, stack)
    wait_metric(api, run["id"], "reward/mean")
    stack.kill("api")
    time.sleep(6)  # the trainer keeps training and spools its reports
    stack.start("api")
    done = wait_state(api, run["id"], {"succeeded", "failed"}, stack)
    assert done["state"] == "succeeded", done.get("error")
    run_dir = Path(done["run_dir"])
    local: Counter[str] = Counter()
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        for key in rec.keys() - {"step", "time"}:
            local[key] += 1
    keys = sorted(local)
    series = api.get(f"/runs/{run['id']}/metrics",
                      params={"keys": ",".join(keys), "max_points": 10_000}).json()["series"]
    served = {k: len(v) for k, v in series.items()}
    assert served == dict(local)


def test_failing_run_fails_with_reason_and_submit_wait_exits_nonzero(
    stack: Stack, api: httpx.Client, model_dir: Path, tmp_path: Path
) -> None:
    import yaml

    bad = tiny_config(model_dir, steps=2)
    bad["reward"] = {"kind": "function", "function": "tests.no_such_module:score"}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    token = stack.token()
    env = {"YATT_TOKEN": token, "YATT_API_URL": stack.api_url}
    out = stack.yatt("submit", str(path), "--wait", "--experiment", "dispatch-tests", check=False,
                     timeout=300, env=env)
    assert out.returncode != 0, out.stdout + out.stderr
    good = path.with_name("good.yaml")
    good.write_text(yaml.safe_dump(tiny_config(model_dir, steps=2)))
    out = stack.yatt("submit", str(good), "--wait", check=False, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr


def test_run_that_does_not_fit_waits_queued_and_says_why(stack: Stack, api: httpx.Client, model_dir: Path) -> None:
    cluster = api.get("/cluster").json()
    assert cluster["reachable"] and cluster["devices"]["resource"] == "yatt_device"
    assert cluster["devices"]["total"] == 2 and cluster["nodes"][0]["alive"]
    big = submit(api, tiny_config(model_dir, placement__devices=4, train__batch_size=4), priority=5)
    deadline = time.monotonic() + 30
    reasons: list[str] = []
    while time.monotonic() < deadline and not reasons:
        reasons = [e["message"] for e in events_of(api, big["id"], "admission")]
        time.sleep(0.5)
    assert reasons and "needs 4 devices" in reasons[0] and "has 2" in reasons[0]
    assert api.get(f"/runs/{big['id']}").json()["state"] == "queued"
    assert api.post(f"/runs/{big['id']}/cancel").json()["state"] == "cancelled"
