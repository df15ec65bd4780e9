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


@pytest.mark.parametrize("workers", [0, 2])
def test_every_test_reaches_the_summary_with_and_without_workers(tmp_path, workers):
    """A pytest run with the plugin, alone and on two xdist workers (where the figures travel on
    the reports): every test is in the JSON, the spinning one counted busy, and the summary
    printed."""
    import json
    import subprocess
    import sys

    (tmp_path / "test_two.py").write_text(
        "import time\n"
        "def test_spins():\n    t = time.monotonic()\n    while time.monotonic() - t < 0.5: pass\n"
        "def test_sleeps():\n    time.sleep(0.5)\n")
    out = tmp_path / "artifacts"
    args = [sys.executable, "-m", "pytest", "-q", "-p", "tests.cpu_use", "-p", "no:cacheprovider",
            str(tmp_path / "test_two.py")] + (["-n", str(workers)] if workers else ["-p", "no:xdist"])
    done = subprocess.run(args, capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2],
                          env={**os.environ, "YATT_TEST_ARTIFACTS": str(out)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cpu use (tests/cpu_use.py)" in done.stdout and "2 tests in" in done.stdout, done.stdout
    report = json.loads((out / ("cpu-use-side-by-side.json" if workers else "cpu-use.json")).read_text())
    assert report["side_by_side"] is bool(workers)
    tests = {k.split("::")[-1]: v for k, v in report["tests"].items()}
    assert set(tests) == {"test_spins", "test_sleeps"}
    assert tests["test_spins"]["busy_core_s"] >= 0.4 and tests["test_spins"]["wall_s"] >= 0.5
    assert tests["test_sleeps"]["wall_s"] >= 0.5
