"""`yatt api`, `yatt db`, `yatt token`, `yatt submit`, `yatt runs`, `yatt metrics`, `yatt logs`.

Everything but `api`, `db` and `token create` talks to the API through `YattClient`
(`YATT_API_URL`, `YATT_TOKEN`); `token create` works on the database directly, to bootstrap.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from backend.client import YattAPIError, YattClient
from backend.runs.state import retry_pending

db_app = typer.Typer(no_args_is_help=True, help="Database schema.")
token_app = typer.Typer(no_args_is_help=True, help="API tokens.")
runs_app = typer.Typer(no_args_is_help=True, help="List, inspect and cancel runs.")


def _client() -> YattClient:
    client = YattClient.from_env()
    if not client.token:
        typer.echo("set YATT_TOKEN (create one with `yatt token create --project P --role write`)", err=True)
        raise typer.Exit(2)
    return client


def _fail(exc: YattAPIError) -> typer.Exit:
    typer.echo(f"error: {exc}", err=True)
    for path, msg in exc.errors:
        typer.echo(f"  {path}: {msg}", err=True)
    return typer.Exit(2)


def _dump(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))


# --- server side ---------------------------------------------------------------------------


def api(
    host: Annotated[str | None, typer.Option(help="Default: YATT_API_HOST (127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Default: YATT_API_PORT (8000).")] = None,
    migrate: Annotated[bool, typer.Option(help="Run `db upgrade` before serving.")] = True,
    workers: Annotated[int, typer.Option(min=1)] = 1,
) -> None:
    """Serve the HTTP API (uvicorn)."""
    import uvicorn

    from backend import migrate as migrations
    from backend.settings import get_settings

    settings = get_settings()
    if migrate:
        migrations.upgrade(settings.database_url)
    uvicorn.run(
        "backend.app:create_app",
        factory=True,
        host=host or settings.api_host,
        port=port or settings.api_port,
        workers=workers,
        log_level="info",
        timeout_graceful_shutdown=5,  # open SSE streams must not hold a restart hostage
    )


@db_app.command("upgrade")
def db_upgrade(
    url: Annotated[str | None, typer.Option(help="Default: YATT_DATABASE_URL.")] = None,
    revision: str = "head",
) -> None:
    """Apply the migrations (safe to repeat)."""
    from backend import migrate as migrations

    migrations.upgrade(url, revision)
    typer.echo(f"database at revision {revision}")


@db_app.command("current")
def db_current(url: Annotated[str | None, typer.Option(help="Default: YATT_DATABASE_URL.")] = None) -> None:
    """Show the database's revision."""
    from backend import migrate as migrations

    migrations.current(url)


@token_app.command("create")
def token_create(
    project: Annotated[str, typer.Option(help="Created if it does not exist.")],
    role: Annotated[str, typer.Option(help="read, write or admin.")] = "write",
    name: Annotated[str | None, typer.Option(help="Default: `<role>-token`.")] = None,
    expires_in_s: Annotated[float | None, typer.Option(help="Default: never.")] = None,
    url: Annotated[str | None, typer.Option(help="Default: YATT_DATABASE_URL.")] = None,
) -> None:
    """Create a token directly in the database (to bootstrap); prints it alone on the last line."""
    from backend import migrate as migrations
    from backend.auth import service as auth_service
    from backend.auth.models import Role
    from backend.db import Database
    from backend.settings import get_settings

    if role not in ("read", "write", "admin"):
        typer.echo("--role must be read, write or admin", err=True)
        raise typer.Exit(2)
    url = url or get_settings().database_url
    migrations.upgrade(url)
    db = Database(url)
    try:
        with db.session() as db_session:
            proj = auth_service.get_or_create_project(db_session=db_session, name=project)
            row, value = auth_service.create_token(
                db_session=db_session,
                project_id=proj.id,
                name=name or f"{role}-token",
                role=Role(role),
                expires_in_s=expires_in_s,
            )
            typer.echo(f"token {row.id} ({row.name}, role {role}) for project {project}:", err=True)
    finally:
        db.dispose()
    typer.echo(value)


# --- client side --------------------------------------------------------------------------------


def ci_metadata(env: dict[str, str] | None = None) -> dict[str, Any] | None:
    """CI facts from the environment (GitLab CI, GitHub Actions, or generic YATT_CI_*)."""
    env = dict(os.environ if env is None else env)
    if env.get("GITLAB_CI"):
        return {
            "provider": "gitlab",
            "commit": env.get("CI_COMMIT_SHA"),
            "branch": env.get("CI_COMMIT_REF_NAME"),
            "pipeline_url": env.get("CI_PIPELINE_URL"),
            "job": env.get("CI_JOB_URL") or env.get("CI_JOB_NAME"),
        }
    if env.get("GITHUB_ACTIONS"):
        server, repo, run = env.get("GITHUB_SERVER_URL"), env.get("GITHUB_REPOSITORY"), env.get("GITHUB_RUN_ID")
        return {
            "provider": "github",
            "commit": env.get("GITHUB_SHA"),
            "branch": env.get("GITHUB_REF_NAME"),
            "pipeline_url": f"{server}/{repo}/actions/runs/{run}" if server and repo and run else None,
            "job": env.get("GITHUB_JOB"),
        }
    if env.get("YATT_CI_COMMIT") or env.get("YATT_CI_PIPELINE_URL"):
        return {
            "provider": env.get("YATT_CI_PROVIDER"),
            "commit": env.get("YATT_CI_COMMIT"),
            "branch": env.get("YATT_CI_BRANCH"),
            "pipeline_url": env.get("YATT_CI_PIPELINE_URL"),
        }
    return None


def submit(
    config: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="A TrainerConfig YAML file.")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override: key.path=value (repeatable).")] = None,
    experiment: Annotated[str, typer.Option(help="Created if needed.")] = "default",
    tag: Annotated[list[str] | None, typer.Option(help="Repeatable.")] = None,
    name: str | None = None,
    description: str | None = None,
    priority: int | None = None,
    max_attempts: int | None = None,
    max_duration_s: float | None = None,
    idempotency_key: Annotated[
        str | None, typer.Option(help="Resubmitting with the same key returns the same run.")
    ] = None,
    ci: Annotated[bool, typer.Option(help="Attach CI metadata found in the environment.")] = True,
    wait: Annotated[bool, typer.Option(help="Wait for the run; exit non-zero unless it succeeds.")] = False,
    timeout_s: Annotated[float | None, typer.Option(help="Give up waiting after this long.")] = None,
    poll_s: float = 2.0,
) -> None:
    """Queue a run from a config file; prints the run id alone on the last line."""
    from trainer.config import ConfigError, apply_overrides

    try:
        data = yaml.safe_load(config.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError([("", f"{config} must hold a mapping at the top level")])
        data = apply_overrides(data, set_ or [])
    except (ConfigError, yaml.YAMLError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    client = _client()
    try:
        run = client.create_run(
            experiment=experiment,
            config=data,
            tags=tag or [],
            name=name,
            description=description,
            ci=ci_metadata() if ci else None,
            priority=priority,
            max_attempts=max_attempts,
            max_duration_s=max_duration_s,
            idempotency_key=idempotency_key,
        )
        typer.echo(f"run {run['id']} ({run['name']}) {run['state']} in experiment {run['experiment']}", err=True)
        if not wait:
            typer.echo(run["id"])
            return
        try:
            final = client.wait_for_run(
                run["id"],
                poll_s=poll_s,
                timeout_s=timeout_s,
                on_change=lambda r: typer.echo(f"run {r['id']}: {r['state']}", err=True),
            )
        except TimeoutError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(3) from None
    except YattAPIError as exc:
        raise _fail(exc) from None
    if final.get("error"):
        typer.echo(f"error: {final['error']}", err=True)
    typer.echo(final["id"])
    if final["state"] != "succeeded":
        raise typer.Exit(1)


@runs_app.command("list")
def runs_list(
    state: Annotated[str | None, typer.Option(help="Comma-separated states.")] = None,
    experiment: str | None = None,
    tag: Annotated[list[str] | None, typer.Option(help="Repeatable: runs with every tag.")] = None,
    launched_by: Annotated[str | None, typer.Option(help="user or ci.")] = None,
    q: Annotated[str | None, typer.Option(help="Words in name, experiment, tags or description; best matches first.")] = None,
    sort: Annotated[
        str | None,
        typer.Option(help="created_at, priority, relevance or a metric key; '-' = descending. "
                     "Default: -relevance with --q, else -created_at."),
    ] = None,
    where: Annotated[list[str] | None, typer.Option(help="Repeatable metric filter, e.g. 'reward/mean>=0.5'.")] = None,
    limit: int = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List runs, newest first."""
    client = _client()
    try:
        page = client.list_runs(
            state=state, experiment=experiment, tag=tag, launched_by=launched_by, q=q, sort=sort,
            where=where, limit=limit,
        )
    except YattAPIError as exc:
        raise _fail(exc) from None
    if as_json:
        _dump(page)
        return
    metric = None if sort is None or sort.lstrip("-") in ("created_at", "priority", "relevance") else sort.lstrip("-")
    header = f"{'ID':>6}  {'STATE':<10}  {'EXPERIMENT':<20}  {'NAME':<28}  {'BY':<4}  CREATED"
    typer.echo(header + (f"  {metric}" if metric else ""))
    for r in page["items"]:
        line = (
            f"{r['id']:>6}  {r['state']:<10}  {r['experiment'][:20]:<20}  {r['name'][:28]:<28}  "
            f"{r['launched_by']:<4}  {r['created_at'][:19]}"
        )
        if metric:
            latest = r.get("metrics", {}).get(metric, {}).get("latest")
            line += f"  {latest if latest is not None else '-'}"
        typer.echo(line)
    if page.get("next_cursor"):
        typer.echo(f"(more: --limit or the API's cursor {page['next_cursor']})", err=True)


# The headline metrics of a summary, in this order, when the run reported them.
SUMMARY_KEYS = (
    "eval/accuracy", "reward/mean", "kl/mean", "loss/policy", "throughput/gen_tokens_per_s",
    "throughput/samples_per_s",
)


def _number(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def run_summary(
    run: dict[str, Any], attempts: list[dict[str, Any]], keys: list[dict[str, Any]], *,
    api_url: str, dashboard_url: str | None = None,
) -> str:
    """A run as a person reads it: what it is, its state and attempts, its key metrics and
    accuracy, and where to look next."""
    lines = [f"run {run['id']}  {run.get('name', '')}  ({run.get('experiment', '')})"]
    state = run["state"]
    if retry_pending(state, run.get("attempt", 1), run.get("max_attempts", 1)):
        state += " (a retry is pending)"
    lines.append(f"  state      {state}, attempt {run.get('attempt', 1)} of {run.get('max_attempts', 1)}")
    by = run.get("launched_by", "user")
    ci = run.get("ci") or {}
    if by == "ci" and ci:
        by += f" {ci.get('commit') or ''} {ci.get('branch') or ''}".rstrip()
    lines.append(f"  launched   {str(run.get('created_at', ''))[:19]} by {by}")
    if run.get("tags"):
        lines.append(f"  tags       {', '.join(run['tags'])}")
    if run.get("error"):
        lines.append(f"  error      {run['error'].splitlines()[0][:200]}")
    for a in attempts:
        end = str(a.get("finished_at") or "")[:19] or "-"
        error = f"  {a['error'].splitlines()[0][:80]}" if a.get("error") else ""
        lines.append(f"  attempt {a['number']}  {a['state']:<10} started {str(a.get('started_at') or '-')[:19]}"
                     f"  ended {end}{error}")
    by_key = {k["key"]: k for k in keys}
    shown = [k for k in SUMMARY_KEYS if k in by_key]
    if shown:
        lines.append("  metrics    latest (at step)     min          max")
        for key in shown:
            k = by_key[key]
            lines.append(f"    {key:<30} {_number(k.get('latest')):>10} ({k.get('latest_step')})"
                         f"  {_number(k.get('min')):>10}  {_number(k.get('max')):>10}")
    summary = run.get("summary") or {}
    accuracy = {k: v for k, v in summary.items() if "accuracy" in k}
    if accuracy:
        lines.append("  accuracy   " + ", ".join(f"{k} {_number(v)}" for k, v in sorted(accuracy.items())))
    lines.append(f"  api        {api_url.rstrip('/')}/api/v1/runs/{run['id']}")
    if dashboard_url:
        lines.append(f"  dashboard  {dashboard_url.rstrip('/')}/run?run={run['id']}")
    if run.get("run_dir"):
        lines.append(f"  run dir    {run['run_dir']}")
    return "\n".join(lines)


@runs_app.command("show")
def runs_show(
    run_id: int,
    as_json: Annotated[bool, typer.Option("--json", help="Print the run as JSON (for scripts).")] = False,
) -> None:
    """A run's summary: state, attempts, key metrics, accuracy, links."""
    client = _client()
    try:
        run = client.get_run(run_id)
        if as_json:
            _dump(run)
            return
        attempts = client.attempts(run_id)
        keys = client.metric_keys(run_id)
    except YattAPIError as exc:
        raise _fail(exc) from None
    typer.echo(run_summary(run, attempts, keys, api_url=client.api_url,
                           dashboard_url=os.environ.get("YATT_DASHBOARD_URL")))


@runs_app.command("cancel")
def runs_cancel(run_id: int, reason: str | None = None) -> None:
    """Cancel a run."""
    try:
        run = _client().cancel_run(run_id, reason)
    except YattAPIError as exc:
        raise _fail(exc) from None
    typer.echo(f"run {run['id']}: {run['state']}")


@runs_app.command("retry")
def runs_retry(run_id: int) -> None:
    """Queue a failed run again."""
    try:
        run = _client().retry_run(run_id)
    except YattAPIError as exc:
        raise _fail(exc) from None
    typer.echo(f"run {run['id']}: {run['state']} (attempt {run['attempt']})")


def metrics(
    run_id: int,
    key: Annotated[list[str] | None, typer.Option(help="Print this key's series (repeatable).")] = None,
    max_points: Annotated[int | None, typer.Option(help="Sample each series to this many points.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """A run's metrics: latest/min/max per key, or with --key the series."""
    client = _client()
    try:
        if key:
            data: Any = client.metrics(run_id, key, max_points=max_points)
        else:
            data = client.metric_keys(run_id)
    except YattAPIError as exc:
        raise _fail(exc) from None
    if as_json:
        _dump(data)
        return
    if key:
        typer.echo("KEY\tSTEP\tVALUE")
        for k, points in data.items():
            for p in points:
                typer.echo(f"{k}\t{p['step']}\t{p['value']}")
        return
    typer.echo(f"{'KEY':<36} {'STEP':>8} {'LATEST':>14} {'MIN':>14} {'MAX':>14} {'COUNT':>8}")

    def fmt(v: float | None) -> str:
        return "null" if v is None else f"{v:.6g}"

    for s in data:
        typer.echo(
            f"{s['key']:<36} {s['latest_step']:>8} {fmt(s['latest']):>14} {fmt(s['min']):>14} "
            f"{fmt(s['max']):>14} {s['count']:>8}"
        )


def logs(
    run_id: int,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines until the attempt ends.")] = False,
    attempt: Annotated[int | None, typer.Option(help="Which attempt (default: the current one).")] = None,
    tail: Annotated[int | None, typer.Option(help="Only the last N lines.")] = None,
) -> None:
    """A run's trainer log (Ray's live copy while it runs, the stored copy after)."""
    client = _client()
    try:
        if follow:
            for chunk in client.follow_logs(run_id, attempt=attempt):
                sys.stdout.write(chunk)
                sys.stdout.flush()
        else:
            sys.stdout.write(client.logs(run_id, attempt=attempt, tail=tail))
    except YattAPIError as exc:
        raise _fail(exc) from None
    except KeyboardInterrupt:
        pass


def register(app: typer.Typer) -> None:
    """Add the service commands to the `yatt` CLI."""
    app.command("api")(api)
    app.add_typer(db_app, name="db")
    app.add_typer(token_app, name="token")
    app.command("submit")(submit)
    app.add_typer(runs_app, name="runs")
    app.command("metrics")(metrics)
    app.command("logs")(logs)
