"""The driver's byte accounting (driver/bytes_in, driver/bytes_out per step) counts exactly the
pickled payloads that cross into and out of the driver process, in both controller modes, on a
real Ray with real actors standing in for the ranks."""

from __future__ import annotations

import pickle

import pytest

from tests.e2e import trainer_helpers as helpers
from tests.e2e.trainer_helpers import read_metrics
from trainer.config import parse_config
from trainer.driver import Driver
from trainer.single_controller import SingleControllerDriver, pack_payload, unpack_payload
from trainer.telemetry import JsonlReporter

ray_head = helpers.ray_head


def rank_actor(ray, records):
    """A rank with records to drain (parallel) and an echo for counted calls (single), started:
    the driver waits 60 s for a drain, meant for a live rank, and a worker process starting on a
    loaded 2-core machine took 59 s to import what the class needs (a CI run, 2026-12-07)."""

    class Rank:  # defined in a function: Ray ships it by value to the worker
        def __init__(self, records):
            self.records = records

        def drain(self):
            out, self.records = self.records, []
            return out

        def generate(self, payload: bytes) -> bytes:
            prompts, n = unpack_payload(payload)
            return pack_payload({"samples": [p * n for p in prompts]})

    actor = ray.remote(Rank).remote(records)
    ray.get(actor.__ray_ready__.remote(), timeout=600)
    return actor


def metrics_record(rank: int, step: int) -> dict:
    return {"rank": rank, "type": "metrics", "step": step,
            "metrics": {"reward/mean": 0.5, "time/step": 1.0 + rank},
            "spans": [{"device": rank, "phase": "train", "start": 0.0, "end": 1.0, "step": step}]}


@pytest.mark.slow
def test_parallel_driver_counts_the_records_it_drains(ray_head, tmp_path):
    cfg = parse_config({"train": {"batch_size": 2}})
    driver = Driver(cfg, tmp_path, reporter=JsonlReporter(tmp_path))
    records = [[{"rank": r, "type": "event", "kind": "eval", "message": "x", "data": {}},
                metrics_record(r, 1)] for r in range(2)]
    driver.controllers = [rank_actor(ray_head, recs) for recs in records]
    driver._drain(failed_ok=False)
    [m] = [m for m in read_metrics(tmp_path) if m["step"] == 1]
    # the same records as they arrive from an actor (pickle's size depends on shared objects)
    arrived = [ray_head.get(rank_actor(ray_head, recs).drain.remote()) for recs in records]
    assert arrived == records
    assert m["driver/bytes_in"] == sum(len(pickle.dumps(r, protocol=5)) for recs in arrived for r in recs)
    assert m["driver/bytes_out"] == 0 and m["driver/rss_peak_mb"] >= m["driver/rss_mb"] > 0
    driver.controllers = [rank_actor(ray_head, [metrics_record(r, 2)]) for r in range(2)]
    driver._drain(failed_ok=False)
    [m2] = [m for m in read_metrics(tmp_path) if m["step"] == 2]
    # per step: only what was drained since step 1 completed
    again = [ray_head.get(rank_actor(ray_head, [metrics_record(r, 2)]).drain.remote()) for r in range(2)]
    assert m2["driver/bytes_in"] == sum(len(pickle.dumps(r, protocol=5)) for recs in again for r in recs)


@pytest.mark.slow
def test_single_driver_counts_every_payload_it_sends_and_receives(ray_head, tmp_path):
    cfg = parse_config({"controller": {"mode": "single"}, "train": {"batch_size": 2}})
    driver = SingleControllerDriver(cfg, tmp_path, reporter=JsonlReporter(tmp_path))
    driver.controllers = [rank_actor(ray_head, []) for _ in range(2)]
    sent = [(["1+1=", "2+2="], 3), (["3+3=" * 50], 2)]
    out = driver._call_all("generate", [driver._send(x) for x in sent])
    assert [o["samples"] for o in out] == [["1+1=" * 3, "2+2=" * 3], ["3+3=" * 100]]
    assert driver._bytes_out == sum(len(pickle.dumps(x, protocol=5)) for x in sent)
    assert driver._bytes_in == sum(len(pack_payload(o)) for o in out)
    driver._complete_step(1, {0: {"metrics": {"time/step": 1.0}}})
    [m] = [m for m in read_metrics(tmp_path) if m["step"] == 1]
    assert (m["driver/bytes_in"], m["driver/bytes_out"]) == (driver._bytes_in, driver._bytes_out)
    assert m["driver/bytes_in"] > len("3+3=") * 100  # the longer payload is in there
