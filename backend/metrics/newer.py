"""What a live view asks for on each refresh: the points after the step it already holds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from backend.metrics.models import MetricPoint


def points_after_step(
    *, db_session: Session, run_id: int, keys: Sequence[str], after_step: int, limit: int
) -> dict[str, list[dict[str, Any]]]:
    """Each key's first `limit` points with step > `after_step`, in step order (not sampled):
    a key with `limit` points back may have more; ask again after its last step."""
    mp = MetricPoint
    out: dict[str, list[dict[str, Any]]] = {}
    for key in keys:
        rows = db_session.execute(
            select(mp.step, mp.value, mp.time)
            .where(mp.run_id == run_id, mp.key == key, mp.step > after_step)
            .order_by(mp.step, mp.id)
            .limit(limit)
        )
        out[key] = [{"step": r[0], "value": r[1], "time": r[2]} for r in rows]
    return out
