"""Each experiment's run count, stored on the experiment (`experiments.run_count`).

GET /experiments lists a project's experiments with their run counts; counting 100,000 runs on
every request cost 25 ms on PostgreSQL (an index-only scan of the whole project) and more under
load. The count is kept by triggers in the database itself, like the search index, so every
writer keeps it exact: a run created by the API (replayed or concurrent), a bulk load, a run
deleted or moved to another experiment by hand, runs removed with their project. Each trigger
adds or subtracts in one UPDATE (never a read-modify-write), so concurrent creates cannot lose
a count: on PostgreSQL they take turns on the experiment's row until each commits.

Migration 0006 calls `install` and then `recount`; a bulk load may `uninstall`, insert, then
`install` and `recount`.
"""

from __future__ import annotations

from sqlalchemy.engine import Connection

from backend.runs.search import dialect_statements

_SQLITE_TRIGGERS = ("experiment_run_count_insert", "experiment_run_count_delete", "experiment_run_count_move")

_SQLITE_DDL = [
    """CREATE TRIGGER IF NOT EXISTS experiment_run_count_insert AFTER INSERT ON runs BEGIN
        UPDATE experiments SET run_count = run_count + 1 WHERE id = new.experiment_id;
    END""",
    """CREATE TRIGGER IF NOT EXISTS experiment_run_count_delete AFTER DELETE ON runs BEGIN
        UPDATE experiments SET run_count = run_count - 1 WHERE id = old.experiment_id;
    END""",
    """CREATE TRIGGER IF NOT EXISTS experiment_run_count_move AFTER UPDATE OF experiment_id ON runs
    WHEN new.experiment_id IS NOT old.experiment_id BEGIN
        UPDATE experiments SET run_count = run_count - 1 WHERE id = old.experiment_id;
        UPDATE experiments SET run_count = run_count + 1 WHERE id = new.experiment_id;
    END""",
]

_SQLITE_DROP = [f"DROP TRIGGER IF EXISTS {name}" for name in _SQLITE_TRIGGERS]

_PG_DDL = [
    """CREATE OR REPLACE FUNCTION yatt_experiment_run_count() RETURNS trigger
        LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_OP IN ('DELETE', 'UPDATE') THEN
            UPDATE experiments SET run_count = run_count - 1 WHERE id = OLD.experiment_id;
        END IF;
        IF TG_OP IN ('INSERT', 'UPDATE') THEN
            UPDATE experiments SET run_count = run_count + 1 WHERE id = NEW.experiment_id;
        END IF;
        RETURN NULL;
    END $$""",
    "DROP TRIGGER IF EXISTS experiment_run_count ON runs",
    "DROP TRIGGER IF EXISTS experiment_run_count_move ON runs",
    """CREATE TRIGGER experiment_run_count AFTER INSERT OR DELETE
        ON runs FOR EACH ROW EXECUTE FUNCTION yatt_experiment_run_count()""",
    """CREATE TRIGGER experiment_run_count_move AFTER UPDATE OF experiment_id ON runs FOR EACH ROW
        WHEN (OLD.experiment_id IS DISTINCT FROM NEW.experiment_id)
        EXECUTE FUNCTION yatt_experiment_run_count()""",
]

_PG_DROP = [
    "DROP TRIGGER IF EXISTS experiment_run_count ON runs",
    "DROP TRIGGER IF EXISTS experiment_run_count_move ON runs",
    "DROP FUNCTION IF EXISTS yatt_experiment_run_count()",
]

_RECOUNT = (
    "UPDATE experiments SET run_count = "
    "(SELECT count(*) FROM runs WHERE runs.experiment_id = experiments.id)"
)


def install(conn: Connection) -> None:
    """Create the triggers that keep `experiments.run_count` in step with `runs` (idempotent)."""
    for stmt in dialect_statements(conn, _SQLITE_DDL, _PG_DDL, what="experiment run-count triggers"):
        conn.exec_driver_sql(stmt)


def uninstall(conn: Connection) -> None:
    """Drop the triggers (the counts stop following the runs until `install` and `recount`)."""
    for stmt in dialect_statements(conn, _SQLITE_DROP, _PG_DROP, what="experiment run-count triggers"):
        conn.exec_driver_sql(stmt)


def recount(conn: Connection) -> None:
    """Count every experiment's runs again from the runs table (after a migration or a bulk load)."""
    conn.exec_driver_sql(_RECOUNT)
