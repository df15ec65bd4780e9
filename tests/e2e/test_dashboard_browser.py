"""The dashboard in a real browser: headless Debian Chromium (Playwright) against `yatt dashboard`
and a live API — the run page of a running run, and the History page over 100,000 runs.
Saves screenshots to test-artifacts/."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.client import YattClient
from tests.conftest import start_api
from tests.dashboard_fixtures import SeededApi, seed_project, step_metrics
from tests.e2e.chromium import chromium_missing_reason, launch_browser, running_dashboard

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
SCREENSHOT = ARTIFACTS / "dashboard-run.png"

# serial: runs alone, after the tests that run side by side (`make test`); it asserts
# on the History page drawn within 2 s
pytestmark = [
    pytest.mark.browser,
    pytest.mark.postgres,
    pytest.mark.skipif(chromium_missing_reason() is not None,
                       reason=chromium_missing_reason() or ""),
    pytest.mark.serial,
]


@pytest.fixture(scope="module")
def api(postgres_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeededApi]:
    """The live API of tests/conftest.py on the session's PostgreSQL, one seeded project."""
    server = start_api(postgres_url, tmp_path_factory.mktemp("dash-browser"))
    try:
        yield seed_project(server, big=False)
    finally:
        server.stop()


def test_run_page_draws_live_charts_without_errors(api: SeededApi) -> None:
    from playwright.sync_api import sync_playwright

    run_id = api.runs["running"]
    with running_dashboard(api_url=api.url, token=api.token) as url, sync_playwright() as p:
        browser = launch_browser(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{url}/run?run={run_id}")
            page.get_by_role("heading", name=f"#{run_id} running").wait_for(timeout=60_000)
            # charts: one plotly div per panel, drawn (an SVG inside) — at least throughput,
            # device utilization and memory, reward, KL, losses and the phase timeline
            page.wait_for_function(
                "() => document.querySelectorAll('.js-plotly-plot .main-svg').length >= 8",
                timeout=60_000,
            )
            page.wait_for_function(  # the phase timeline's bars
                "() => document.querySelectorAll('.js-plotly-plot .bars path').length > 0",
                timeout=30_000,
            )
            page.wait_for_timeout(1500)  # let the first live refresh land
            problems = page.query_selector_all(
                '[data-testid="stException"], [data-testid="stAlertContentError"]'
            )
            assert not problems, [el.inner_text() for el in problems]
            titles = page.eval_on_selector_all(
                ".js-plotly-plot .gtitle", "els => els.map(e => e.textContent)"
            )
            for expected in ("Throughput (tokens/s)", "Device utilization", "Device memory",
                             "Reward", "KL", "Losses"):
                assert expected in titles
            assert page.get_by_role("button", name="Cancel run").is_visible()
            assert page.get_by_text("refreshing every 2 s").is_visible()

            # live: new steps reported by the "trainer" appear without a reload
            step_value = page.get_by_test_id("stMetricValue").first
            assert step_value.inner_text() == "11"
            with YattClient(api.url, api.run_tokens[run_id]) as c:  # the trainer's token
                c.post_metrics(run_id, [p_ for s in (12, 13, 14)
                                        for p_ in step_metrics(s, time.time())])
            page.wait_for_function(
                "() => document.querySelector('[data-testid=\"stMetricValue\"]')"
                ".textContent.trim() === '14'",
                timeout=30_000,
            )

            # Streamlit scrolls inside its main block: grow the viewport to the content so
            # the full-page screenshot holds the whole page.
            height = page.evaluate(
                "() => Math.max(...[...document.querySelectorAll("
                "'[data-testid=\"stMain\"], body')].map(e => e.scrollHeight))"
            )
            page.set_viewport_size({"width": 1400, "height": min(int(height) + 40, 8000)})
            page.wait_for_timeout(1000)
            # between live refreshes: Streamlit greys out elements while a rerun is drawing
            page.wait_for_function("() => !document.querySelector('[data-stale=\"true\"]')",
                                   timeout=10_000)
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)

            # the run ends: the page notices by itself and stops refreshing
            with YattClient(api.url, api.token) as c:
                c.report_state(run_id, "succeeded", summary={"reward/mean": 0.6})
            page.get_by_text("succeeded", exact=True).first.wait_for(timeout=30_000)
            page.get_by_text("refreshing every 2 s").wait_for(state="detached", timeout=10_000)
            assert not page.get_by_role("button", name="Cancel run").is_visible()
        finally:
            browser.close()
    assert SCREENSHOT.stat().st_size > 50_000


@pytest.mark.slow
def test_history_page_with_100000_runs_renders_in_under_2_s(tmp_path: Path) -> None:
    """The embedded default (SQLite behind `yatt api`) holding 100,000 runs over 1,000
    experiments (bench/history_seed.py, bulk: tens of seconds), the History page drawn in a
    real browser: its table, filters and pager, from navigation to the first 25 rows."""
    from playwright.sync_api import sync_playwright

    from bench.history_seed import seed_history

    server = start_api(f"sqlite:///{tmp_path / 'history.db'}", tmp_path)
    try:
        seeded = seed_history(server.database, project="history-100k", runs=100_000,
                              experiments=1_000, series_runs=0)
        newest = seeded.run_ids[-1]
        with running_dashboard(api_url=server.url, token=seeded.token) as url, \
                sync_playwright() as p:
            browser = launch_browser(p)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                timings = []
                for _ in range(3):  # the first visit also starts the Streamlit session
                    start = time.perf_counter()
                    page.goto(url)
                    page.get_by_text("Page 1 · 25 runs shown").wait_for(timeout=60_000)
                    page.locator('[data-testid="stDataFrame"]').first.wait_for(timeout=30_000)
                    timings.append(time.perf_counter() - start)
                problems = page.query_selector_all(
                    '[data-testid="stException"], [data-testid="stAlertContentError"]'
                )
                assert not problems, [el.inner_text() for el in problems]
                assert page.get_by_role("button", name="Next page →").is_visible()
                ARTIFACTS.mkdir(exist_ok=True)
                page.screenshot(path=str(ARTIFACTS / "dashboard-history-100k.png"))
            finally:
                browser.close()
        print(f"History page with 100,000 runs: {', '.join(f'{t:.2f}' for t in timings)} s "
              f"(load average {os.getloadavg()[0]:.1f}); newest run {newest}")
        warm = min(timings[1:])
        # 2 s is the target on a machine that is not oversubscribed; on a shared machine far
        # over its core count the bound only catches a page that reads the whole history.
        overloaded = os.getloadavg()[0] > 2 * (os.cpu_count() or 1)
        assert warm < (10.0 if overloaded else 2.0), timings
    finally:
        server.stop()
