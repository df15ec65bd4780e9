"""`follow_log` (GET /runs/{id}/logs?follow=true): the tail first, then only what is appended,
until the attempt has ended. Reads are scripted snapshots of a growing log; Ray's live tail
(tests/integration/test_log_tail_ray.py runs the real one) is a scripted chunk sequence."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from backend.dispatch.ray_cluster import RayUnavailable
from backend.dispatch.routes import LogSnapshot, follow_log, tail_lines


def collect(snapshots: list[LogSnapshot], tail: int | None) -> tuple[list[str], int]:
    reads = iter(snapshots[1:])
    count = 0

    async def read() -> LogSnapshot:
        nonlocal count
        count += 1
        return next(reads)

    async def run() -> list[str]:
        return [chunk async for chunk in follow_log(read, first=snapshots[0], tail=tail, poll_s=0.001)]

    return asyncio.run(run()), count


def test_tail_and_follow_together_send_the_tail_then_each_new_piece_once() -> None:
    log = "".join(f"line {i}\n" for i in range(10))
    chunks, reads = collect(
        [
            LogSnapshot(log, True, "running"),
            LogSnapshot(log, True, "running"),  # nothing new
            LogSnapshot(log + "line 10\n", True, "running"),
            LogSnapshot(log + "line 10\nline 11\n", False, "succeeded"),  # the job ended
        ],
        tail=2,
    )
    assert chunks == ["line 8\nline 9\n", "line 10\n", "line 11\n"]
    assert reads == 3


def test_follow_ends_at_once_for_a_finished_attempt() -> None:
    chunks, reads = collect([LogSnapshot("done\n", False, "failed")], tail=None)
    assert chunks == ["done\n"] and reads == 0


def test_follow_keeps_reading_while_the_run_is_active_even_without_ray_output() -> None:
    chunks, reads = collect(
        [LogSnapshot("", False, "queued"), LogSnapshot("", False, "starting"),
         LogSnapshot("hello\n", True, "running"), LogSnapshot("hello\n", False, "cancelled")],
        tail=5,
    )
    assert chunks == ["", "hello\n"] and reads == 3


def test_tail_lines() -> None:
    assert tail_lines("a\nb\nc", 2) == "b\nc"
    assert tail_lines("a\nb\n", None) == "a\nb\n"
    assert tail_lines("", 3) == ""


def follow_with_live_tail(
    snapshots: list[LogSnapshot], tails: list[list[str | Exception]], tail: int | None
) -> tuple[list[str], int, list[str]]:
    """Chunks sent, reads made, and the submission ids the live tail was opened for. Each tail
    connection sends its chunks, raising an exception where the script has one; one that runs
    out of chunks ends normally, as Ray's does once the job has ended."""
    reads, opened = iter(snapshots[1:]), []
    count = 0
    connections = iter(tails)

    async def read() -> LogSnapshot:
        nonlocal count
        count += 1
        return next(reads)

    async def live_tail(submission_id: str) -> AsyncIterator[str]:
        opened.append(submission_id)
        for chunk in next(connections):
            if isinstance(chunk, Exception):
                raise chunk
            yield chunk

    async def run() -> list[str]:
        return [c async for c in follow_log(read, first=snapshots[0], tail=tail, live_tail=live_tail,
                                            poll_s=0.001)]

    return asyncio.run(run()), count, opened


def test_a_running_job_is_followed_over_one_live_tail_not_by_rereading_its_log() -> None:
    log = "".join(f"line {i}\n" for i in range(10))
    chunks, reads, opened = follow_with_live_tail(
        [
            LogSnapshot(log, True, "running", "yatt-run-1-a1"),
            LogSnapshot(log + "line 10\nline 11\n", False, "succeeded"),  # after the job ended
        ],
        # Ray's tail sends the whole log from its start, in its own chunks, then what is appended
        [[log[:25], log[25:], "line 10\n", "line 11\n"]],
        tail=2,
    )
    assert chunks == ["line 8\nline 9\n", "line 10\n", "line 11\n"]
    assert reads == 0 and opened == ["yatt-run-1-a1"]  # the tail's end is the job's: no read at all


def test_a_live_tail_that_cuts_a_line_sends_only_the_new_part() -> None:
    log = "a\nb\n"
    chunks, _, _ = follow_with_live_tail(
        [LogSnapshot(log, True, "running", "s"), LogSnapshot(log + "cd\n", False, "failed")],
        [["a\nb\nc", "d\n"]],
        tail=None,
    )
    assert chunks == ["a\nb\n", "c", "d\n"]


def test_when_the_live_tail_fails_the_log_is_polled_instead() -> None:
    log = "one\n"
    chunks, reads, opened = follow_with_live_tail(
        [
            LogSnapshot(log, True, "running", "s"),
            LogSnapshot(log + "two\n", True, "running", "s"),
            LogSnapshot(log + "two\nthree\n", False, "succeeded"),
        ],
        [[RayUnavailable("no websocket")]],
        tail=None,
    )
    assert chunks == ["one\n", "two\n", "three\n"] and reads == 2 and opened == ["s"]


def test_a_live_tail_that_closes_at_once_is_not_reopened_on_every_poll() -> None:
    log = "one\n"
    chunks, reads, opened = follow_with_live_tail(
        [
            LogSnapshot(log, True, "running", "s"),
            LogSnapshot(log, True, "running", "s"),
            LogSnapshot(log + "two\n", True, "running", "s"),
            LogSnapshot(log + "two\n", False, "succeeded"),
        ],
        # the whole log so far, then closed while the job still runs (RayCluster.tail_logs raises)
        [["one\n", RayUnavailable("closed while RUNNING")]],
        tail=None,
    )
    assert chunks == ["one\n", "two\n"] and reads == 3 and opened == ["s"]


def test_a_live_tail_that_breaks_after_carrying_new_lines_is_opened_again_and_nothing_repeats() -> None:
    log = "one\n"
    chunks, reads, opened = follow_with_live_tail(
        [LogSnapshot(log, True, "running", "s"), LogSnapshot(log + "two\nthree\n", True, "running", "s")],
        [["one\ntw", RayUnavailable("connection reset")], ["one\ntwo\nthree\nfour\n"]],
        tail=None,
    )
    assert chunks == ["one\n", "tw", "o\nthree\n", "four\n"]
    assert "".join(chunks) == "one\ntwo\nthree\nfour\n" and reads == 1 and opened == ["s", "s"]


def test_polling_ends_when_ray_has_seen_the_job_end_though_the_attempt_is_not_marked_yet() -> None:
    chunks, reads = collect(
        [
            LogSnapshot("a\n", True, "running", "s"),
            # the dispatcher has not recorded the end yet, but Ray's log is whole
            LogSnapshot("a\nb\n", False, "running", "s", ended=True),
        ],
        tail=None,
    )
    assert chunks == ["a\n", "b\n"] and reads == 1
