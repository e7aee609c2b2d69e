"""Every per-step metric of a job as CSV: a `step` column, then one column per metric key
(`scores.train_reward_mean`, `train.loss`, …, sorted), one row per step. The dashboard's
metrics.csv download and a succeeded job's `step_metrics.csv` result file are this one table."""

from __future__ import annotations

import csv
import io

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.jobs.models import JobMetric

FILENAME = "step_metrics.csv"


def all_metrics(*, session: Session, job_id: str) -> tuple[list[str], list[tuple[int, dict[str, float]]]]:
    """Every metric of every step, as columns and rows."""
    rows: dict[int, dict[str, float]] = {}
    keys: set[str] = set()
    stmt = select(JobMetric.step, JobMetric.key, JobMetric.value).where(JobMetric.job_id == job_id)
    for step, key, value in session.execute(stmt):
        rows.setdefault(step, {})[key] = value
        keys.add(key)
    return sorted(keys), sorted(rows.items())


def step_metrics_csv(*, session: Session, job_id: str) -> str:
    """The CSV text; a metric a step did not report is an empty cell."""
    keys, rows = all_metrics(session=session, job_id=job_id)
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["step", *keys])
    for step, values in rows:
        writer.writerow([step, *(values.get(k, "") for k in keys)])
    return out.getvalue()
