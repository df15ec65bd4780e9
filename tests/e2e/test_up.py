"""`yatt up` on the embedded defaults (SQLite database, SQLite broker, a local Ray head): the stack
comes up, prints its URLs and token, trains a run submitted with `yatt submit --wait`, and Ctrl-C
stops everything it started and nothing else.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.integration.test_dispatch import tiny_config
from tests.stack import free_ports

# serial: runs alone, after the tests that run side by side (`make test`); it asserts
# on a failed Ray start given up within 60 s
pytestmark = [pytest.mark.slow, pytest.mark.serial]


def _descendants(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def test_up_trains_a_run_and_ctrl_c_stops_everything(tmp_path: Path) -> None:
    ports = dict(zip(("--api-port", "--dashboard-port", "--ray-dashboard-port", "--ray-port"),
                     free_ports(4), strict=True))
    env = {k: v for k, v in os.environ.items() if not k.startswith("YATT_")}
    env.update({"YATT_DATA_DIR": str(tmp_path / "data"), "YATT_RECONCILE_INTERVAL_S": "1",
                "PYTHONUNBUFFERED": "1"})
    args = [sys.executable, "-m", "backend.cli", "up", "--no-dashboard"]
    for flag, port in ports.items():
        args += [flag, str(port)]
    out_path = tmp_path / "up.out"
    with open(out_path, "wb") as out:
        up = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        text = ""
        while time.monotonic() < deadline and "Ctrl-C" not in text:
            assert up.poll() is None, out_path.read_text()
            time.sleep(0.5)
            text = out_path.read_text()
        assert "Ctrl-C" in text, text
        match = re.search(r"export YATT_API_URL=(\S+) YATT_TOKEN=(\S+)", text)
        assert match, text
        api_url, token = match.groups()
        assert api_url == f"http://127.0.0.1:{ports['--api-port']}"
        children = _descendants(up.pid)
        assert children

        config = tmp_path / "run.yaml"
        config.write_text(yaml.safe_dump(tiny_config(tmp_path / "nano", steps=2)))
        sub_env = {**env, "YATT_API_URL": api_url, "YATT_TOKEN": token}
        result = subprocess.run(
            [sys.executable, "-m", "backend.cli", "submit", str(config), "--wait", "--tag", "smoke"],
            env=sub_env, capture_output=True, text=True, timeout=400,
        )
        assert result.returncode == 0, result.stdout + result.stderr + (tmp_path / "data" / "logs" / "worker.log").read_text()[-3000:]
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=90)
    time.sleep(1)
    alive = [pid for pid in children if psutil.pid_exists(pid)
             and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], [psutil.Process(p).cmdline() for p in alive]
    assert "stopped" in out_path.read_text()


def test_up_on_a_taken_ray_port_says_which_option_and_starts_nothing(tmp_path: Path) -> None:
    import socket

    api_port, ray_dashboard_port = free_ports(2)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = int(held.getsockname()[1])
        env = {k: v for k, v in os.environ.items() if not k.startswith("YATT_")}
        env.update({"YATT_DATA_DIR": str(tmp_path / "data"), "PYTHONUNBUFFERED": "1"})
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "backend.cli", "up", "--no-dashboard",
                               "--api-port", str(api_port), "--ray-dashboard-port", str(ray_dashboard_port),
                               "--ray-port", str(taken)],
                              env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"port {taken}" in done.stderr and "--ray-port" in done.stderr, done.stderr
    assert "ray start exited" not in done.stderr  # refused before `ray start` ran
    assert time.monotonic() - started < 60  # not the ~40 s per attempt `ray start` takes to give up
