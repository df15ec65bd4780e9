"""Metric ingest keeps one value per (run, key, step): retried batches, resumed attempts and
late points neither double nor lose anything, and counts/min/max match what is stored."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from backend.metrics.models import MetricBlock, MetricPoint
from backend.metrics.schemas import MetricPointIn
from backend.metrics.service import ingest
from backend.runs import lifecycle
from backend.runs.state import RunState
from tests.conftest import DATABASES, LiveAPI


def _run(api: LiveAPI) -> dict[str, Any]:
    return api.client.create_run(experiment="integrity", config={}, max_attempts=3)


def _points(steps: range, keys: tuple[str, ...], offset: float = 0.0) -> list[dict[str, Any]]:
    return [{"key": k, "step": s, "value": s + offset + i, "time": 1.0e9 + s}
            for s in steps for i, k in enumerate(keys)]


def _stored(api: LiveAPI, run_id: int) -> list[tuple[str, int, float | None, int]]:
    with api.database.read_session() as s:
        return [
            (k, step, v, a)
            for k, step, v, a in s.execute(
                select(MetricPoint.key, MetricPoint.step, MetricPoint.value, MetricPoint.attempt)
                .where(MetricPoint.run_id == run_id).order_by(MetricPoint.key, MetricPoint.step)
            )
        ]


@pytest.mark.parametrize("live_api", DATABASES, indirect=True)
def test_retried_batches_and_a_resume_leave_one_point_per_key_and_step(live_api: LiveAPI) -> None:
    run = _run(live_api)
    keys = ("reward/mean", "loss/policy")
    with live_api.run_client(run["id"]) as first:
        batch = _points(range(0, 20), keys)
        for _ in range(3):  # the reporter timed out twice and resent the same batch
            assert first.post_metrics(run["id"], batch, batch_id="a1-000000000001") == 40
        raw = httpx.post(f"{live_api.url}/api/v1/runs/{run['id']}/metrics",
                         headers={"Authorization": f"Bearer {first.token}"},
                         json={"batch_id": "a1-000000000001", "points": batch})
        assert raw.status_code == 200 and raw.headers["Idempotent-Replayed"] == "true"
        first.post_metrics(run["id"], _points(range(20, 30), keys), batch_id="a1-000000000002")

    # attempt 1 fails; attempt 2 resumes from the checkpoint at step 25 and repeats steps 25..29
    with live_api.database.session() as s:
        lifecycle.transition(db_session=s, run_id=run["id"], to_state=RunState.failed, reason="node lost")
    with live_api.run_client(run["id"]) as second:
        second.post_metrics(run["id"], _points(range(25, 40), keys, offset=1000.0), batch_id="a2-000000000001")

    stored = _stored(live_api, run["id"])
    assert len(stored) == len({(k, s) for k, s, _, _ in stored}) == 2 * 40
    by_step = {(k, s): (v, a) for k, s, v, a in stored}
    assert by_step[("reward/mean", 24)] == (24.0, 1)
    assert by_step[("reward/mean", 25)] == (1025.0, 2)  # the resumed attempt's value wins
    assert by_step[("loss/policy", 29)] == (1030.0, 2)

    summary = {m["key"]: m for m in live_api.client.metric_keys(run["id"])}
    assert summary["reward/mean"]["count"] == 40
    assert summary["reward/mean"]["min"] == 0.0
    assert summary["reward/mean"]["max"] == 1039.0
    assert summary["reward/mean"]["latest"] == 1039.0 and summary["reward/mean"]["latest_step"] == 39
    series = live_api.client.metrics(run["id"], ["reward/mean"])["reward/mean"]
    assert [p["step"] for p in series] == list(range(40))
    assert [p["value"] for p in series[24:27]] == [24.0, 1025.0, 1026.0]


@pytest.mark.parametrize("live_api", DATABASES, indirect=True)
def test_a_retried_events_batch_is_stored_once(live_api: LiveAPI) -> None:
    run = _run(live_api)
    events = [{"kind": "placement", "message": "colocate on 2 devices"}, {"kind": "warning", "message": "slow"}]
    with live_api.run_client(run["id"]) as trainer:
        for _ in range(3):  # the reporter timed out twice and resent the same batch
            assert trainer.post_events(run["id"], events, batch_id="a1-000000000007") == 2
        raw = httpx.post(f"{live_api.url}/api/v1/runs/{run['id']}/events",
                         headers={"Authorization": f"Bearer {trainer.token}"},
                         json={"batch_id": "a1-000000000007", "events": events})
        assert raw.status_code == 200 and raw.headers["Idempotent-Replayed"] == "true"
        assert raw.json()["accepted"] == 2
        # a new batch id (or none) is news; the same id in the metrics namespace is another batch
        assert trainer.post_events(run["id"], events[:1], batch_id="a1-000000000008") == 1
        assert trainer.post_events(run["id"], events[:1]) == 1
        assert trainer.post_metrics(run["id"], _points(range(1), ("loss",)), batch_id="a1-000000000007") == 1
        bad = httpx.post(f"{live_api.url}/api/v1/runs/{run['id']}/events",
                         headers={"Authorization": f"Bearer {trainer.token}"},
                         json={"batch_id": "no spaces", "events": events})
        assert bad.status_code == 422 and "batch_id" in bad.text
    timeline = [e for e in live_api.client.events(run["id"]) if e["kind"] in ("placement", "warning")]
    assert [e["kind"] for e in timeline] == ["placement", "warning", "placement", "placement"]


@pytest.mark.parametrize("live_api", DATABASES, indirect=True)
def test_overwriting_the_extreme_recomputes_min_max_and_blocks(live_api: LiveAPI) -> None:
    run = _run(live_api)
    with live_api.run_client(run["id"]) as c:
        c.post_metrics(run["id"], [{"key": "loss", "step": s, "value": 1.0} for s in range(100)])
        c.post_metrics(run["id"], [{"key": "loss", "step": 50, "value": 99.0},
                                   {"key": "loss", "step": 60, "value": -5.0}])
        summary = c.metric_keys(run["id"])[0]
        assert (summary["count"], summary["min"], summary["max"]) == (100, -5.0, 99.0)
        # the spike is overwritten again (without a batch id): max falls back, count stays
        c.post_metrics(run["id"], [{"key": "loss", "step": 50, "value": 1.0},
                                   {"key": "loss", "step": 50, "value": 2.0}])  # last in batch wins
        summary = c.metric_keys(run["id"])[0]
        assert (summary["count"], summary["min"], summary["max"]) == (100, -5.0, 2.0)
    with live_api.database.read_session() as s:
        total = s.scalar(select(func.sum(MetricBlock.count)).where(MetricBlock.run_id == run["id"]))
        block = s.get(MetricBlock, (run["id"], "loss", 50 // 64))
        assert block is not None
        extremes = (block.max_value, block.max_step, block.min_value, block.min_step)
    assert total == 100
    assert extremes == (2.0, 50, -5.0, 60)


@pytest.mark.parametrize("live_api", DATABASES, indirect=True)
def test_downsampling_keeps_every_buckets_extremes_and_first_non_finite_step(live_api: LiveAPI) -> None:
    """Each bucket of steps (`width` steps from the first; a 64-step block counts in the bucket
    of its first step) keeps its lowest and highest value and its first NaN, as stored points."""
    run = _run(live_api)
    live_api.start_attempt(run["id"])
    rng = random.Random(3)
    n, first, max_points = 20_000, 40, 200
    values = {s: rng.gauss(0, 1) for s in range(first, first + n)}
    for s in rng.sample(sorted(values), 30):
        values[s] = rng.choice([math.nan, math.inf, 40.0, -40.0])
    points = [MetricPointIn.model_construct(key="loss", step=s, value=v, time=float(s)) for s, v in values.items()]
    with live_api.database.session() as session:
        ingest(db_session=session, run_id=run["id"], points=points)

    series = live_api.client.metrics(run["id"], ["loss"], max_points=max_points)["loss"]
    assert len(series) <= max_points
    got = {p["step"]: p["value"] for p in series}
    for step, value in got.items():  # real points only
        stored = values[step]
        assert (value is None and not math.isfinite(stored)) or value == stored
    width = -(-n // ((max_points - 1) // 4))
    buckets: dict[int, list[int]] = {}
    for s in values:
        block_start = s // 64 * 64
        buckets.setdefault(max(0, block_start - first) // width if block_start > first else 0, []).append(s)
    for steps in buckets.values():
        finite = [s for s in steps if math.isfinite(values[s])]
        assert min(values[s] for s in finite) in got.values()
        assert max(values[s] for s in finite) in got.values()
        nonfinite = [s for s in steps if not math.isfinite(values[s])]
        if nonfinite:
            assert got.get(min(nonfinite), 0.0) is None
    assert max(got) == first + n - 1 and min(got) == first


def _downsampled(values: dict[int, float], max_points: int) -> list[dict[str, Any]]:
    """The documented sampling, written out point by point: `width`-step buckets from the first
    step ((max_points - 1) // 4 of them); each keeps its first point, and, over the 64-step
    blocks that start in it (a block starting before the first step counts in bucket 0), its
    lowest and highest finite value (the earliest step on ties) and its first non-finite step;
    plus the last point. When that is more than max_points, the last point goes first, then
    non-finite steps, highest, lowest and first points, each lowest step first."""
    steps = sorted(values)
    point = {s: {"step": s, "value": values[s] if math.isfinite(values[s]) else None, "time": s / 2}
             for s in steps}
    if len(steps) <= max_points:
        return [point[s] for s in steps]
    lo, last = steps[0], steps[-1]
    n = max(1, (max_points - 1) // 4)
    width = -(-(last - lo + 1) // n)
    kept: dict[int, int] = {}  # step: priority (lower: kept first)

    def keep(step: int, priority: int) -> None:
        kept[step] = min(priority, kept.get(step, priority))

    keep(last, 0)
    for i in range(n):
        after = [s for s in steps if s >= lo + i * width]
        if after:
            keep(after[0], 4)
    buckets: dict[int, list[int]] = {}
    for s in steps:
        block_start = s // 64 * 64
        buckets.setdefault(0 if block_start <= lo else (block_start - lo) // width, []).append(s)
    for members in buckets.values():
        finite = [s for s in members if math.isfinite(values[s])]
        if finite:
            keep(min(finite, key=lambda s: (-values[s], s)), 2)
            keep(min(finite, key=lambda s: (values[s], s)), 3)
        if len(finite) < len(members):
            keep(min(set(members) - set(finite)), 1)
    chosen = sorted(kept, key=lambda s: (kept[s], s))[:max_points]
    return [point[s] for s in sorted(chosen)]


@pytest.mark.parametrize("live_api", DATABASES, indirect=True)
def test_compare_and_the_run_page_sample_every_series_as_documented(live_api: LiveAPI) -> None:
    """Several runs and keys in one read, of every shape (dense, sparse, starting mid-block,
    ties, non-finite values, one point, shorter than max_points): each series comes back as
    the documented sampling picks it, whatever the database, and at every budget, down to the
    smallest, where the points compete for room."""
    rng = random.Random(12)
    shapes: dict[str, dict[int, float]] = {
        "dense": {s: rng.gauss(0, 1) for s in range(3_000)},
        "sparse": {s: rng.gauss(0, 1) for s in sorted(rng.sample(range(100, 50_000), 900))},
        "ties": {s: float(rng.randint(0, 3)) for s in range(70, 2_070)},
        "nan": {s: rng.choice([math.nan, math.inf, -math.inf, rng.random()]) for s in range(1_000)},
        "one": {7: 1.5},
        "short": {s: float(s) for s in range(0, 40, 3)},
    }
    runs = [_run(live_api)["id"] for _ in range(3)]
    series = {(run_id, key): {s: v + j for s, v in values.items()}  # each run's values differ
              for j, run_id in enumerate(runs) for key, values in shapes.items()}
    for run_id in runs:
        live_api.start_attempt(run_id)
        with live_api.database.session() as session:
            ingest(db_session=session, run_id=run_id, points=[
                MetricPointIn.model_construct(key=key, step=step, value=v, time=step / 2)
                for (r, key), values in series.items() if r == run_id for step, v in values.items()
            ])
    for max_points in (2, 3, 4, 5, 9, 50, 500):
        compared = live_api.client.compare(runs, list(shapes), max_points=max_points)
        for c in compared:
            run_id = c["run"]["id"]
            for key in shapes:
                expected = _downsampled(series[(run_id, key)], max_points)
                assert c["series"][key] == expected, (run_id, key, max_points)
        assert live_api.client.metrics(runs[1], ["ties", "nan"], max_points=max_points) == {
            key: _downsampled(series[(runs[1], key)], max_points) for key in ("ties", "nan")
        }


def test_a_spike_and_a_nan_survive_downsampling_a_million_points(live_api: LiveAPI) -> None:
    """SQLite only (the read path is the same SQL on PostgreSQL, covered by the tests above;
    seeding a million points there would double this test's minute)."""
    run = _run(live_api)
    n, spike, nan_step = 1_000_000, 612_345, 377_777
    live_api.start_attempt(run["id"])
    # seeded in bulk through the ingest service itself (no HTTP/JSON): 10 batches of 100,000
    for start in range(0, n, 100_000):
        points = []
        for s in range(start, start + 100_000):
            value = 250.0 if s == spike else math.nan if s == nan_step else 0.5 + 0.1 * math.sin(s / 5000)
            points.append(MetricPointIn.model_construct(key="loss", step=s, value=value, time=1.0))
        with live_api.database.session() as session:
            ingest(db_session=session, run_id=run["id"], points=points)
    series = live_api.client.metrics(run["id"], ["loss"], max_points=500)["loss"]
    assert 100 < len(series) <= 500
    steps = [p["step"] for p in series]
    assert steps == sorted(steps) and steps[-1] == n - 1
    assert {"step": spike, "value": 250.0, "time": 1.0} in series
    assert any(p["step"] == nan_step and p["value"] is None for p in series)
    low = min(p["value"] for p in series if p["value"] is not None)
    assert low == pytest.approx(0.4, abs=1e-6)  # the troughs of the curve are kept too


def test_idempotency_key_is_per_project_and_ignores_what_a_ci_retry_changes(live_api: LiveAPI) -> None:
    body = {"experiment": "ci", "config": {"seed": 3},
            "ci": {"provider": "gitlab", "commit": "3f2a9c1", "branch": "main",
                   "pipeline_url": "https://ci/p/812", "job": "https://ci/jobs/1001"}}
    headers = {"Idempotency-Key": "pipeline-812"}
    with httpx.Client(base_url=live_api.url + "/api/v1", timeout=30,
                      headers={"Authorization": f"Bearer {live_api.token}"}) as c:
        first = c.post("/runs", json=body, headers=headers)
        assert first.status_code == 201
        retried_job = {**body, "ci": {**body["ci"], "job": "https://ci/jobs/1002", "run_attempt": "2"}}
        again = c.post("/runs", json=retried_job, headers=headers)
        assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
        assert again.headers["Idempotent-Replayed"] == "true"
        other_commit = {**body, "ci": {**body["ci"], "commit": "9999999"}}
        assert c.post("/runs", json=other_commit, headers=headers).status_code == 409
        assert c.post("/runs", json={**body, "config": {"seed": 4}}, headers=headers).status_code == 409
    other_project = live_api.client_for("write", project=f"{live_api.project}-b")
    theirs = other_project.create_run(experiment="ci", config={"seed": 3}, ci=body["ci"],
                                      idempotency_key="pipeline-812")
    assert theirs["id"] != first.json()["id"] and theirs["project_id"] != first.json()["project_id"]
    other_project.close()


def test_migration_0005_folds_duplicates_and_recounts(tmp_path: Path) -> None:
    from sqlalchemy import text

    from backend.db import Database
    from backend.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'old.db'}"
    upgrade(url, "0002")  # the append-only schema, with a retried batch stored twice
    db = Database(url)
    try:
        with db.engine.begin() as conn:
            conn.execute(text("INSERT INTO projects (id, name, description, created_at) VALUES (1, 'p', '', '2026-01-01')"))
            conn.execute(text("INSERT INTO experiments (id, project_id, name, description, tags, created_at) "
                              "VALUES (1, 1, 'e', '', '[]', '2026-01-01')"))
            conn.execute(text(
                "INSERT INTO runs (id, project_id, experiment_id, name, description, config, seed, state, attempt, "
                "max_attempts, priority, launched_by, launched_by_name, created_at, updated_at) "
                "VALUES (1, 1, 1, 'r', '', '{}', 0, 'running', 1, 1, 0, 'user', '', '2026-01-01', '2026-01-01')"))
            rows = [{"s": s, "v": float(s), "t": 1.0} for s in range(100)]
            rows += [{"s": 50, "v": 500.0, "t": 2.0}, {"s": 7, "v": -7.0, "t": 2.0}]  # resent, newer values
            conn.execute(text("INSERT INTO metric_points (run_id, key, step, value, time) VALUES (1, 'loss', :s, :v, :t)"), rows)
            conn.execute(text("INSERT INTO metric_summaries (run_id, key, latest, latest_step, latest_time, min, max, count) "
                              "VALUES (1, 'loss', 99.0, 99, 1.0, -7.0, 500.0, 102)"))
        upgrade(url)
        with db.read_session() as s:
            stored = dict(s.execute(select(MetricPoint.step, MetricPoint.value).where(MetricPoint.run_id == 1)).all())
            summary = s.execute(text("SELECT count, min, max, latest FROM metric_summaries")).one()
            blocks = s.execute(select(MetricBlock.block, MetricBlock.count, MetricBlock.max_step, MetricBlock.min_step)
                               .order_by(MetricBlock.block)).all()
    finally:
        db.dispose()
    assert len(stored) == 100 and stored[50] == 500.0 and stored[7] == -7.0  # the newest row of each step
    assert tuple(summary) == (100, -7.0, 500.0, 99.0)
    assert [tuple(b) for b in blocks] == [(0, 64, 50, 7), (1, 36, 99, 64)]
