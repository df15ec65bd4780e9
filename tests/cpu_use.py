"""How busy the machine's cores were while each test ran, for the CI-time target.

`make test` must stay under 40 minutes on a 2-core host, and the suite is mostly tests that
start real servers, Ray heads, vLLM engines and rank processes. Whether running tests side by
side would shorten it depends on how much of each test's wall time leaves the cores idle
(waiting on a poll, a port, a process start), which `--durations` does not say. This plugin
reads the machine-wide `/proc/stat` counters around each test (setup, call and teardown) and
ends the run with the share of the cores the suite kept busy and the files that left the most
core-seconds idle; every test's figures go to `test-artifacts/cpu-use.json` (`$YATT_TEST_ARTIFACTS`
elsewhere), or `cpu-use-side-by-side.json` for a run with pytest-xdist workers.

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

ARTIFACTS = Path(os.environ.get("YATT_TEST_ARTIFACTS")
                 or Path(__file__).resolve().parents[1] / "test-artifacts")
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


FIGURES = ("wall_s", "busy_core_s", "idle_core_s", "steal_core_s")
_STARTED = pytest.StashKey[tuple[CpuTimes | None, float]]()


class CpuUse:
    """Per test: the counters' change from its setup to its teardown, carried on its teardown
    report (so that with pytest-xdist the workers' figures reach the controller); per run: the
    change over the whole session, read where the summary is printed."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.tests: dict[str, dict[str, float]] = {}
        self.session: tuple[CpuTimes | None, float] | None = None

    def pytest_sessionstart(self) -> None:
        self.session = (read(), time.monotonic())

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        item.stash[_STARTED] = (read(), time.monotonic())
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
        outcome = yield
        if call.when != "teardown" or _STARTED not in item.stash:
            return
        before, t0 = item.stash[_STARTED]
        after = read()
        if before is None or after is None:
            return
        d = after - before
        figures = dict(zip(FIGURES, (time.monotonic() - t0, d.busy, d.idle, d.steal), strict=True))
        outcome.get_result().user_properties.append(("cpu_use", {k: round(v, 2) for k, v in figures.items()}))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "teardown":
            for name, value in report.user_properties:
                if name == "cpu_use":
                    self.tests[report.nodeid] = value

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.tests or self.session is None:
            return
        cores = os.cpu_count() or 1
        files: dict[str, dict[str, float]] = {}
        for nodeid, t in self.tests.items():
            f = files.setdefault(nodeid.split("::")[0], dict.fromkeys(FIGURES, 0.0))
            for k in FIGURES:
                f[k] += t[k]
        write = terminalreporter.write_line
        terminalreporter.section("cpu use (tests/cpu_use.py)")
        before, t0 = self.session
        now = read()
        if before is not None and now is not None:
            d, wall = now - before, time.monotonic() - t0
            cap = max(d.busy + d.idle + d.steal, 1e-9)
            write(f"{len(self.tests)} tests in {wall:.0f} s: the {cores} cores were busy {d.busy / cap:.0%} "
                  f"of the time ({d.busy:.0f} core-s), idle {d.idle:.0f} core-s, steal {d.steal / cap:.1%}")
        side_by_side = (getattr(self.config.option, "numprocesses", None) or 0) > 0
        write("files by idle core-seconds (wall s, busy share of the cores, idle core-s)"
              + (": tests ran side by side, so a file's figures include what ran beside it" if side_by_side
                 else "") + ":")
        for name, f in sorted(files.items(), key=lambda kv: -kv[1]["idle_core_s"])[:15]:
            share = f["busy_core_s"] / max(f["busy_core_s"] + f["idle_core_s"] + f["steal_core_s"], 1e-9)
            write(f"  {f['wall_s']:7.1f} s  {share:4.0%}  {f['idle_core_s']:7.1f}  {name}")
        ARTIFACTS.mkdir(exist_ok=True)
        out = ARTIFACTS / ("cpu-use-side-by-side.json" if side_by_side else "cpu-use.json")
        out.write_text(json.dumps({"cores": cores, "side_by_side": side_by_side, "files": files,
                                   "tests": self.tests}, indent=1))
        write(f"every test's figures: {out}")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(CpuUse(config), "yatt-cpu-use")
