"""The dispatcher's broker publisher: a request never waits for the broker, and a kick that
still waits is not queued twice."""

from __future__ import annotations

import threading
import time

from backend.dispatch import BackgroundPublisher


def test_publish_returns_at_once_while_the_broker_hangs_and_repeats_are_coalesced() -> None:
    publisher = BackgroundPublisher()
    release = threading.Event()
    sent: list[str] = []

    def slow_send() -> None:
        release.wait(10)  # a dead broker: redis-py retries its connect for seconds
        sent.append("first")

    t0 = time.monotonic()
    publisher.publish("first", slow_send)
    for _ in range(5):  # the same kick five more times while the first one hangs
        publisher.publish("schedule", lambda: sent.append("schedule"))
    assert time.monotonic() - t0 < 0.5
    release.set()
    deadline = time.monotonic() + 10
    while len(sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert sent == ["first", "schedule"]


def test_a_failed_publish_does_not_stop_the_publisher() -> None:
    publisher = BackgroundPublisher()
    sent: list[int] = []

    def broken() -> None:
        raise ConnectionError("broker down")

    publisher.publish("broken", broken)
    publisher.publish("ok", lambda: sent.append(1))
    deadline = time.monotonic() + 10
    while not sent and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sent == [1]
