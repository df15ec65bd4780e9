"""Throwaway servers for the fault drills, each a real process the drill may stop and start:
a PostgreSQL cluster of its own (initdb as the `postgres` user, a free port, its unix socket in
its own directory), a Redis server on a free port, and an extra Ray worker node joined to a
drill's head. Nothing here touches the shared PostgreSQL on 5432, the shared Redis on 6379 or
any other Ray on the machine: every stop goes to a PID this module started.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import psycopg
import redis

from tests.stack import free_port, free_ports

PG_BIN = Path("/usr/lib/postgresql/15/bin")


def _as_postgres(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    # initdb and postgres refuse to run as root
    return subprocess.run(["runuser", "-u", "postgres", "--", *cmd], capture_output=True, text=True,
                          check=True, **kwargs)  # type: ignore[call-overload]


class ThrowawayPostgres:
    """A PostgreSQL cluster in a temp dir, owned by the `postgres` user, listening on a free port."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="yatt-drill-pg-"))
        postgres = pwd.getpwnam("postgres")
        os.chown(self.dir, postgres.pw_uid, postgres.pw_gid)
        self.data = self.dir / "data"
        self.socket_dir = self.dir
        self.port = free_port()
        self.log = self.dir / "postgres.log"
        _as_postgres([str(PG_BIN / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                      "--no-sync"], timeout=120)
        self.database = "postgres"

    def url_for(self, database: str) -> str:
        """The SQLAlchemy URL of one database of this cluster."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    @property
    def dsn(self) -> str:
        """A libpq URL of the database the drill uses (see `create_database`)."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{self.database}"

    def create_database(self, name: str) -> None:
        """Create `name` and make it the one `dsn` names."""
        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{self.port}/postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        self.database = name

    def start(self, timeout_s: float = 60) -> None:
        """Start the server and wait until it accepts connections."""
        _as_postgres([
            str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", "-t", str(int(timeout_s)),
            "-o", f"-p {self.port} -k {self.socket_dir} -c listen_addresses=127.0.0.1 -c fsync=off "
                  "-c max_connections=200",
            "start",
        ], timeout=timeout_s + 10)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with psycopg.connect(f"postgresql://postgres@127.0.0.1:{self.port}/postgres", connect_timeout=2):
                    return
            except psycopg.OperationalError:
                time.sleep(0.2)
        raise TimeoutError(f"the drill's PostgreSQL did not start; see {self.log}")

    def stop(self, mode: str = "fast") -> None:
        """`fast`: roll back open transactions and close every connection (a restart);
        `immediate`: abort without a clean shutdown (a crash)."""
        _as_postgres([str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"], timeout=60)

    def running(self) -> bool:
        out = subprocess.run(["runuser", "-u", "postgres", "--", str(PG_BIN / "pg_ctl"), "-D", str(self.data),
                              "status"], capture_output=True, text=True)
        return out.returncode == 0

    def destroy(self) -> None:
        if self.running():
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)


class ThrowawayRedis:
    """A redis-server on a free port with append-only persistence (as a production broker has),
    so a restart keeps the queued messages; `stop()` kills it outright."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="yatt-drill-redis-"))
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 30) -> None:
        log = open(self.dir / "redis.log", "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--appendfsync", "always", "--save", ""],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.1)
        raise TimeoutError("the drill's Redis did not start")

    def stop(self) -> None:
        """SIGKILL: the broker dies without a goodbye, as a crashed or rescheduled pod does."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=30)
            self.proc = None

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class RayWorkerNode:
    """A second Ray node on this machine joined to a drill's head: `ray start --address --block`
    in its own process group and temp dir, offering `devices` of the `yatt_device` resource."""

    def __init__(self, gcs_address: str, *, devices: int, log_path: Path):
        self.gcs_address = gcs_address
        self.devices = devices
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, tries: int = 5, timeout_s: float = 120) -> None:
        """Start the node and wait until it has joined; Ray gives a raylet 30 s to register,
        which a loaded machine can miss, so a node that gave up is started again."""
        ray = str(Path(sys.executable).with_name("ray"))
        env = dict(os.environ)
        # `ray start --head` turns token auth on (DESIGN.md §4), but a joining node only presents
        # the token (~/.ray/auth_token) when told to
        if env.get("RAY_AUTH_MODE") != "disabled":
            env["RAY_AUTH_MODE"] = "token"
        for attempt in range(1, tries + 1):
            offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
            self.proc = subprocess.Popen(
                [ray, "start", f"--address={self.gcs_address}", "--block", "--node-ip-address=127.0.0.1",
                 f"--num-cpus={os.cpu_count() or 1}", f"--resources={json.dumps({'yatt_device': self.devices})}",
                 "--disable-usage-stats",
                 *(f"--{flag}={free}" for flag, free in zip((
                     "node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
                     "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port",
                 ), free_ports(6), strict=True))],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
            )
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and self.proc.poll() is None:
                with open(self.log_path, "rb") as f:
                    f.seek(offset)
                    if b"Ray runtime started" in f.read():
                        return
                time.sleep(0.5)
            if self.proc.poll() is None:
                self.kill()
            if attempt == tries:
                raise RuntimeError(f"the Ray worker node did not join; see {self.log_path}")

    def processes(self) -> list[psutil.Process]:
        """This node's processes: `ray start` and everything it started (raylet, its workers)."""
        if self.proc is None:
            return []
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill(self) -> list[int]:
        """SIGKILL every process of this node at once (a machine that lost power); returns the PIDs."""
        procs = self.processes()
        for proc in procs:
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=30)
        if self.proc is not None:
            self.proc.wait(timeout=30)
            self.proc = None
        return [p.pid for p in procs]
