"""Test setup for real-browser checks: Debian's chromium driven by Python Playwright.

`playwright install` (a browser download) fails on this machine, so the tests drive the system
browser that `make browser` installs with apt-get.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

CHROMIUM = Path("/usr/bin/chromium")
# Headless, no GPU, nothing phoning home: the machine has no network beyond localhost.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-quic",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_missing_reason() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is missing: install it with `make browser` (apt-get install chromium)"
    return None


def launch_browser(playwright: Any) -> Any:
    """A headless Chromium from the system install."""
    return playwright.chromium.launch(
        executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def running_dashboard(*, api_url: str, token: str, port: int | None = None,
                      timeout_s: float = 60.0) -> Iterator[str]:
    """Serve the dashboard with `yatt dashboard --port P --api-url U`; yields its base URL."""
    port = port or free_port()
    env = {**os.environ, "YATT_TOKEN": token}
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"yatt-dashboard-{port}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "backend.cli", "dashboard", "--port", str(port),
         "--api-url", api_url],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"dashboard exited with {proc.returncode}; see {log.name}")
            try:
                if httpx.get(f"{url}/_stcore/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"dashboard did not answer on {url} in {timeout_s:.0f}s")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
