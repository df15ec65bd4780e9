"""The CI-time plugin's reading of /proc/stat: the right columns, and a spinning core counted busy."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.cpu_use import CpuTimes, read

# a real aggregate line (2 cores): user nice system idle iowait irq softirq steal guest guest_nice
LINE = "cpu  284474 80365 64831 385697 2836 0 1841 6823 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"


def test_the_aggregate_line_splits_into_busy_idle_and_steal():
    t = CpuTimes.parse(LINE, hz=100)
    assert t.busy == pytest.approx((284474 + 80365 + 64831 + 0 + 1841) / 100)
    assert t.idle == pytest.approx((385697 + 2836) / 100)
    assert t.steal == pytest.approx(68.23)
    with pytest.raises(ValueError, match="aggregate"):
        CpuTimes.parse("cpu0 1 2 3 4 5 6 7 8\n", hz=100)


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="Linux only")
def test_a_core_spinning_for_half_a_second_counts_as_busy():
    before, t0 = read(), time.monotonic()
    while time.monotonic() - t0 < 0.5:
        pass
    after = read()
    assert before is not None and after is not None
    d = after - before
    # one core spun the whole time; all cores together saw the wall time once each
    assert d.busy >= 0.4
    assert d.busy + d.idle + d.steal == pytest.approx((os.cpu_count() or 1) * 0.5, rel=0.2, abs=0.1)
