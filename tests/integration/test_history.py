"""The run history at scale, on SQLite and PostgreSQL: metric sorts page through every run
exactly once (ties and missing values included), text search is ranked, metric filters,
the slim list, the compare endpoint and the experiments' stored run counts."""

from __future__ import annotations

import math
from typing import Any

import httpx
import pytest

from backend.client import YattAPIError
from tests.conftest import DATABASES, LiveAPI

pytestmark = pytest.mark.parametrize("live_api", DATABASES, indirect=True)

CONFIG = {"train": {"max_steps": 5, "batch_size": 4}, "seed": 3}


def new_run(api: LiveAPI, **kw: Any) -> dict[str, Any]:
    return api.client.create_run(experiment=kw.pop("experiment", "exp"), config=kw.pop("config", CONFIG), **kw)


def http(api: LiveAPI) -> httpx.Client:
    return httpx.Client(base_url=api.url + "/api/v1", headers={"Authorization": f"Bearer {api.token}"}, timeout=30)


def walk(api: LiveAPI, page_size: int, **filters: Any) -> list[list[dict[str, Any]]]:
    pages, cursor = [], None
    for _ in range(100):  # a cursor that does not advance would loop forever
        page = api.client.list_runs(limit=page_size, cursor=cursor, **filters)
        pages.append(page["items"])
        cursor = page["next_cursor"]
        if not cursor:
            return pages
    raise AssertionError(f"no last page after 100 pages: {[[r['id'] for r in p] for p in pages[:5]]}")


def test_metric_sort_pages_through_ties_and_missing_values_without_duplicate_or_gap(live_api: LiveAPI) -> None:
    # 0.5 three times, 0.1 twice, a NaN latest (missing), and runs that never report the key
    values: list[float | None] = [0.5, None, 0.1, 0.5, 0.9, None, 0.1, math.nan, 0.5, -2.0, None, 0.3, 0.5]
    ids = []
    for i, value in enumerate(values):
        run = new_run(live_api, name=f"tie-{i}")
        ids.append(run["id"])
        live_api.seed_metrics(run["id"], [{"key": "other", "step": 1, "value": float(i)}])
        if value is not None:
            # a NaN latest is stored as NULL (sent as null): the run has no value to sort by
            sent = None if math.isnan(value) else value
            live_api.seed_metrics(run["id"], [{"key": "reward/mean", "step": 1, "value": sent}])
    # an older point arriving late does not replace the latest; a newer one does
    live_api.seed_metrics(ids[4], [{"key": "reward/mean", "step": 0, "value": 100.0}])
    live_api.seed_metrics(ids[9], [{"key": "reward/mean", "step": 2, "value": 0.7}])
    values[9] = 0.7

    present = [(v, rid) for v, rid in zip(values, ids, strict=True) if v is not None and not math.isnan(v)]
    absent = [rid for v, rid in zip(values, ids, strict=True) if v is None or math.isnan(v)]
    expected_desc = [rid for _, rid in sorted(present, reverse=True)] + sorted(absent, reverse=True)
    expected_asc = [rid for _, rid in sorted(present)] + sorted(absent)

    for sort, expected in (("-reward/mean", expected_desc), ("reward/mean", expected_asc)):
        for page_size in (1, 2, 3, 5, 13, 50):
            pages = walk(live_api, page_size, sort=sort)
            seen = [r["id"] for page in pages for r in page]
            assert seen == expected, (sort, page_size)
            assert all(len(p) == page_size for p in pages[:-1])
    top = live_api.client.list_runs(sort="-reward/mean", limit=1)["items"][0]
    assert top["id"] == ids[4] and top["metrics"]["reward/mean"]["latest"] == 0.9
    # filters combine with the metric sort, and both phases (with and without a value) respect them
    odd = walk(live_api, 2, sort="-reward/mean", where=["other>=7"])
    assert [r["id"] for p in odd for r in p] == [i for i in expected_desc if ids.index(i) >= 7]


def test_metric_filters(live_api: LiveAPI) -> None:
    ids = []
    for i, value in enumerate([0.2, 0.6, 0.9, None]):
        run = new_run(live_api)
        ids.append(run["id"])
        if value is not None:
            live_api.seed_metrics(run["id"], [{"key": "reward/mean", "step": i, "value": value},
                                                     {"key": "kl", "step": i, "value": float(i)}])
    got = {r["id"] for r in live_api.client.iter_runs(where=["reward/mean>=0.6"])}
    assert got == {ids[1], ids[2]}
    got = {r["id"] for r in live_api.client.iter_runs(where=["reward/mean>0.1", "kl<2"])}
    assert got == {ids[0], ids[1]}
    assert live_api.client.list_runs(where=["reward/mean=0.9"])["items"][0]["id"] == ids[2]
    with http(live_api) as c:
        bad = c.get("/runs", params={"where": "reward/mean>>x"})
        assert bad.status_code == 422 and "reward/mean>>x" in bad.text
        assert c.get("/runs", params={"where": "reward/mean>nan"}).status_code == 422


def test_text_search_is_ranked_and_covers_name_experiment_tags_and_description(live_api: LiveAPI) -> None:
    in_name = new_run(live_api, name="lr-sweep-3e-5", experiment="grpo-arith")
    in_desc = new_run(live_api, name="baseline", description="part of the LR sweep for arithmetic")
    in_tag = new_run(live_api, name="plain", tags=["sweep", "nightly"])
    in_exp = new_run(live_api, name="other", experiment="sweeps-2026")
    new_run(live_api, name="unrelated", description="nothing to see")

    hits = live_api.client.list_runs(q="sweep")["items"]
    assert {r["id"] for r in hits} == {in_name["id"], in_desc["id"], in_tag["id"], in_exp["id"]}
    assert hits[0]["id"] == in_name["id"]  # a name match outranks a description match
    assert hits[-1]["id"] == in_desc["id"]
    scores = [r["score"] for r in hits]
    assert scores == sorted(scores, reverse=True) and scores[0] > scores[-1]
    # every word must match, each as a prefix, whatever the punctuation and case
    assert [r["id"] for r in live_api.client.iter_runs(q="Sweep LR")] == [in_name["id"], in_desc["id"]]
    assert [r["id"] for r in live_api.client.iter_runs(q="grpo arith 3e")] == [in_name["id"]]
    assert [r["id"] for r in live_api.client.iter_runs(q="nightl")] == [in_tag["id"]]
    # paging through ranked results: every hit once, in rank order
    assert [r["id"] for p in walk(live_api, 1, q="sweep") for r in p] == [r["id"] for r in hits]
    # an explicit sort keeps the search as a filter
    assert [r["id"] for r in live_api.client.iter_runs(q="sweep", sort="created_at")] == sorted(
        r["id"] for r in hits
    )
    # another project's runs are not found
    other = live_api.client.__class__(live_api.url, live_api.server.make_token("elsewhere"))
    assert other.list_runs(q="sweep")["items"] == []
    with http(live_api) as c:
        assert c.get("/runs", params={"q": "--"}).status_code == 422
        assert c.get("/runs", params={"sort": "relevance"}).status_code == 422


def test_list_is_slim_and_compare_returns_ten_runs_in_one_request(live_api: LiveAPI) -> None:
    runs = [new_run(live_api, name=f"cmp-{i}", tags=["cmp"]) for i in range(10)]
    for i, run in enumerate(runs):
        points = [{"key": "reward/mean", "step": s, "value": i + s / 1000} for s in range(2_000)]
        points += [{"key": f"only-{i}", "step": 0, "value": 1.0}]
        live_api.seed_metrics(run["id"], points)
    item = live_api.client.list_runs(limit=1)["items"][0]
    assert "config" not in item and "package_versions" not in item
    assert item["tags"] == ["cmp"] and item["experiment"] == "exp"
    assert live_api.client.get_run(item["id"])["config"]["seed"] == 3

    ids = [r["id"] for r in reversed(runs)]
    compared = live_api.client.compare(ids, ["reward/mean", "only-3"], max_points=100)
    assert [c["run"]["id"] for c in compared] == ids
    for c in compared:
        i = runs.index(next(r for r in runs if r["id"] == c["run"]["id"]))
        assert c["config"]["seed"] == 3
        assert c["keys"] == sorted(["reward/mean", f"only-{i}"])
        points = c["series"]["reward/mean"]
        assert 50 <= len(points) <= 100 and points[0]["step"] == 0 and points[-1]["step"] == 1_999
        assert points[-1]["value"] == i + 1.999
        assert ("only-3" in c["series"]) == (i == 3)
        # the same points the run page's own series request returns
        assert points == live_api.client.metrics(c["run"]["id"], ["reward/mean"], max_points=100)["reward/mean"]
    # series far longer than max_points: the same sampling
    (long,) = live_api.client.compare([ids[0]], ["reward/mean"], max_points=10)
    assert long["series"]["reward/mean"] == live_api.client.metrics(ids[0], ["reward/mean"], max_points=10)["reward/mean"]
    assert 2 <= len(long["series"]["reward/mean"]) <= 10  # first/min/max per bucket, and the last point
    with http(live_api) as c:
        too_many = c.get("/runs/compare", params={"runs": ",".join(str(i) for i in range(1, 22))})
        assert too_many.status_code == 422 and "20" in too_many.text
        assert c.get("/runs/compare", params={"runs": "1,x"}).status_code == 422
    with pytest.raises(YattAPIError) as err:
        live_api.client.compare([ids[0], 10**9])
    assert err.value.status == 404 and str(10**9) in err.value.message


def test_search_index_follows_renames_tag_changes_and_deletes(live_api: LiveAPI) -> None:
    from sqlalchemy import delete, select, update

    from backend.runs.models import Experiment, Run, RunTag

    unnamed = new_run(live_api, experiment="yak-study")  # named "<experiment>-<id>" after insert
    in_zebra = new_run(live_api, name="plain", experiment="zebra-study")
    tagged = new_run(live_api, name="quokka", tags=["walrus"])

    def found(q: str) -> list[int]:
        return [r["id"] for r in live_api.client.iter_runs(q=q)]

    assert found(f"yak study {unnamed['id']}") == [unnamed["id"]]
    assert found("zebra") == [in_zebra["id"]] and found("walrus") == [tagged["id"]]
    with live_api.database.session() as s:
        s.execute(update(Experiment).where(Experiment.id == in_zebra["experiment_id"]).values(name="okapi-study"))
        s.execute(delete(RunTag).where(RunTag.run_id == tagged["id"]))
        s.add(RunTag(run_id=tagged["id"], tag="narwhal"))
        s.execute(update(Run).where(Run.id == tagged["id"]).values(description="now with a capybara"))
    assert found("okapi") == [in_zebra["id"]] and found("zebra") == []
    assert found("walrus") == [] and found("narwhal") == [tagged["id"]] and found("capybara") == [tagged["id"]]
    with live_api.database.session() as s:
        s.execute(delete(Run).where(Run.id == tagged["id"]))
        assert s.scalar(select(Run.id).where(Run.id == tagged["id"])) is None
    assert found("narwhal") == []


def test_experiment_run_counts_stay_exact_through_replays_concurrent_creates_moves_and_deletes(
    live_api: LiveAPI,
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from sqlalchemy import delete, update

    from backend.runs.models import Run

    def counts() -> dict[str, int]:
        return {e["name"]: e["run_count"] for e in live_api.client.experiments()}

    def stored() -> dict[str, int]:
        runs = list(live_api.client.iter_runs())
        return {name: sum(r["experiment"] == name for r in runs) for name in {r["experiment"] for r in runs}}

    live_api.client.create_experiment("empty")
    first = new_run(live_api, experiment="alpha", idempotency_key="ci-1")
    assert new_run(live_api, experiment="alpha", idempotency_key="ci-1")["id"] == first["id"]  # a replay
    assert counts() == {"empty": 0, "alpha": 1}

    # at once: new runs in a new experiment, replays of one key, runs in an existing experiment
    def create(i: int) -> int:
        client = live_api.client.__class__(live_api.url, live_api.token)
        try:
            key = "ci-2" if i % 3 == 0 else None
            return int(client.create_run(experiment="alpha" if i % 3 == 2 else "beta", config=CONFIG,
                                         idempotency_key=key)["id"])
        finally:
            client.close()

    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(create, range(24)))
    assert len({ids[i] for i in range(0, 24, 3)}) == 1  # every replay got the one run
    assert counts() == stored() | {"empty": 0} == {"empty": 0, "alpha": 1 + 8, "beta": 1 + 8}

    # runs moved or deleted behind the service's back (by hand, in SQL) are counted too
    beta = next(e for e in live_api.client.experiments() if e["name"] == "beta")
    with live_api.database.session() as s:
        s.execute(update(Run).where(Run.id == first["id"]).values(experiment_id=beta["id"]))
        s.execute(delete(Run).where(Run.id == ids[1]))
    assert counts() == stored() | {"empty": 0} == {"empty": 0, "alpha": 8, "beta": 9}
    assert live_api.client.request("GET", f"/experiments/{beta['id']}")["run_count"] == 9
