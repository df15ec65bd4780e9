"""What the dispatcher keeps beyond the run rows: each attempt's stored log."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ForeignKey, Integer, Text
from sqlalchemy.orm import Mapped, mapped_column

from backend.db import Base, utcnow


class RunLog(Base):
    """The Ray job driver's log of one attempt, copied when the attempt ends.

    Ray forgets a job's logs when its cluster goes; the stored copy is what
    `GET /runs/{id}/logs` serves after that.
    """

    __tablename__ = "run_logs"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    text: Mapped[str] = mapped_column(Text, default="")
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
