"""A team's history in seconds: experiments and runs with tags, summaries and realistic names,
bulk-inserted through the service's own models into a migrated SQLite or PostgreSQL database.

    seed_history(database, project="bench", runs=100_000, experiments=1_000)

Used by bench/history_scale.py and by the History page's browser test. Rows go in with
executemany inserts on the models' tables (the ORM unit of work would take minutes for
100,000 runs); the search index's and the run counts' triggers are lifted during the load and
the index, the experiments' run counts and the metric sort index are rebuilt in one statement
each afterwards — the same functions the migrations use, so what is seeded is what the
service would have written.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import JSON, Connection, Table, insert, select

from backend.auth import service as auth_service
from backend.auth.models import Role
from backend.db import Database, UTCDateTime
from backend.metrics import sort_index
from backend.metrics.models import MetricSummary
from backend.runs import run_counts, search
from backend.runs.models import Experiment, Run, RunAttempt, RunTag
from trainer.config import parse_config

TASKS = ["gsm8k", "math500", "arith", "humaneval", "mbpp", "hh-rlhf", "tldr", "ultrafeedback", "countdown", "kk-logic"]
ALGOS = ["grpo", "ppo", "rloo", "reinforce-pp", "dapo"]
MODELS = ["qwen0.5b", "qwen1.5b", "qwen7b", "llama3-8b", "tiny-small", "tiny-nano", "mistral7b", "phi3-mini"]
VARIANTS = ["baseline", "kl-sweep", "lr-sweep", "long-ctx", "dyn-sampling", "clip-higher", "colocate",
            "disaggregated", "auto-placement", "overlong-penalty", "warm-start", "critic-free", "seed-study",
            "reward-model", "judge-reward", "partial-rollout", "entropy-bonus", "ablation", "repro", "scaling"]
TAGS = ["baseline", "sweep", "nightly", "ablation", "prod-candidate", "regression", "flaky", "debug",
        "paper", "long", "short", "gpu", "cpu", "fsdp", "vllm", "hf-generate", "kl", "lr", "seed",
        "reward-model", "rule-reward", "dapo", "grpo", "ppo", "best", "bad-data", "oom", "rerun",
        "ci", "release-1.2", "release-1.3", "team-a", "team-b", "team-c", "scaling", "eval"]
PEOPLE = ["alice", "bob", "chen", "dana", "eve", "farid", "gita", "hiro", "ines", "jon"]
WORDS = ["checks", "whether", "higher", "lower", "learning", "rate", "helps", "stability", "reward",
         "hacking", "length", "bias", "entropy", "collapse", "clip", "ratio", "warmup", "cosine",
         "schedule", "batch", "size", "groups", "tokens", "throughput", "memory", "placement",
         "offload", "weights", "sync", "staleness", "judge", "verifier", "format", "penalty"]
class RawJSON(str):
    """A JSON document already serialized (the same config text for many runs)."""


SUMMARY_KEYS = ["reward/mean", "kl/mean", "loss/policy", "throughput/gen_tokens_per_s"]
STATES = (["succeeded"] * 70 + ["failed"] * 14 + ["cancelled"] * 5 + ["running"] * 3
          + ["queued"] * 7 + ["starting"])
BATCH = 5_000
PACKAGES = RawJSON('{"torch":"2.13.0+cpu","vllm":"0.11.0","transformers":"4.57.1","ray":"2.60.0"}')


@dataclass
class Seeded:
    """What was seeded, to aim requests at it."""

    project_id: int
    token: str
    experiments: list[str]
    run_ids: list[int]
    tag_counts: dict[str, int] = field(default_factory=dict)
    series_run_ids: list[int] = field(default_factory=list)


def _bulk(conn: Connection, table: Table, rows: list[dict[str, Any]]) -> None:
    """Insert model-shaped rows below the ORM: COPY on PostgreSQL, executemany on SQLite, with
    each column's value stored as its model type stores it (JSON text, UTC times)."""
    if not rows:
        return
    names = list(rows[0])
    sqlite = conn.dialect.name == "sqlite"

    def to_json(value: Any) -> Any:
        return value if value is None or isinstance(value, RawJSON) else json.dumps(value, separators=(",", ":"))

    def to_sqlite_time(value: Any) -> Any:
        return None if value is None else value.astimezone(UTC).replace(tzinfo=None).isoformat(" ")

    converters = []
    for n in names:
        kind = table.c[n].type
        if isinstance(kind, JSON):
            converters.append((n, to_json))
        elif isinstance(kind, UTCDateTime) and sqlite:
            converters.append((n, to_sqlite_time))
    for row in rows:
        for n, convert in converters:
            row[n] = convert(row[n])
    tuples = [tuple(row.values()) for row in rows]
    if sqlite:
        marks = ", ".join("?" * len(names))
        conn.exec_driver_sql(f"INSERT INTO {table.name} ({', '.join(names)}) VALUES ({marks})", tuples)
        return
    with conn.connection.driver_connection.cursor() as cur:  # type: ignore[union-attr]
        with cur.copy(f"COPY {table.name} ({', '.join(names)}) FROM STDIN") as copy:
            for t in tuples:
                copy.write_row(t)


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def seed_history(
    database: Database,
    *,
    project: str = "bench",
    runs: int = 100_000,
    experiments: int = 1_000,
    series_runs: int = 20,
    series_points: int = 2_000,
    seed: int = 0,
) -> Seeded:
    """Fill `project` with `runs` runs over `experiments` experiments; returns what to query.

    About 10% of runs never report reward/mean (missing values sort last); rewards are rounded
    to 3 decimals, so many tie. `series_runs` runs also get `series_points` points of two keys
    (through metric ingest), for the compare page."""
    from backend.metrics import service as metric_service
    from backend.metrics.schemas import MetricPointIn

    rng = random.Random(seed)
    base_config = parse_config({"seed": 0}).model_dump(mode="json")
    base_config["train"]["lr"] = "LR"
    config_text = json.dumps(base_config, separators=(",", ":")).replace('"lr":"LR"', '"lr":LR')
    with database.session() as s:
        proj = auth_service.get_or_create_project(db_session=s, name=project)
        _, token = auth_service.create_token(
            db_session=s, project_id=proj.id, name="history-seed", role=Role.admin
        )
        project_id = proj.id
    exp_names: list[str] = []
    seen: set[str] = set()
    while len(exp_names) < experiments:
        name = "-".join([rng.choice(TASKS), rng.choice(ALGOS), rng.choice(MODELS), rng.choice(VARIANTS)])
        if name in seen:
            name += f"-v{len(exp_names)}"
        seen.add(name)
        exp_names.append(name)
    start = datetime(2025, 1, 1, tzinfo=UTC)
    span_s = (datetime(2026, 11, 1, tzinfo=UTC) - start).total_seconds()
    tag_counts: dict[str, int] = {}

    with database.engine.begin() as conn:
        search.uninstall(conn)  # one rebuild below instead of a trigger call per row
        run_counts.uninstall(conn)  # likewise: one recount below
        conn.execute(
            insert(Experiment),
            [
                {"project_id": project_id, "name": n, "description": _sentence(rng, 8),
                 "tags": rng.sample(TAGS, 2), "created_at": start}
                for n in exp_names
            ],
        )
        exp_ids = dict(
            conn.execute(select(Experiment.name, Experiment.id).where(Experiment.project_id == project_id)).all()
        )
        first_id = int(conn.execute(select(Run.id).order_by(Run.id.desc()).limit(1)).scalar() or 0) + 1
        # every random draw up front, one call per field (a call per run and field is most
        # of the cost of generating 100,000 rows)
        t0, r = start.timestamp(), rng.random
        created_s = sorted(t0 + r() * span_s for _ in range(runs))
        exps = rng.choices(exp_names, k=runs)
        lrs = rng.choices(["1e-6", "3e-6", "1e-5", "3e-5", "5e-5", "1e-4"], k=runs)
        kls = rng.choices(["0", "0.01", "0.04", "0.1"], k=runs)
        states = rng.choices(STATES, k=runs)
        priorities = rng.choices([0, 0, 0, 1, 10, -1], k=runs)
        people = rng.choices(PEOPLE, k=runs)
        n_tags = rng.choices([0, 1, 1, 2, 2, 3], k=runs)
        n_words = rng.choices(range(13), k=runs)
        words = rng.choices(WORDS, k=12 * runs)
        for lo in range(0, runs, BATCH):
            run_rows, tag_rows, attempt_rows, summary_rows = [], [], [], []
            for i in range(lo, min(runs, lo + BATCH)):
                run_id = first_id + i
                exp, lr, state = exps[i], lrs[i], states[i]
                created = datetime.fromtimestamp(created_s[i], UTC)
                started = created + timedelta(seconds=2 + 600 * r()) if state != "queued" else None
                finished = (
                    started + timedelta(seconds=60 + 36_000 * r())
                    if started and state in ("succeeded", "failed", "cancelled") else None
                )
                ci = r() < 0.3
                config = RawJSON(config_text.replace('"seed":0', f'"seed":{i}', 1).replace(
                    '"lr":LR', f'"lr":{float(lr)}', 1))
                has_reward = r() < 0.9
                reward = round(rng.betavariate(2, 3), 3)
                summary = {"reward/mean": reward, "kl/mean": round(r() / 10, 4)} if has_reward else None
                sha = f"{rng.getrandbits(40):010x}"
                run_rows.append({
                    "id": run_id, "project_id": project_id, "experiment_id": exp_ids[exp],
                    "name": f"{exp}-lr{lr}-kl{kls[i]}-s{i % 7}",
                    "description": " ".join(words[12 * i: 12 * i + n_words[i]]),
                    "config": config, "seed": i, "state": state, "attempt": 1, "max_attempts": 1,
                    "priority": priorities[i], "max_duration_s": None,
                    "launched_by": "ci" if ci else "user",
                    "launched_by_name": "ci-bot" if ci else people[i],
                    "ci": {"provider": "gitlab", "commit": sha, "branch": "main",
                           "pipeline_url": f"https://ci.example.com/rlhf/-/pipelines/{i}"} if ci else None,
                    "code_version": sha, "package_versions": PACKAGES,
                    "run_dir": None, "summary": summary,
                    "error": "CUDA out of memory at step 31" if state == "failed" else None,
                    "idempotency_key": None, "request_hash": None,
                    "created_at": created, "updated_at": finished or started or created,
                    "started_at": started, "finished_at": finished,
                })
                attempt_rows.append({"run_id": run_id, "number": 1, "state": state, "created_at": created})
                for tag in rng.sample(TAGS, n_tags[i]) if n_tags[i] else ():
                    tag_rows.append({"run_id": run_id, "tag": tag})
                    tag_counts[tag] = tag_counts.get(tag, 0) + 1
                if has_reward:
                    step = 10 + int(r() * 1990)
                    for key in SUMMARY_KEYS:
                        value = reward if key == "reward/mean" else round(r() * 100, 2)
                        summary_rows.append({
                            "run_id": run_id, "key": key, "latest": value, "latest_step": step,
                            "latest_time": created_s[i] + step, "min": value, "max": value, "count": step,
                        })
            _bulk(conn, Run.__table__, run_rows)
            _bulk(conn, RunAttempt.__table__, attempt_rows)
            _bulk(conn, RunTag.__table__, tag_rows)
            _bulk(conn, MetricSummary.__table__, summary_rows)
        if conn.dialect.name == "postgresql":  # explicit ids: move the sequence past them
            conn.exec_driver_sql("SELECT setval('runs_id_seq', (SELECT max(id) FROM runs))")
        search.install(conn)
        search.rebuild(conn)
        run_counts.install(conn)
        run_counts.recount(conn)
    with database.session() as s:
        sort_index.rebuild(db_session=s)
    run_ids = list(range(first_id, first_id + runs))
    series_ids = run_ids[-series_runs:] if series_runs else []
    for run_id in series_ids:
        with database.session() as s:
            points = [
                MetricPointIn.model_construct(key=key, step=step, value=rng.random(), time=None)
                for step in range(series_points)
                for key in ("reward/mean", "kl/mean")
            ]
            metric_service.ingest(db_session=s, run_id=run_id, points=points)
    # planner statistics (and on PostgreSQL the visibility map that index-only scans need), as
    # a maintained database has them from autovacuum
    if database.dialect == "postgresql":
        with database.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM ANALYZE")
    else:
        with database.engine.begin() as conn:
            conn.exec_driver_sql("ANALYZE")
    return Seeded(project_id, token, exp_names, run_ids, tag_counts, series_ids)


def summary(seeded: Seeded) -> dict[str, Any]:
    """A short description of a seeded history, for printing."""
    return {"runs": len(seeded.run_ids), "experiments": len(seeded.experiments),
            "tags": sum(seeded.tag_counts.values())}
