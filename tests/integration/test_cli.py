"""The `yatt` CLI against a live API (and, for `token create`, a database directly)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from sqlalchemy import select
from typer.testing import CliRunner

from backend.auth import service as auth_service
from backend.cli import app
from backend.db import Database
from backend.runs import lifecycle
from backend.runs.models import Run
from backend.settings import get_settings
from tests.conftest import LiveAPI

runner = CliRunner()


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"train": {"max_steps": 5, "batch_size": 4}, "placement": {"devices": 2}}))
    return path


def yatt(api: LiveAPI, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run `yatt ARGS` in-process against the live API."""
    get_settings.cache_clear()
    full_env = {"YATT_API_URL": api.url, "YATT_TOKEN": api.token, **(env or {})}
    try:
        result = runner.invoke(app, list(args), env=full_env)
    finally:
        get_settings.cache_clear()
    return result.exit_code, result.stdout, result.stderr


def finish_runs_in_background(api: LiveAPI, final: str, reason: str | None = None) -> threading.Thread:
    """Play the dispatcher and the trainer: take the project's next queued run to `final`."""

    def drive() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with api.database.session() as s:
                # this project's own queued runs: the session's shared database may hold more
                # queued runs of other tests than the dispatcher's first page
                mine = list(s.scalars(select(Run).where(Run.project_id == _project_id(api),
                                                        Run.state == "queued").order_by(Run.id)))
                if mine:
                    rid = mine[0].id
                    for state in ("starting", "running", final):
                        lifecycle.transition(db_session=s, run_id=rid, to_state=state, reason=reason)
                    return
            time.sleep(0.1)

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    return thread


def _project_id(api: LiveAPI) -> int:
    with api.database.read_session() as s:
        project = auth_service.get_project_by_name(db_session=s, name=api.project)
        assert project is not None
        return project.id


def test_token_create_bootstraps_a_project_and_prints_the_token_last(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'boot.db'}"
    result = subprocess.run(
        [sys.executable, "-m", "backend.cli", "token", "create", "--project", "team-a", "--role", "admin", "--url", url],
        capture_output=True, text=True, timeout=120, env={**os.environ, "YATT_DATA_DIR": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    token = result.stdout.strip().splitlines()[-1]
    assert token.startswith("yatt_") and len(token) > 40
    db = Database(url)
    try:
        with db.read_session() as s:
            principal = auth_service.authenticate(db_session=s, token=token)
        assert principal is not None and principal.project_name == "team-a" and principal.role == "admin"
    finally:
        db.dispose()
    bad = subprocess.run(
        [sys.executable, "-m", "backend.cli", "token", "create", "--project", "x", "--role", "root", "--url", url],
        capture_output=True, text=True, timeout=120,
    )
    assert bad.returncode == 2 and "--role" in bad.stderr


def test_submit_list_show_metrics_cancel(live_api: LiveAPI, config_file: Path) -> None:
    code, out, err = yatt(live_api, "submit", str(config_file), "--set", "train.max_steps=3",
                          "--experiment", "cli-exp", "--tag", "nightly", "--name", "from-cli", "--no-ci")
    assert code == 0, err
    run_id = int(out.strip().splitlines()[-1])
    run = live_api.client.get_run(run_id)
    assert run["config"]["train"]["max_steps"] == 3 and run["tags"] == ["nightly"]
    assert run["experiment"] == "cli-exp" and run["launched_by"] == "user"

    code, out, _ = yatt(live_api, "runs", "list")
    assert code == 0 and "from-cli" in out and "queued" in out
    code, out, _ = yatt(live_api, "runs", "show", str(run_id), "--json")
    assert code == 0 and json.loads(out)["id"] == run_id

    live_api.seed_metrics(run_id, [{"key": "reward/mean", "step": s, "value": s / 4} for s in range(4)])
    code, out, _ = yatt(live_api, "metrics", str(run_id))
    assert code == 0 and "reward/mean" in out and "0.75" in out
    code, out, _ = yatt(live_api, "metrics", str(run_id), "--key", "reward/mean", "--json")
    assert [p["step"] for p in json.loads(out)["reward/mean"]] == [0, 1, 2, 3]
    code, out, _ = yatt(live_api, "runs", "list", "--sort", "-reward/mean")
    assert code == 0 and "0.75" in out
    code, out, _ = yatt(live_api, "runs", "show", str(run_id))
    assert code == 0, out
    assert f"run {run_id}  from-cli  (cli-exp)" in out
    assert "state      queued, attempt 1 of 1" in out
    assert "reward/mean" in out and "0.75 (3)" in out  # latest at step 3
    assert f"/api/v1/runs/{run_id}" in out

    code, out, _ = yatt(live_api, "runs", "cancel", str(run_id))
    assert code == 0 and "cancelled" in out
    code, _, err = yatt(live_api, "runs", "show", str(run_id + 100_000))
    assert code == 2 and "404" in err


def test_submit_refuses_a_bad_config_naming_the_field(live_api: LiveAPI, config_file: Path) -> None:
    code, _, err = yatt(live_api, "submit", str(config_file), "--set", "rollout.n=0")
    assert code == 2 and "rollout.n" in err
    code, _, err = yatt(live_api, "submit", str(config_file), "--set", "novalue")
    assert code == 2 and "key.path=value" in err
    assert live_api.client.list_runs()["items"] == []


def test_submit_from_ci_records_the_pipeline(live_api: LiveAPI, config_file: Path) -> None:
    ci_env = {"GITLAB_CI": "true", "CI_COMMIT_SHA": "deadbeef", "CI_COMMIT_REF_NAME": "main",
              "CI_PIPELINE_URL": "https://gitlab.example.com/t/p/-/pipelines/9"}
    code, out, err = yatt(live_api, "submit", str(config_file), "--idempotency-key", "p9", env=ci_env)
    assert code == 0, err
    again_code, again_out, _ = yatt(live_api, "submit", str(config_file), "--idempotency-key", "p9", env=ci_env)
    assert again_code == 0 and again_out.strip().splitlines()[-1] == out.strip().splitlines()[-1]
    (run,) = live_api.client.list_runs()["items"]
    assert run["launched_by"] == "ci"
    assert run["ci"] == {"provider": "gitlab", "commit": "deadbeef", "branch": "main",
                         "pipeline_url": "https://gitlab.example.com/t/p/-/pipelines/9"}


def test_submit_wait_exits_nonzero_when_the_run_fails(live_api: LiveAPI, config_file: Path) -> None:
    driver = finish_runs_in_background(live_api, "failed", reason="loss is NaN")
    code, _, err = yatt(live_api, "submit", str(config_file), "--wait", "--poll-s", "0.2", "--no-ci")
    driver.join()
    assert code == 1 and "loss is NaN" in err and "failed" in err


def test_submit_wait_exits_zero_when_the_run_succeeds(live_api: LiveAPI, config_file: Path) -> None:
    """The real `yatt` executable, as a CI job calls it."""
    driver = finish_runs_in_background(live_api, "succeeded")
    result = subprocess.run(
        [sys.executable, "-m", "backend.cli", "submit", str(config_file), "--wait", "--poll-s", "0.2", "--no-ci"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "YATT_API_URL": live_api.url, "YATT_TOKEN": live_api.token},
    )
    driver.join()
    assert result.returncode == 0, result.stderr
    run_id = int(result.stdout.strip().splitlines()[-1])
    assert live_api.client.get_run(run_id)["state"] == "succeeded"
    assert "succeeded" in result.stderr


def test_commands_without_a_token_say_how_to_get_one(live_api: LiveAPI) -> None:
    code, _, err = yatt(live_api, "runs", "list", env={"YATT_TOKEN": ""})
    assert code == 2 and "yatt token create" in err


@pytest.fixture(autouse=True)
def _clean_settings() -> Iterator[None]:
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()
