"""A run's checkpoints; the newest (highest step) is the resume point."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from backend.runs.models import Checkpoint, Run, RunEvent
from backend.runs.schemas import CheckpointIn


def add_checkpoint(*, db_session: Session, run: Run, checkpoint_in: CheckpointIn) -> Checkpoint:
    """Record a checkpoint the trainer saved."""
    ckpt = Checkpoint(
        run_id=run.id,
        attempt=run.attempt,
        step=checkpoint_in.step,
        path=checkpoint_in.path,
        size_bytes=checkpoint_in.size_bytes,
        metrics=checkpoint_in.metrics,
    )
    db_session.add(ckpt)
    db_session.add(
        RunEvent(
            run_id=run.id,
            attempt=run.attempt,
            kind="checkpoint",
            message=f"checkpoint at step {checkpoint_in.step}: {checkpoint_in.path}",
            data={"step": checkpoint_in.step, "path": checkpoint_in.path},
        )
    )
    db_session.flush()
    return ckpt


def list_checkpoints(*, db_session: Session, run_id: int) -> list[Checkpoint]:
    """A run's checkpoints, newest (highest step) last."""
    return list(
        db_session.scalars(
            select(Checkpoint).where(Checkpoint.run_id == run_id).order_by(Checkpoint.step, Checkpoint.id)
        )
    )


def latest_checkpoint(*, db_session: Session, run_id: int) -> Checkpoint | None:
    """The resume point: the checkpoint with the highest step."""
    return db_session.scalar(
        select(Checkpoint)
        .where(Checkpoint.run_id == run_id)
        .order_by(Checkpoint.step.desc(), Checkpoint.id.desc())
        .limit(1)
    )
