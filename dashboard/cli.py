"""`yatt dashboard`: start the Streamlit app on dashboard/app.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

__all__ = ["APP", "dashboard_command", "register"]

APP = Path(__file__).with_name("app.py")


def dashboard_command(*, port: int = 8501, host: str = "127.0.0.1") -> list[str]:
    """The command line that serves the dashboard (also used by `yatt up`)."""
    return [
        sys.executable, "-m", "streamlit", "run", str(APP),
        "--server.port", str(port),
        "--server.address", host,
        "--server.headless", "true",
        "--browser.gatherUsageStats", "false",
        "--client.toolbarMode", "minimal",
    ]


def register(app: typer.Typer) -> None:
    @app.command()
    def dashboard(
        port: int = typer.Option(8501, help="Port the dashboard listens on."),
        host: str = typer.Option("127.0.0.1", help="Address to bind; 0.0.0.0 for all."),
        api_url: str = typer.Option(
            None, envvar="YATT_API_URL", help="The API's base URL (default http://127.0.0.1:8000)."
        ),
    ) -> None:
        """Serve the web dashboard: launch, watch, browse and compare runs."""
        env = dict(os.environ)
        if api_url:
            env["YATT_API_URL"] = api_url
        typer.echo(f"dashboard: http://{host}:{port}  (API {env.get('YATT_API_URL', 'default')})",
                   err=True)
        command = dashboard_command(port=port, host=host)
        # Become Streamlit, so signals (Ctrl-C, a supervisor's SIGTERM) reach the server itself.
        os.execve(command[0], command, env)
