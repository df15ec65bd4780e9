"""How busy the machine's cores were while each test ran, for the CI-time target.

`make test` must stay under 40 minutes on a 2-core host, and the suite is mostly tests that
start real servers, Ray heads, vLLM engines and rank processes. Whether running tests side by
side would shorten it depends on how much of each test's wall time leaves the cores idle
(waiting on a poll, a port, a process start), which `--durations` does not say. This plugin
reads the machine-wide `/proc/stat` counters around each test (setup, call and teardown) and
ends the run with the share of the cores the suite kept busy and the files that left the most
core-seconds idle; every test's figures go to `test-artifacts/cpu-use.json`.

Machine-wide, so it counts whatever else runs on the host too (CI runs nothing else).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
STAT = Path("/proc/stat")


@dataclass(frozen=True)
class CpuTimes:
    """The aggregate line of /proc/stat, in seconds: time the cores spent busy, idle (iowait
    included: nothing ran), and taken by the hypervisor (steal)."""

    busy: float
    idle: float
    steal: float

    @classmethod
    def parse(cls, stat_text: str, hz: float) -> CpuTimes:
        fields = stat_text.splitlines()[0].split()
        if fields[0] != "cpu":
            raise ValueError(f"not the aggregate line of /proc/stat: {fields[0]!r}")
        # user nice system idle iowait irq softirq steal [guest guest_nice: already in user, nice]
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
        return cls(busy=(user + nice + system + irq + softirq) / hz, idle=(idle + iowait) / hz,
                   steal=steal / hz)

    def __sub__(self, other: CpuTimes) -> CpuTimes:
        return CpuTimes(self.busy - other.busy, self.idle - other.idle, self.steal - other.steal)


def read() -> CpuTimes | None:
    try:
        return CpuTimes.parse(STAT.read_text(), os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError):
        return None  # not Linux: nothing to report


class CpuUse:
    def __init__(self) -> None:
        self.tests: dict[str, dict[str, float]] = {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        before, t0 = read(), time.monotonic()
        yield
        after, wall = read(), time.monotonic() - t0
        if before is None or after is None:
            return
        d = after - before
        self.tests[item.nodeid] = {"wall_s": round(wall, 2), "busy_core_s": round(d.busy, 2),
                                   "idle_core_s": round(d.idle, 2), "steal_core_s": round(d.steal, 2)}

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.tests:
            return
        cores = os.cpu_count() or 1
        files: dict[str, dict[str, float]] = {}
        for nodeid, t in self.tests.items():
            f = files.setdefault(nodeid.split("::")[0], {"wall_s": 0.0, "busy_core_s": 0.0,
                                                         "idle_core_s": 0.0, "steal_core_s": 0.0})
            for k, v in t.items():
                f[k] += v
        total = {k: sum(f[k] for f in files.values()) for k in ("wall_s", "busy_core_s", "idle_core_s",
                                                                "steal_core_s")}
        write = terminalreporter.write_line
        terminalreporter.section("cpu use (tests/cpu_use.py)")
        cap = total["busy_core_s"] + total["idle_core_s"] + total["steal_core_s"]
        write(f"{len(self.tests)} tests, {total['wall_s']:.0f} s: the {cores} cores were busy "
              f"{total['busy_core_s'] / max(cap, 1e-9):.0%} of the time ({total['busy_core_s']:.0f} "
              f"core-s), idle {total['idle_core_s']:.0f} core-s, steal "
              f"{total['steal_core_s'] / max(cap, 1e-9):.1%}")
        write("files by idle core-seconds (wall s, busy share of the cores, idle core-s):")
        for name, f in sorted(files.items(), key=lambda kv: -kv[1]["idle_core_s"])[:15]:
            share = f["busy_core_s"] / max(f["busy_core_s"] + f["idle_core_s"] + f["steal_core_s"], 1e-9)
            write(f"  {f['wall_s']:7.1f} s  {share:4.0%}  {f['idle_core_s']:7.1f}  {name}")
        ARTIFACTS.mkdir(exist_ok=True)
        out = ARTIFACTS / "cpu-use.json"
        out.write_text(json.dumps({"cores": cores, "total": total, "files": files, "tests": self.tests},
                                  indent=1))
        write(f"every test's figures: {out}")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(CpuUse(), "yatt-cpu-use")
