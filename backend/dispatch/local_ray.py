"""A local Ray head for the embedded stack, started on demand and stopped with nothing else.

`ray start --head --block` runs as our child in its own process group; stopping it sends
SIGTERM to that group and then kills whatever still names this head's temp dir, so a second
stack or another Ray on the machine is never touched (unlike `ray stop`, which stops all).

Devices: on a GPU node Ray counts the GPUs; on a CPU-only machine every core becomes one
device, declared as the logical resource `yatt_device` (DESIGN.md §3.3).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from backend.dispatch.ray_cluster import RayCluster, local_head_file
from backend.settings import Settings

DEVICE_RESOURCE = "yatt_device"


@dataclass
class LocalHead:
    dashboard_url: str
    gcs_address: str
    temp_dir: str
    pid: int
    devices: int

    def alive(self) -> bool:
        return psutil.pid_exists(self.pid) and RayCluster(self.dashboard_url).ping()


def free_ports(count: int, exclude: Collection[int] = ()) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 now, none of them in ``exclude``.

    Every socket stays bound until all are chosen: picked one at a time, the kernel may hand out
    the same port twice (seen: a Ray head given one port for its GCS and its dashboard).
    """
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            sock = socket.socket()
            held.append(sock)  # an excluded port stays held too, so it is not offered again
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
            if port not in exclude:
                ports.append(port)
        return ports
    finally:
        for sock in held:
            sock.close()


def count_devices() -> int:
    """GPUs when there are GPUs, else one device per core."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            gpus = int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
        if gpus:
            return gpus
    except Exception:  # no NVML library or no driver: a CPU machine
        pass
    return os.cpu_count() or 1


def read_head(settings: Settings) -> LocalHead | None:
    """The local head recorded under the data dir, if its process still runs."""
    try:
        head = LocalHead(**json.loads(local_head_file(settings).read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return head if head.alive() else None


class HeadExited(RuntimeError):
    """`ray start` exited before its head answered."""


class PortInUse(RuntimeError):
    """A port the head was asked to listen on is taken."""

    def __init__(self, port: int, role: str):
        super().__init__(f"port {port} ({role}) is in use on 127.0.0.1: choose another one, or stop "
                         "what listens there")
        self.port, self.role = port, role


def port_in_use(port: int) -> bool:
    """Whether a socket listens on (or holds) ``port`` on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed one's TIME_WAIT is no owner
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _log_tail(log_path: Path | None, lines: int = 5) -> str:
    if log_path is None:
        return ""
    try:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return ("; its log ends: " + " | ".join(x.strip() for x in tail)) if tail else ""


def _agent_listen_port(temp_dir: str) -> int | None:
    """The port the head node's dashboard agent serves HTTP on, from the port file it writes into
    the session directory once it has started: -1 when its HTTP server failed to start (the port
    was taken), None while the file is not there yet."""
    for path in Path(temp_dir, "session_latest").glob("dashboard_agent_listen_port_*"):
        try:
            return int(path.read_text().strip())
        except (OSError, ValueError):
            return None  # being written
    return None


def _held_by(root_pid: int, ports: list[int]) -> dict[int, bool]:
    """For each of ``ports`` that something listens on: whether a process of the Ray head
    started as ``root_pid`` (it or a descendant) is among its listeners."""
    try:
        root = psutil.Process(root_pid)
        mine = {root_pid, *(c.pid for c in root.children(recursive=True))}
    except psutil.NoSuchProcess:
        mine = set()
    held: dict[int, bool] = {}
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port in ports:
            held[conn.laddr.port] = held.get(conn.laddr.port, False) or conn.pid in mine
    return held


def start_head(
    settings: Settings,
    *,
    port: int = 6390,
    dashboard_port: int = 8265,
    devices: int | None = None,
    timeout_s: float = 120.0,
    log_path: Path | None = None,
    attempts: int = 3,
) -> LocalHead:
    """Start `ray start --head --block` and wait until its Jobs API answers.

    Ray's agents get ports found free here (`free_ports`), and a port found free can be taken by
    another process before Ray binds it; when `ray start` exits before its head answers, or its
    dashboard agent reports that it could not listen on its port (Ray then keeps a head that
    answers but refuses every job), or another process listens on one of those ports, it is
    started again with fresh agent ports, up to `attempts` times. The head counts as started once
    it lists its node, its dashboard agent has reported its port, and a process of the head
    listens on every agent port. The head's own ports (`port`,
    `dashboard_port`) are the caller's and are kept: one that is taken before the start is
    `PortInUse` at once (`ray start` would retry its GCS for about 40 s and exit); one taken during
    it fails every attempt, and the error names both and ends with the head's log."""
    for p, role in ((port, "the Ray head's GCS"), (dashboard_port, "the Ray dashboard")):
        if port_in_use(p):
            raise PortInUse(p, role)
    for attempt in range(1, attempts + 1):
        try:
            return _start_head_once(settings, port=port, dashboard_port=dashboard_port,
                                    devices=devices, timeout_s=timeout_s, log_path=log_path)
        except HeadExited as e:
            if attempt == attempts:
                raise HeadExited(f"the local Ray head did not start in {attempts} attempts (its ports: "
                                 f"{port} for the GCS, {dashboard_port} for the dashboard; are they "
                                 f"free?): {e}") from e
    raise AssertionError("unreachable")


def _start_head_once(
    settings: Settings,
    *,
    port: int,
    dashboard_port: int,
    devices: int | None,
    timeout_s: float,
    log_path: Path | None,
) -> LocalHead:
    devices = count_devices() if devices is None else devices  # 0: a head that holds no run
    temp_dir = f"/tmp/yatt-ray-{dashboard_port}"  # short: Ray's unix socket paths are limited
    shutil.rmtree(temp_dir, ignore_errors=True)
    agent_ports = free_ports(5, exclude={port, dashboard_port})
    cmd = [
        str(Path(sys.executable).with_name("ray")),
        "start",
        "--head",
        "--block",
        f"--port={port}",
        "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard_port}",
        f"--temp-dir={temp_dir}",
        f"--num-cpus={os.cpu_count() or 1}",
        f"--resources={json.dumps({DEVICE_RESOURCE: devices})}",
        "--include-dashboard=true",
        "--disable-usage-stats",
        # Ray's agents otherwise take fixed ports (52365, ...): a second head on the machine
        # would find them taken and refuse jobs ("No available agent to submit job").
        *(f"--{flag}={free}" for flag, free in zip((
            "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
            "runtime-env-agent-port", "ray-client-server-port",
        ), agent_ports, strict=True)),
    ]
    log_file = open(log_path or os.devnull, "ab")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen(
        cmd,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=Path.cwd(),
    )
    head = LocalHead(
        dashboard_url=f"http://127.0.0.1:{dashboard_port}",
        gcs_address=f"127.0.0.1:{port}",
        temp_dir=temp_dir,
        pid=proc.pid,
        devices=devices,
    )
    deadline = time.monotonic() + timeout_s
    cluster = RayCluster(head.dashboard_url, timeout_s=2.0)
    waiting = "its dashboard did not answer"  # what the head lacked at the last look: the timeout's cause
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            stop_head(head)  # whatever it started before it exited
            raise HeadExited(f"ray start exited with {proc.returncode}{_log_tail(log_path)}")
        if cluster.ping():
            try:
                answered = bool(cluster.nodes())
            except Exception:
                answered = False
            agent_port = _agent_listen_port(temp_dir) if answered else None
            held = _held_by(proc.pid, agent_ports) if answered else {}
            unheld = [p for p in agent_ports if not held.get(p)]
            waiting = ("it listed no node" if not answered
                       else "its dashboard agent did not report its port" if agent_port is None
                       else f"no process of it listened on its agent ports {unheld}")
            taken = [p for p, mine in held.items() if mine is False]
            if agent_port == -1 or taken:
                # a port found free was taken before Ray bound it. Ray keeps some such heads up:
                # a dashboard agent without its HTTP server answers nothing and the head refuses
                # every job ("No available agent to submit job"); others exit a moment later
                stop_head(head)
                raise HeadExited(f"the Ray head's agent ports {taken or agent_ports[:1]} were taken after "
                                 f"they were found free{_log_tail(log_path)}")
            if agent_port is not None and not unheld:
                break
        else:
            waiting = "its dashboard did not answer"
        time.sleep(0.5)
    else:
        stop_head(head)
        raise TimeoutError(f"the local Ray head did not start within {timeout_s:.0f} s: {waiting}"
                           f"{_log_tail(log_path)}")
    path = local_head_file(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(head)))
    return head


def ensure_head(settings: Settings, **kwargs: object) -> LocalHead | None:
    """The running local head, started when none runs; None when YATT_RAY_ADDRESS is set."""
    if settings.ray_address:
        return None
    return read_head(settings) or start_head(settings, **kwargs)  # type: ignore[arg-type]


def stop_head(head: LocalHead, settings: Settings | None = None) -> None:
    """Stop this head and every process that belongs to it; nothing else."""
    try:
        os.killpg(head.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and psutil.pid_exists(head.pid):
        try:
            if psutil.Process(head.pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.2)
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info.get("cmdline") or [])
        if head.temp_dir in cmdline:
            try:
                proc.kill()
            except psutil.Error:
                pass
    if settings is not None:
        local_head_file(settings).unlink(missing_ok=True)
