"""Full-text search over runs: name, experiment name, tags and description, ranked.

One index per database, kept in step by triggers in the database itself, so every writer
(the API, the dispatcher, a bulk load) keeps it current:

- SQLite: an FTS5 table `run_search` (rowid = run id), ranked by BM25.
- PostgreSQL: a table `run_search(run_id, document tsvector)` with a GIN index, ranked by
  `ts_rank`; the text is lower-cased and split on anything that is not a letter or digit
  (the `simple` configuration, no stemming: run names are identifiers, not prose).

A query is the words of the user's text, all required, the last one matched as a prefix
(search as you type: "sweep l" finds "lr-sweep-3e-5"; whole words elsewhere are faster and
more precise than prefixes). The index is not a model: Alembic's autogenerate skips
it through `include_object`, and migration 0003 calls `install` and `rebuild`.
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy import Float, Integer, cast, column, func, literal_column, select, table, text
from sqlalchemy.dialects.postgresql import DOUBLE_PRECISION
from sqlalchemy.engine import Connection
from sqlalchemy.sql import Select

SEARCH_TABLE = "run_search"
# name, experiment, tags, description: a hit in the name counts most
_SQLITE_WEIGHTS = (10.0, 4.0, 4.0, 1.0)

_SQLITE_DDL = [
    f"""CREATE VIRTUAL TABLE IF NOT EXISTS {SEARCH_TABLE} USING fts5(
        name, experiment, tags, description,
        tokenize = 'unicode61 remove_diacritics 2', prefix = '2 3')""",
    f"""CREATE TRIGGER IF NOT EXISTS run_search_run_insert AFTER INSERT ON runs BEGIN
        INSERT INTO {SEARCH_TABLE} (rowid, name, experiment, tags, description) VALUES (
            new.id, new.name,
            (SELECT name FROM experiments WHERE id = new.experiment_id),
            (SELECT group_concat(tag, ' ') FROM run_tags WHERE run_id = new.id),
            new.description);
    END""",
    f"""CREATE TRIGGER IF NOT EXISTS run_search_run_update
    AFTER UPDATE OF name, description, experiment_id ON runs BEGIN
        UPDATE {SEARCH_TABLE} SET name = new.name, description = new.description,
            experiment = (SELECT name FROM experiments WHERE id = new.experiment_id)
        WHERE rowid = new.id;
    END""",
    f"""CREATE TRIGGER IF NOT EXISTS run_search_run_delete AFTER DELETE ON runs BEGIN
        DELETE FROM {SEARCH_TABLE} WHERE rowid = old.id;
    END""",
    f"""CREATE TRIGGER IF NOT EXISTS run_search_tag_insert AFTER INSERT ON run_tags BEGIN
        UPDATE {SEARCH_TABLE}
        SET tags = (SELECT group_concat(tag, ' ') FROM run_tags WHERE run_id = new.run_id)
        WHERE rowid = new.run_id;
    END""",
    f"""CREATE TRIGGER IF NOT EXISTS run_search_tag_delete AFTER DELETE ON run_tags BEGIN
        UPDATE {SEARCH_TABLE}
        SET tags = (SELECT group_concat(tag, ' ') FROM run_tags WHERE run_id = old.run_id)
        WHERE rowid = old.run_id;
    END""",
    f"""CREATE TRIGGER IF NOT EXISTS run_search_experiment_update
    AFTER UPDATE OF name ON experiments BEGIN
        UPDATE {SEARCH_TABLE} SET experiment = new.name
        WHERE rowid IN (SELECT id FROM runs WHERE experiment_id = new.id);
    END""",
]

_SQLITE_DROP = [
    *(
        f"DROP TRIGGER IF EXISTS {name}"
        for name in (
            "run_search_run_insert", "run_search_run_update", "run_search_run_delete",
            "run_search_tag_insert", "run_search_tag_delete", "run_search_experiment_update",
        )
    ),
    f"DROP TABLE IF EXISTS {SEARCH_TABLE}",
]

_SQLITE_REBUILD = [
    f"DELETE FROM {SEARCH_TABLE}",
    f"""INSERT INTO {SEARCH_TABLE} (rowid, name, experiment, tags, description)
    SELECT r.id, r.name, e.name,
        (SELECT group_concat(tag, ' ') FROM run_tags t WHERE t.run_id = r.id), r.description
    FROM runs r JOIN experiments e ON e.id = r.experiment_id""",
]

# The document of one run; `$1` is the run id. Lower-cased, non-alphanumerics become spaces,
# so the index holds the same words the query side (`words`) makes.
_PG_DOCUMENT = """
    SELECT r.id,
        setweight(to_tsvector('simple', yatt_search_words(r.name)), 'A')
        || setweight(to_tsvector('simple', yatt_search_words(e.name)), 'B')
        || setweight(to_tsvector('simple', yatt_search_words(coalesce(
            (SELECT string_agg(t.tag, ' ') FROM run_tags t WHERE t.run_id = r.id), ''))), 'B')
        || setweight(to_tsvector('simple', yatt_search_words(r.description)), 'D')
    FROM runs r JOIN experiments e ON e.id = r.experiment_id
"""

_PG_DDL = [
    f"""CREATE TABLE IF NOT EXISTS {SEARCH_TABLE} (
        run_id INTEGER PRIMARY KEY REFERENCES runs (id) ON DELETE CASCADE,
        document tsvector NOT NULL)""",
    f"CREATE INDEX IF NOT EXISTS ix_run_search_document ON {SEARCH_TABLE} USING gin (document)",
    r"""CREATE OR REPLACE FUNCTION yatt_search_words(t text) RETURNS text
        LANGUAGE sql IMMUTABLE PARALLEL SAFE
        AS $$ SELECT regexp_replace(lower(coalesce(t, '')), '[^[:alnum:]]+', ' ', 'g') $$""",
    f"""CREATE OR REPLACE FUNCTION yatt_run_search_refresh(rid integer) RETURNS void
        LANGUAGE sql AS $$
        INSERT INTO {SEARCH_TABLE} (run_id, document) {_PG_DOCUMENT} WHERE r.id = rid
        ON CONFLICT (run_id) DO UPDATE SET document = excluded.document
    $$""",
    """CREATE OR REPLACE FUNCTION yatt_run_search_trigger() RETURNS trigger
        LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_TABLE_NAME = 'runs' THEN
            PERFORM yatt_run_search_refresh(NEW.id);
        ELSIF TG_TABLE_NAME = 'experiments' THEN
            PERFORM yatt_run_search_refresh(r.id) FROM runs r WHERE r.experiment_id = NEW.id;
        ELSIF TG_OP = 'DELETE' THEN
            -- a tag removed with its run (cascade) has no run left to refresh
            PERFORM yatt_run_search_refresh(r.id) FROM runs r WHERE r.id = OLD.run_id;
        ELSE
            PERFORM yatt_run_search_refresh(NEW.run_id);
        END IF;
        RETURN NULL;
    END $$""",
    "DROP TRIGGER IF EXISTS run_search_runs ON runs",
    """CREATE TRIGGER run_search_runs AFTER INSERT OR UPDATE OF name, description, experiment_id
        ON runs FOR EACH ROW EXECUTE FUNCTION yatt_run_search_trigger()""",
    "DROP TRIGGER IF EXISTS run_search_tags ON run_tags",
    """CREATE TRIGGER run_search_tags AFTER INSERT OR DELETE
        ON run_tags FOR EACH ROW EXECUTE FUNCTION yatt_run_search_trigger()""",
    "DROP TRIGGER IF EXISTS run_search_experiments ON experiments",
    """CREATE TRIGGER run_search_experiments AFTER UPDATE OF name
        ON experiments FOR EACH ROW EXECUTE FUNCTION yatt_run_search_trigger()""",
]

_PG_DROP = [
    "DROP TRIGGER IF EXISTS run_search_runs ON runs",
    "DROP TRIGGER IF EXISTS run_search_tags ON run_tags",
    "DROP TRIGGER IF EXISTS run_search_experiments ON experiments",
    "DROP FUNCTION IF EXISTS yatt_run_search_trigger()",
    "DROP FUNCTION IF EXISTS yatt_run_search_refresh(integer)",
    f"DROP TABLE IF EXISTS {SEARCH_TABLE}",
    "DROP FUNCTION IF EXISTS yatt_search_words(text)",
]

_PG_REBUILD = [
    f"DELETE FROM {SEARCH_TABLE}",
    f"INSERT INTO {SEARCH_TABLE} (run_id, document) {_PG_DOCUMENT}",
]


def dialect_statements(conn: Connection, sqlite: list[str], postgresql: list[str], *, what: str) -> list[str]:
    """The statements for `conn`'s database; `what` names the feature that needs one of the two."""
    name = conn.dialect.name
    if name == "sqlite":
        return sqlite
    if name == "postgresql":
        return postgresql
    raise NotImplementedError(f"{what} needs SQLite or PostgreSQL, not {name}")


def install(conn: Connection) -> None:
    """Create the search index and the triggers that keep it in step (idempotent)."""
    for stmt in dialect_statements(conn, _SQLITE_DDL, _PG_DDL, what="run search (FTS5 / tsvector)"):
        conn.exec_driver_sql(stmt)


def uninstall(conn: Connection) -> None:
    """Drop the search index and its triggers."""
    for stmt in dialect_statements(conn, _SQLITE_DROP, _PG_DROP, what="run search (FTS5 / tsvector)"):
        conn.exec_driver_sql(stmt)


def rebuild(conn: Connection) -> None:
    """Index every run again from scratch (after a migration or a bulk load)."""
    for stmt in dialect_statements(conn, _SQLITE_REBUILD, _PG_REBUILD, what="run search (FTS5 / tsvector)"):
        conn.exec_driver_sql(stmt)


def include_object(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
    """Alembic's autogenerate filter: the search index (and FTS5's shadow tables) is made by
    `install`, not by the models, so it is no drift."""
    if type_ == "table" and reflected and compare_to is None and name is not None:
        return not (name == SEARCH_TABLE or name.startswith(SEARCH_TABLE + "_"))
    return True


_WORD = re.compile(r"[^\W_]+")


def words(query: str) -> list[str]:
    """The words of a search text, lower-cased: letters and digits, split on anything else."""
    return _WORD.findall(query.lower())


def matches(dialect: str, query: str) -> Select[Any]:
    """`SELECT run_id, score` of the runs matching every word of `query` (the last as a prefix); a
    higher score is a better match. Raises ValueError for a text without a letter or digit.
    The caller scopes it to a project and orders it."""
    terms = words(query)
    if not terms:
        raise ValueError("a search needs at least one letter or digit")
    search = table(SEARCH_TABLE, column("rowid", Integer), column("run_id", Integer), column("document"))
    if dialect == "sqlite":
        weights = ", ".join(str(w) for w in _SQLITE_WEIGHTS)
        return (
            select(
                search.c.rowid.label("run_id"),
                literal_column(f"-bm25({SEARCH_TABLE}, {weights})", Float).label("score"),
            )
            .select_from(search)
            .where(text(f"{SEARCH_TABLE} MATCH :fts").bindparams(
                fts=" ".join(f'"{t}"' for t in terms[:-1]) + f' "{terms[-1]}"*'))
        )
    tsquery = func.to_tsquery(literal_column("'simple'::regconfig"), " & ".join([*terms[:-1], f"{terms[-1]}:*"]))
    # as double precision: a real (float4) comes back rounded in text, and a cursor made
    # from the rounded value would not compare equal to the score it came from
    score = cast(func.ts_rank(search.c.document, tsquery), DOUBLE_PRECISION)
    return select(search.c.run_id, score.label("score")).where(search.c.document.op("@@")(tsquery))
