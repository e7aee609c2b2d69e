"""The job page's charts: which per-step metrics (keys of job_metrics, i.e. the flattened keys of
the trainer's metrics event) each chart draws. Each method's module in app/jobs/methods/ lists the
charts its jobs' page shows (`CHARTS`).

A series is either one key or every key under a prefix (one trace per tool, per grader...);
the page's script turns these specs into plotly traces, so adding a chart is adding a spec."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Series:
    name: str
    key: str | None = None  # one metric key
    prefix: str | None = None  # or one trace per key under this prefix, named by the rest of the key
    markers: bool = False  # points only where the metric exists (validation runs at eval steps)
    exclude: tuple[str, ...] = ()  # keys under `prefix` to leave out


@dataclass(frozen=True)
class Chart:
    id: str
    title: str
    y_title: str
    series: tuple[Series, ...]
    stacked: bool = False  # stacked areas, with a toggle to shares of the total
    percent: bool = False  # values are rates in [0, 1]
    help: str = ""




def _charts_of(method: str | None) -> list[Chart]:
    """A method's charts (its module in app/jobs/methods/ lists them), or every method's."""
    from app.jobs.methods import METHODS

    modules = METHODS.values() if method is None else [METHODS[method]] if method in METHODS else []
    return [chart for module in modules for chart in getattr(module, "CHARTS", ())]


def chart_specs(method: str) -> list[dict[str, Any]]:
    return [asdict(chart) for chart in _charts_of(method)]


def charted_keys(method: str | None = None) -> tuple[list[str], list[str], list[str]]:
    """The exact keys, key prefixes and excluded keys that the charts of `method` (None: every
    chart) draw, for a SQL filter."""
    charts = _charts_of(method)
    exact = [s.key for c in charts for s in c.series if s.key]
    prefixes = [s.prefix for c in charts for s in c.series if s.prefix]
    excluded = [k for c in charts for s in c.series for k in s.exclude]
    return exact, prefixes, excluded
