"""The embedded stack's Ray head (`backend.dispatch.local_ray.start_head`) against real `ray start`:
Ray's agents get ports found free a moment before Ray binds them, and another process can take
one in between. A taken agent gRPC port makes `ray start` exit (seen: after about 35 s); a taken
Ray Client server port makes it exit a moment after the head answers; a taken dashboard-agent
listen port leaves a head that answers but refuses every job ("No available agent to submit job"),
which the agent's port file tells (-1). Each time the head is started again on fresh agent ports
and runs jobs. A taken head port is the caller's to fix: the error names it
before anything starts. A head that never becomes ready times out with what it lacked."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import backend.dispatch.local_ray as local_ray
from backend.dispatch.ray_cluster import RayCluster
from backend.settings import Settings

pytestmark = pytest.mark.slow


@pytest.fixture
def listener() -> Iterator[int]:
    """A port some other process holds (a listening socket of this one)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    try:
        yield int(sock.getsockname()[1])
    finally:
        sock.close()


@pytest.mark.parametrize("taken", [0, 1, 4], ids=["agent-listen-port", "agent-grpc-port", "ray-client-server-port"])
def test_a_head_whose_agent_port_is_taken_starts_again_on_fresh_ports_and_runs_jobs(
        tmp_path: Path, listener: int, monkeypatch: pytest.MonkeyPatch, taken: int) -> None:
    asked: list[list[int]] = []
    real = local_ray.free_ports

    def first_one_taken(count: int, exclude: object = ()) -> list[int]:
        ports = real(count, exclude)  # type: ignore[arg-type]
        if not asked and count == 5:
            ports[taken] = listener  # one of the dashboard agent's ports: taken before Ray binds it
        asked.append(ports)
        return ports

    monkeypatch.setattr(local_ray, "free_ports", first_one_taken)
    settings = Settings(data_dir=tmp_path, database_url="sqlite://")
    port, dashboard_port = real(2)
    head = local_ray.start_head(settings, port=port, dashboard_port=dashboard_port, devices=1,
                                log_path=tmp_path / "ray-head.log", timeout_s=300)
    try:
        # the taken port failed the first start, and no later start was given it. The retries are
        # not counted: a clean-clone CI at 2eceac2 (tests two at a time) made three starts here,
        # the second on fresh ports failing too, for a reason the test did not record
        assert len(asked) >= 2 and asked[0][taken] == listener
        assert all(listener not in ports for ports in asked[1:])
        assert head.gcs_address == f"127.0.0.1:{port}"  # the caller's ports are kept
        with RayCluster(head.dashboard_url, timeout_s=30) as cluster:
            job = cluster.submit(submission_id=f"probe-{uuid.uuid4().hex[:8]}", entrypoint="echo started",
                                 env_vars={})
            deadline = time.monotonic() + 120
            info = cluster.job(job)
            while (info is None or not info.terminal) and time.monotonic() < deadline:
                time.sleep(0.5)
                info = cluster.job(job)
            assert info is not None and info.status == "SUCCEEDED", info
            assert "started" in cluster.logs(job)
    finally:
        local_ray.stop_head(head, settings)


def test_a_taken_head_port_fails_at_once_with_an_error_naming_it(tmp_path: Path, listener: int) -> None:
    # `ray start` on a taken GCS port retries for about 40 s before it exits; the head's ports are
    # the caller's (`yatt up --ray-port`), so a taken one is an error before anything starts
    settings = Settings(data_dir=tmp_path, database_url="sqlite://")
    (free,) = local_ray.free_ports(1, exclude={listener})
    for port, dashboard_port, role in ((listener, free, "GCS"), (free, listener, "dashboard")):
        started = time.monotonic()
        with pytest.raises(local_ray.PortInUse) as err:
            local_ray.start_head(settings, port=port, dashboard_port=dashboard_port, devices=1,
                                 log_path=tmp_path / "ray-head.log", timeout_s=120)
        assert time.monotonic() - started < 5
        assert err.value.port == listener and f"port {listener}" in str(err.value) and role in str(err.value)
        assert not (tmp_path / "ray-head.log").exists()  # no `ray start` ran
    assert not local_ray.port_in_use(free)


# serial: runs alone, after the tests that run side by side (`make test`): the head must reach
# its last wait (the agent ports) within the 45 s timeout, and a head started beside other tests
# can still be waiting for its dashboard then, a timeout that names the wrong cause. The other
# tests here wait for `ray start` to fail or for a head to run jobs, with minutes to spare.
@pytest.mark.serial
def test_a_head_that_never_holds_an_agent_port_times_out_naming_it_and_leaves_nothing_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # no run here had a port that no process listened on to the end; it stands in for one: the
    # head's own listener on its Ray Client port is hidden from the check, as if it never bound it
    hidden: list[int] = []
    real_held_by = local_ray._held_by

    def one_never_held(root_pid: int, ports: list[int]) -> dict[int, bool]:
        hidden[:] = ports[4:5]
        return {p: mine for p, mine in real_held_by(root_pid, ports).items() if p not in hidden}

    monkeypatch.setattr(local_ray, "_held_by", one_never_held)
    settings = Settings(data_dir=tmp_path, database_url="sqlite://")
    port, dashboard_port = local_ray.free_ports(2)
    with pytest.raises(TimeoutError) as err:
        local_ray.start_head(settings, port=port, dashboard_port=dashboard_port, devices=1,
                             log_path=tmp_path / "ray-head.log", timeout_s=45)
    assert f"no process of it listened on its agent ports {hidden}" in str(err.value), err.value
    deadline = time.monotonic() + 15  # the head was stopped: its processes were killed
    while (local_ray.port_in_use(port) or local_ray.port_in_use(dashboard_port)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not local_ray.port_in_use(port) and not local_ray.port_in_use(dashboard_port)
    assert not local_ray.local_head_file(settings).exists()
