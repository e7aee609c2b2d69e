"""The one lifecycle of everything a worker runs (fine-tuning jobs, variance diagnostics):

- `StateMachine`: the allowed moves between statuses, the terminal ones, and an on-move hook (a
  job writes its event and webhook outbox row there). A row's status changes only through it.
- `LeasedRun`: the lease columns and their rules. A worker claims a queued run and gets a lease;
  it heartbeats to extend it; every write it makes checks that it still holds it; finishing gives
  it back (remembered, so that a retried finish is recognised). A run whose worker stopped
  heartbeating is re-queued by the watchdog (`expire_leases`).
- `PeriodicLoop`: the background thread that runs a round every few seconds until stopped (the
  lease watchdogs, the webhook sweeper).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from enum import StrEnum
from typing import Any, ClassVar, Generic, TypeVar

from sqlalchemy import DateTime, String, or_, select
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker

from app.core.bearer import same_secret
from app.core.db import utcnow
from app.core.errors import APIError, conflict, not_found
from app.core.worker_schemas import UNEXPLAINED_FAILURE
from agent_rft.ids import new_id

log = logging.getLogger(__name__)
Status = TypeVar("Status", bound=StrEnum)
Run = TypeVar("Run", bound="LeasedRun")

RUNNING, QUEUED = "running", "queued"  # the two statuses every leased run has


@dataclass(frozen=True)
class StateMachine(Generic[Status]):
    """`kind` names the object in errors ("job", "diagnostic"). `system_transitions` are moves only
    the control plane makes (a running run whose lease expired goes back to the queue), never a
    user's action. `on_move(session, row, previous, to, **details)` runs after each move, in the
    same transaction."""

    kind: str
    transitions: dict[Status, frozenset[Status]]
    terminal: frozenset[Status]
    system_transitions: dict[Status, frozenset[Status]] = field(default_factory=dict)
    on_move: Callable[..., None] | None = None

    def allows(self, current: Status, to: Status, *, system: bool = False) -> bool:
        """Whether `to` may follow `current`; `system`: counting the control plane's own moves."""
        allowed = self.transitions.get(current, frozenset())
        if system:
            allowed = allowed | self.system_transitions.get(current, frozenset())
        return to in allowed

    def status(self, value: str) -> Status:
        """`value` as one of this machine's statuses."""
        return type(next(iter(self.terminal)))(value)

    def move(self, session: Session, row: Any, to: Status, *, action: str | None = None,
             error: dict[str, Any] | None = None, **details: Any) -> None:
        """Move `row` to `to` (409 invalid_<kind>_status where the move is not allowed; `action`
        names the user's action, which may not make system moves)."""
        current = type(to)(row.status)
        if not self.allows(current, to, system=action is None):
            verb = action or f"move to '{to.value}'"
            raise conflict(f"Cannot {verb} {self.kind} '{row.id}': its status is '{current.value}'.",
                           code=f"invalid_{self.kind}_status", param="status")
        row.status = to.value
        if to in self.terminal:
            row.finished_at = utcnow()
        if error is not None:
            row.error = error
        if to.value == QUEUED:
            row.enqueued_at = None  # (re)sent to the broker after the commit
        if self.on_move is not None:
            self.on_move(session, row, current, to, **details)


def _aware(ts: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; they are UTC here."""
    return ts.replace(tzinfo=timezone.utc) if ts is not None and ts.tzinfo is None else ts


class LeasedRun:
    """Mixin of a table whose rows workers run under a lease. `kind` names a row in lease errors
    ("job"), `noun` in a 404 ("fine-tuning job"), `id_param` the request field that carries its id."""

    kind: ClassVar[str]
    noun: ClassVar[str]
    id_param: ClassVar[str]

    # When the task was handed to the broker; None while queued means "send it (again)".
    enqueued_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # Who runs it and until when, unless it heartbeats.
    lease_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    lease_owner: Mapped[str | None] = mapped_column(String(255), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # The last lease given back by a finish call, so that a retried finish is recognised.
    released_lease_id: Mapped[str | None] = mapped_column(String(64), nullable=True)

    @property
    def lease_holder(self) -> str | None:
        return self.lease_owner if self.lease_id else None

    def lease_is_live(self, now: datetime) -> bool:
        expires = _aware(self.lease_expires_at)
        return self.lease_id is not None and expires is not None and expires > now

    def held_elsewhere(self, worker_id: str, now: datetime) -> bool:
        """Another worker than `worker_id` holds a live lease on it."""
        return self.lease_holder not in (None, worker_id) and self.lease_is_live(now)

    def holds_lease(self, lease_id: str) -> bool:
        return same_secret(self.lease_id, lease_id)

    def gave_back(self, lease_id: str) -> bool:
        """`lease_id` is the lease the last finish call released (a retried finish)."""
        return same_secret(self.released_lease_id, lease_id)

    def grant_lease(self, worker_id: str, seconds: float, now: datetime) -> None:
        """A new lease, or the same one extended when `worker_id` already holds it (a retried claim)."""
        if self.lease_id is None or self.lease_owner != worker_id:
            self.lease_id = new_id("lease_")
        self.lease_owner = worker_id
        self.lease_expires_at = now + timedelta(seconds=seconds)

    def extend_lease(self, seconds: float) -> None:
        self.lease_expires_at = utcnow() + timedelta(seconds=seconds)

    def release_lease(self, *, remember: bool) -> None:
        if remember:
            self.released_lease_id = self.lease_id
        self.lease_id = self.lease_owner = self.lease_expires_at = None


def locked_run(session: Session, model: type[Run], run_id: str) -> Run:
    """The row, locked for this transaction (one run's worker calls never interleave); else 404."""
    row = session.scalar(select(model).where(model.id == run_id).with_for_update())
    if row is None:
        raise not_found(model.noun, run_id, param=model.id_param)
    return row


def lease_lost(row: LeasedRun, lease_id: str) -> APIError:
    return conflict(f"Lease '{lease_id}' no longer holds {row.kind} '{row.id}' (it expired and the {row.kind} was "
                    "re-queued or taken over, or it finished). Stop working on it.",
                    code="lease_lost", param="lease_id")


def leased_run(session: Session, model: type[Run], run_id: str, lease_id: str) -> Run:
    """The row, locked, if `lease_id` is still its lease; else 409 lease_lost. A lease past its
    expiry still counts until the watchdog or another worker takes it: a late heartbeat is not a
    lost run."""
    row = locked_run(session, model, run_id)
    if not row.holds_lease(lease_id):
        raise lease_lost(row, lease_id)
    return row


def finishing_run(session: Session, model: type[Run], run_id: str, lease_id: str) -> tuple[Run, bool]:
    """(the row, locked; whether this finish was already done): a finish retried after its answer
    was lost carries the lease the first one released."""
    row = locked_run(session, model, run_id)
    if row.holds_lease(lease_id):
        return row, False
    if row.gave_back(lease_id):
        return row, True
    raise lease_lost(row, lease_id)


def end_run(session: Session, model: type[Run], run_id: str, lease_id: str, *, status: str,
            error: dict[str, Any] | None, states: StateMachine[Any], refresh: Callable[[Run], None]) -> str:
    """A worker's finish of a run it leased (a diagnostic, an eval run): the end it reports (`failed`
    with its `error`, or the unexplained failure), `refresh(row)` for the results the control plane
    computes, and the lease given back; a retried finish changes nothing. Returns the status."""
    row, retried = finishing_run(session, model, run_id, lease_id)
    if retried:
        return row.status
    if row.status == RUNNING:
        to = states.status(status)
        failed = to.value == "failed"
        states.move(session, row, to, error=(error or UNEXPLAINED_FAILURE) if failed else None)
    refresh(row)
    row.release_lease(remember=True)
    return row.status


def claim_run(row: LeasedRun, worker_id: str, *, lease_seconds: float, now: datetime,
              start: Callable[[], None], took_over: Callable[[str | None], None] | None = None) -> None:
    """Give `worker_id` the lease on `row`: one run, one worker. While another worker's lease is
    live, in any status, the answer is 409 lease_held (a queued run may still be leased: its worker
    has not given the lease back yet). Queued: `start()` moves it to running. Running: taken over
    once its worker's lease has expired. `took_over(the previous worker)` hears of a run taken from
    another worker, or from none (a running run without a lease). Any other status: 409
    not_claimable."""
    previous = row.lease_holder
    someone_else = previous is not None and previous != worker_id
    if row.held_elsewhere(worker_id, now) and row.status in (RUNNING, QUEUED):
        raise conflict(f"{row.kind.capitalize()} '{row.id}' is held by worker {previous}, whose lease is live; "
                       "try later.", code="lease_held")
    if row.status == RUNNING:
        if took_over is not None and (previous is None or someone_else):
            took_over(previous)
    elif row.status == QUEUED:
        if took_over is not None and someone_else:
            took_over(previous)
        start()
    else:
        raise conflict(f"{row.kind.capitalize()} '{row.id}' cannot be claimed: its status is '{row.status}'.",
                       code="not_claimable", param="status")
    row.grant_lease(worker_id, lease_seconds, now)


def expire_leases(session: Session, model: type[Run], *, now: datetime, requeue: Callable[[Run], bool],
                  restart_grace_s: float | None = None) -> list[str]:
    """Running rows whose lease expired (or that have none) get `requeue(row)` (which moves them
    back to the queue and says whether to send them to the broker again); expired leases of rows
    in any other status are cleared. Returns the ids to send. Rows being claimed or heartbeating
    right now are skipped (SKIP LOCKED) and looked at next round.

    `restart_grace_s` (the first round after the control plane starts): every running row's lease
    first gets at least that long from `now`. Its worker could not heartbeat while no API was up to
    hear it, so the time the control plane was down (a restart, a deploy) is not counted against
    the worker; a worker that died meanwhile is noticed one grace later."""
    if restart_grace_s is not None:
        _extend_running_leases(session, model, until=now + timedelta(seconds=restart_grace_s))
    lease_over = or_(model.lease_expires_at.is_(None), model.lease_expires_at < now)
    stale = or_((model.status == RUNNING) & lease_over, model.lease_expires_at < now)
    resend = []
    for row in session.scalars(select(model).where(stale).with_for_update(skip_locked=True)):
        if row.status == RUNNING and requeue(row):
            resend.append(row.id)
        row.release_lease(remember=False)
    return resend


def _extend_running_leases(session: Session, model: type[Run], *, until: datetime) -> None:
    running = (model.status == RUNNING) & model.lease_id.is_not(None) & (model.lease_expires_at < until)
    for row in session.scalars(select(model).where(running).with_for_update(skip_locked=True)):
        row.lease_expires_at = until



def hand_to_broker(factory: sessionmaker[Session], model: type[Run], run_id: str, send: Callable[[str], Any]) -> bool:
    """Publish a queued run's task (`send(run_id)`) after its status is committed, and record it.
    On a broker failure the run stays queued without `enqueued_at`: start-up, or the watchdog's
    next re-queue, sends it again. Never raises into a request."""
    try:
        send(run_id)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        log.warning("could not enqueue %s: %s", run_id, exc)
        return False
    with factory.begin() as session:
        row = session.scalar(select(model).where(model.id == run_id))
        if row is not None and row.status == QUEUED:
            row.enqueued_at = utcnow()
    return True

class PeriodicLoop(threading.Thread):
    """Runs each of `rounds` (called with `first`, True the first time) at start and then every
    `interval_s` seconds until stopped. A round's error is logged and the others, and the next
    rounds, run anyway: a watchdog must outlive a database or broker outage."""

    def __init__(self, name: str, interval_s: float, *rounds: Callable[[bool], Any]) -> None:
        super().__init__(name=name, daemon=True)
        self.interval_s, self.rounds = interval_s, rounds
        self._stopped = threading.Event()

    def run(self) -> None:
        first = True
        while not self._stopped.is_set():
            for round_ in self.rounds:
                try:
                    round_(first)
                except Exception:  # noqa: BLE001 - see the class docstring
                    log.exception("%s round failed", self.name)
            first = False
            self._stopped.wait(self.interval_s)

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self.join(timeout)
