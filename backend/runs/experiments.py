"""Experiments: named groups of runs, created on first use."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from backend.runs.models import Experiment


def get_experiment_by_name(*, db_session: Session, project_id: int, name: str) -> Experiment | None:
    """A project's experiment by name."""
    return db_session.scalar(
        select(Experiment).where(Experiment.project_id == project_id, Experiment.name == name)
    )


def get_experiment(*, db_session: Session, project_id: int, experiment_id: int) -> Experiment | None:
    """A project's experiment by id."""
    exp = db_session.get(Experiment, experiment_id)
    return exp if exp is not None and exp.project_id == project_id else None


def create_experiment(
    *, db_session: Session, project_id: int, name: str, description: str = "", tags: Sequence[str] = ()
) -> Experiment:
    """A new experiment; raises IntegrityError if the name is taken in the project."""
    exp = Experiment(project_id=project_id, name=name, description=description, tags=list(tags))
    db_session.add(exp)
    db_session.flush()
    return exp


def get_or_create_experiment(*, db_session: Session, project_id: int, name: str) -> Experiment:
    """The project's experiment called `name`, created if needed (safe under concurrency)."""
    exp = get_experiment_by_name(db_session=db_session, project_id=project_id, name=name)
    if exp is not None:
        return exp
    try:
        with db_session.begin_nested():
            exp = create_experiment(db_session=db_session, project_id=project_id, name=name)
    except IntegrityError:
        exp = get_experiment_by_name(db_session=db_session, project_id=project_id, name=name)
        assert exp is not None
    return exp


def list_experiments(*, db_session: Session, project_id: int) -> list[Experiment]:
    """A project's experiments, oldest first, each with its stored `run_count`."""
    return list(
        db_session.scalars(
            select(Experiment).where(Experiment.project_id == project_id).order_by(Experiment.id)
        )
    )
