"""`yatt up`: the whole stack on one machine — migrations, a local admin token, a local Ray
head, the API, the worker with its reconciler and the dashboard, as child processes that
Ctrl-C stops together."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    app.command("up")(up)


def _wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")


def _local_admin_token(project: str) -> str:
    """The stack's admin token, kept under the data dir and minted again if it stopped working."""
    from backend.auth import service as auth
    from backend.auth.models import Role
    from backend.db import Database
    from backend.settings import get_settings

    settings = get_settings()
    path = Path(settings.data_dir) / "admin_token"
    db = Database.from_settings(settings)
    try:
        with db.session() as s:
            if path.exists():
                token = path.read_text().strip()
                if auth.authenticate(db_session=s, token=token) is not None:
                    return token
            proj = auth.get_or_create_project(db_session=s, name=project)
            _, token = auth.create_token(
                db_session=s, project_id=proj.id, name="local-admin", role=Role.admin
            )
    finally:
        db.dispose()
    path.write_text(token + "\n")
    path.chmod(0o600)
    return token


def up(
    api_port: int = typer.Option(8000, help="Port of the HTTP API."),
    dashboard_port: int = typer.Option(8501, help="Port of the Streamlit dashboard."),
    ray_dashboard_port: int = typer.Option(8265, help="Port of the local Ray dashboard / Jobs API."),
    ray_port: int = typer.Option(
        6390, help="Port of the local Ray head (GCS); not in 10002-19999, Ray's worker ports."
    ),
    host: str = typer.Option("127.0.0.1", help="Interface the API and dashboard listen on."),
    project: str = typer.Option("default", help="Project of the local admin token."),
    demo: bool = typer.Option(False, help="Also submit configs/demo-arithmetic.yaml."),
    dashboard: bool = typer.Option(True, help="Start the dashboard when Streamlit is installed."),
) -> None:
    """Start the API, the worker and its reconciler, a local Ray head and the dashboard."""
    from backend.dispatch.local_ray import PortInUse, start_head, stop_head
    from backend.migrate import upgrade
    from backend.settings import get_settings

    api_url = f"http://{host}:{api_port}"
    os.environ["YATT_API_URL"] = api_url
    get_settings.cache_clear()
    settings = get_settings()
    data_dir = Path(settings.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    typer.echo(f"database: {settings.database_url}")
    upgrade(settings.database_url)
    token = _local_admin_token(project)

    head = None
    children: list[subprocess.Popen[bytes]] = []
    logs = data_dir / "logs"
    logs.mkdir(exist_ok=True)

    def spawn(name: str, args: list[str], **extra_env: str) -> subprocess.Popen[bytes]:
        out = open(logs / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen(
            [sys.executable, "-m", "backend.cli", *args], stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, env={**os.environ, **extra_env},
        )
        children.append(proc)
        return proc

    def shutdown(*_: object) -> None:
        typer.echo("\nstopping…")
        for proc in reversed(children):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in children:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        if head is not None:
            stop_head(head, settings)
        typer.echo("stopped")

    try:
        if settings.ray_address:
            ray_url = settings.ray_address
        else:
            typer.echo("starting a local Ray head…")
            try:
                head = start_head(
                    settings, port=ray_port, dashboard_port=ray_dashboard_port,
                    log_path=logs / "ray-head.log",
                )
            except PortInUse as exc:  # say which option chooses it
                flag = "--ray-port" if exc.port == ray_port else "--ray-dashboard-port"
                raise RuntimeError(f"{exc} ({flag})") from exc
            ray_url = head.dashboard_url
        api = spawn("api", ["api", "--host", host, "--port", str(api_port)])
        spawn("worker", ["worker"])
        dash_url = None
        if dashboard and _streamlit_installed():
            # the dashboard opens signed in with the stack's admin token
            spawn("dashboard", ["dashboard", "--port", str(dashboard_port), "--api-url", api_url],
                  YATT_TOKEN=token)
            dash_url = f"http://{host}:{dashboard_port}"
        _wait_http(f"{api_url}/healthz", 60, api)
        typer.echo(f"API:        {api_url}/api/v1   (docs: {api_url}/docs)")
        typer.echo(f"Ray:        {ray_url}")
        if dash_url:
            typer.echo(f"Dashboard:  {dash_url}")
        typer.echo(f"logs:       {logs}/")
        typer.echo(f"admin token (project {project!r}), also in {data_dir / 'admin_token'}:")
        typer.echo(f"export YATT_API_URL={api_url} YATT_TOKEN={token}")
        if demo:
            run = _submit_demo(api_url, token)
            typer.echo(f"demo run {run['id']} submitted ({run['state']}): yatt runs show {run['id']}")
        typer.echo("Ctrl-C stops everything this command started.")
        # Ctrl-C and SIGTERM both stop the stack, even when started where SIGINT was ignored
        # (a shell's background job).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        while True:
            for proc in children:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    except Exception as exc:
        typer.echo(f"error: {exc}", err=True)
        shutdown()
        raise typer.Exit(1) from exc
    shutdown()


def _streamlit_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("streamlit") is not None


def _submit_demo(api_url: str, token: str) -> dict[str, object]:
    import yaml

    from backend.client import YattClient

    config_path = Path(__file__).resolve().parents[1] / "configs" / "demo-arithmetic.yaml"
    config = yaml.safe_load(config_path.read_text())
    with YattClient(api_url, token) as client:
        return client.create_run(experiment="demo", config=config, tags=["demo"])
