"""`follow_log` (GET /runs/{id}/logs?follow=true): the tail first, then only what is appended,
until the attempt has ended. Reads are scripted snapshots of a growing log."""

from __future__ import annotations

import asyncio

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
