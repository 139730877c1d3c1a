"""Read the code that submitted a run's computations (``run_code``)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.core import models as m

#: Submissions shown per run (the agent sends at most 32).
MAX_SUBMISSIONS = 32


def run_code(db: Session, run_id: int) -> list[dict[str, Any]]:
    """The run's submissions, oldest first: ``{"time", "frames": [{"code", "filename",
    "lineno_frame", "lineno_relative"}]}``, frames innermost first."""
    rows = db.execute(
        select(m.RunCode.time, m.RunCode.frames)
        .where(m.RunCode.run_id == run_id)
        .order_by(m.RunCode.time, m.RunCode.digest)
        .limit(MAX_SUBMISSIONS)
    )
    return [{"time": t, "frames": frames} for t, frames in rows]
