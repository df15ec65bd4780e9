"""Telemetry: spans and busy fractions, JSONL files, and the HTTP reporter's spool-and-replay
against a real HTTP server on localhost."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trainer.telemetry import (
    DeviceMonitor,
    HttpReporter,
    JsonlReporter,
    PhaseRecorder,
    make_reporter,
)
from trainer.telemetry.spans import PhaseSpan


class FakeApi:
    """A real HTTP server that records the trainer's POSTs (the backend is not needed here)."""

    def __init__(self, port: int, refuse_state: bool = False):
        self.received: list[tuple[str, dict, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                route = self.path.rsplit("/", 1)[1]
                code = 409 if (refuse_state and route == "state") else 200
                outer.received.append((self.path, body, self.headers.get("Authorization", "")))
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()

    def points(self) -> list[dict]:
        return [p for path, body, _ in self.received if path.endswith("/metrics") for p in body["points"]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_busy_fraction_merges_overlapping_spans():
    spans = [PhaseSpan(0, "rollout", 0.0, 4.0, 1), PhaseSpan(0, "reward", 3.0, 5.0, 1),
             PhaseSpan(1, "train", 0.0, 10.0, 1), PhaseSpan(0, "train", 8.0, 9.0, 1)]
    assert PhaseRecorder.busy_fraction(spans, 0, 0.0, 10.0) == pytest.approx(0.6)
    assert PhaseRecorder.busy_fraction(spans, 1, 2.0, 4.0) == 1.0
    assert PhaseRecorder.durations(spans, device=0) == {"rollout": 4.0, "reward": 2.0, "train": 1.0}


def test_recorder_tags_spans_with_device_and_step():
    rec = PhaseRecorder(device=3)
    rec.step = 7
    with rec.span("train"):
        time.sleep(0.01)
    rec.extend([{"device": 5, "phase": "rollout", "start": 1.0, "end": 2.0}])
    spans = rec.take()
    assert [(s.device, s.phase, s.step) for s in spans] == [(3, "train", 7), (5, "rollout", 7)]
    assert spans[0].end - spans[0].start >= 0.01
    assert rec.take() == []


def test_cpu_device_monitor_measures_this_process():
    mon = DeviceMonitor(0, device_type="cpu", cores=1)
    t = time.process_time()
    while time.process_time() - t < 0.2:
        pass
    m = mon.sample()
    assert m["device/0/util_pct"] > 20
    assert m["device/0/memory_mb"] > 10


def test_jsonl_reporter_writes_metrics_events_and_summary(tmp_path):
    r = JsonlReporter(tmp_path)
    r.log_metrics(1, {"reward/mean": 0.5, "loss/policy": float("nan")})
    r.log_event("placement", "colocate", {"devices": 2})
    r.write_summary({"eval/accuracy_end": 0.9})
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["step"] == 1 and lines[0]["reward/mean"] == 0.5 and "loss/policy" not in lines[0]
    ev = json.loads((tmp_path / "events.jsonl").read_text())
    assert ev["kind"] == "placement" and ev["data"] == {"devices": 2}
    assert json.loads((tmp_path / "summary.json").read_text())["eval/accuracy_end"] == 0.9


def test_http_reporter_spools_while_the_api_is_down_and_replays_in_order(tmp_path):
    port = free_port()
    rep = HttpReporter(f"http://127.0.0.1:{port}", "tok", 42, spool_dir=tmp_path / "spool",
                       flush_interval_s=0.05, max_batch=3, retry_backoff_s=0.01)
    rep.set_state("running")
    for step in range(5):
        rep.log_metrics(step, {"a": float(step), "b": -float(step)})
    rep.log_event("restart", "controller 1 restarted", {"rank": 1})
    assert wait_for(lambda: rep.spooled >= 4)  # state, 4 metric batches of ≤3 points, event
    api = FakeApi(port)
    try:
        assert wait_for(lambda: rep.spooled == 0)
        rep.set_state("succeeded", summary={"eval/accuracy_end": 0.8})
        rep.close(timeout_s=5)
        paths = [p.rsplit("/", 1)[1] for p, _, _ in api.received]
        assert paths[0] == "state" and paths[-1] == "state"
        assert "events" in paths
        assert all(p.startswith("/api/v1/runs/42/") for p, _, _ in api.received)
        assert all(auth == "Bearer tok" for _, _, auth in api.received)
        pts = api.points()
        assert [(p["step"], p["key"]) for p in pts] == [(s, k) for s in range(5) for k in "ab"]
        assert all(len(body["points"]) <= 3 for p, body, _ in api.received if p.endswith("metrics"))
        assert api.received[-1][1] == {"state": "succeeded", "summary": {"eval/accuracy_end": 0.8}}
    finally:
        api.stop()


def test_a_restarted_reporter_replays_what_it_left_spooled_with_the_same_batch_id(tmp_path):
    port = free_port()
    first = HttpReporter(f"http://127.0.0.1:{port}", "tok", 7, spool_dir=tmp_path / "spool",
                         flush_interval_s=0.05, retry_backoff_s=0.01)
    first.log_metrics(3, {"reward/mean": 0.25})
    first.close(timeout_s=0.3)  # the API never came up: the point stays on disk
    (spooled,) = list((tmp_path / "spool").glob("*.json"))
    batch_id = json.loads(spooled.read_text())["batch_id"]
    api = FakeApi(port)
    try:
        second = HttpReporter(f"http://127.0.0.1:{port}", "tok", 7, spool_dir=tmp_path / "spool",
                              flush_interval_s=0.05, retry_backoff_s=0.01)
        second.log_metrics(4, {"reward/mean": 0.5})
        second.close(timeout_s=5)
        assert [(p["step"], p["value"]) for p in api.points()] == [(3, 0.25), (4, 0.5)]
        ids = [body["batch_id"] for path, body, _ in api.received if path.endswith("/metrics")]
        assert ids[0] == batch_id and len(set(ids)) == 2  # the server can tell a resend from news
        second_events = HttpReporter(f"http://127.0.0.1:{port}", "tok", 7, spool_dir=tmp_path / "spool",
                                     flush_interval_s=0.05, retry_backoff_s=0.01)
        second_events.log_event("warning", "slow step")
        second_events.close(timeout_s=5)
        (events_body,) = [body for path, body, _ in api.received if path.endswith("/events")]
        assert events_body["batch_id"] not in ids and events_body["events"][0]["message"] == "slow step"
        assert not list((tmp_path / "spool").glob("*.json"))
    finally:
        api.stop()


def test_a_final_refusal_is_dropped_not_retried_forever(tmp_path):
    port = free_port()
    api = FakeApi(port, refuse_state=True)
    try:
        rep = HttpReporter(f"http://127.0.0.1:{port}", "tok", 1, spool_dir=tmp_path / "spool",
                           flush_interval_s=0.05, retry_backoff_s=0.01)
        rep.set_state("running")
        rep.log_metrics(1, {"x": 1.0})
        rep.close(timeout_s=5)
        assert rep.dropped_batches == 1 and rep.sent_batches == 1 and rep.spooled == 0
    finally:
        api.stop()


def test_make_reporter_adds_http_only_with_url_token_and_run(tmp_path):
    assert len(make_reporter(tmp_path, env={}).reporters) == 1
    r = make_reporter(tmp_path, env={"YATT_API_URL": "http://127.0.0.1:9", "YATT_RUN_TOKEN": "t",
                                     "YATT_RUN_ID": "5"})
    assert [type(x).__name__ for x in r.reporters] == ["JsonlReporter", "HttpReporter"]
    r.close(timeout_s=0.1)


def test_make_reporter_reads_the_token_file_and_spools_per_attempt(tmp_path):
    token_file = tmp_path / ".run-token-attempt-2"
    token_file.write_text("yatt_secret\n")
    env = {"YATT_API_URL": "http://127.0.0.1:9", "YATT_RUN_TOKEN_FILE": str(token_file),
           "YATT_RUN_ID": "5", "YATT_ATTEMPT": "2"}
    r = make_reporter(tmp_path, env=env)
    http = r.reporters[1]
    assert http._client.headers["Authorization"] == "Bearer yatt_secret"
    assert http.spool_dir == tmp_path / "spool" / "attempt-2"
    http.log_metrics(1, {"x": 1.0})
    r.close(timeout_s=0.1)
    assert list((tmp_path / "spool" / "attempt-2").glob("*.json"))
    # the next attempt starts from an empty spool: attempt 2's leftovers are not its to send
    nxt = make_reporter(tmp_path, env={**env, "YATT_ATTEMPT": "3", "YATT_RUN_TOKEN": "other"})
    assert nxt.reporters[1].spooled == 0
    nxt.close(timeout_s=0.1)


def test_concurrent_drains_send_each_spooled_batch_once(tmp_path):
    port = free_port()
    rep = HttpReporter(f"http://127.0.0.1:{port}", "tok", 3, spool_dir=tmp_path / "spool",
                       flush_interval_s=0.05, max_batch=1, retry_backoff_s=0.01)
    for step in range(30):
        rep.log_metrics(step, {"a": float(step)})
    assert wait_for(lambda: rep.spooled >= 30)
    api = FakeApi(port)
    errors = []

    def drain():
        try:
            rep._drain_spool()
        except Exception as exc:  # what killed a trainer before: a file sent and removed by the other
            errors.append(exc)

    try:
        threads = [threading.Thread(target=drain) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rep.close(timeout_s=5)
        assert errors == []
        assert sorted(p["step"] for p in api.points()) == list(range(30))  # none twice
    finally:
        api.stop()
