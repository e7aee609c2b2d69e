"""`/v1/fine_tuning/alpha/diagnostics`: this service's extension (docs/diagnostics.md). The
workers' routes are worker_router.py."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, BackgroundTasks, Header, Query, Request

from app.core.deps import CurrentKey, RowIndex, SessionDep, SettingsDep, after_response
from app.core.pagination import ListPage
from app.diagnostics import pipeline, service
from app.diagnostics.schemas import DiagnosticCreate, DiagnosticObject, DiagnosticRolloutObject

router = APIRouter(prefix="/v1/fine_tuning/alpha/diagnostics", tags=["diagnostics"])


def _validate_later(background: BackgroundTasks, request: Request, diagnostic_id: str) -> None:
    state = request.app.state
    after_response(background, request, pipeline.run_validation, state.session_factory, state.storage, state.queue,
                   diagnostic_id)


@router.post("", response_model=DiagnosticObject)
def create_diagnostic(
    body: DiagnosticCreate,
    request: Request,
    background: BackgroundTasks,
    principal: CurrentKey,
    session: SessionDep,
    settings: SettingsDep,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> DiagnosticObject:
    """Run every sample of a training file `runs_per_sample` times with the job's grader and tools,
    to see which samples can teach the model anything. Same inputs as a job."""
    diagnostic, created = service.create(session=session, settings=settings, project_id=principal.project_id,
                                         body=body, idempotency_key=idempotency_key)
    if created:  # after SessionDep's commit: the validator sees the diagnostic
        _validate_later(background, request, diagnostic.id)
    return diagnostic


@router.get("", response_model=ListPage[DiagnosticObject])
def list_diagnostics(principal: CurrentKey, session: SessionDep, after: str | None = None,
                     limit: Annotated[int, Query(ge=1, le=100)] = 20) -> ListPage[DiagnosticObject]:
    """Diagnostics, newest first (without the per-sample results; retrieve one for those)."""
    return service.list_page(session=session, project_id=principal.project_id, after=after, limit=limit)


@router.get("/{diagnostic_id}", response_model=DiagnosticObject)
def retrieve_diagnostic(diagnostic_id: str, principal: CurrentKey, session: SessionDep) -> DiagnosticObject:
    return service.get(session=session, project_id=principal.project_id, diagnostic_id=diagnostic_id)


@router.post("/{diagnostic_id}/cancel", response_model=DiagnosticObject)
def cancel_diagnostic(diagnostic_id: str, principal: CurrentKey, session: SessionDep) -> DiagnosticObject:
    """Cancel a diagnostic that has not finished; what ran so far stays readable."""
    return service.cancel(session=session, project_id=principal.project_id, diagnostic_id=diagnostic_id)


@router.get("/{diagnostic_id}/rollouts", response_model=ListPage[DiagnosticRolloutObject])
def list_diagnostic_rollouts(
    diagnostic_id: str,
    principal: CurrentKey,
    session: SessionDep,
    sample_index: RowIndex | None = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> ListPage[DiagnosticRolloutObject]:
    """The diagnostic's rollouts (the same records as a job's), by sample then run."""
    return service.list_rollouts(session=session, project_id=principal.project_id, diagnostic_id=diagnostic_id,
                                 sample_index=sample_index, after=after, limit=limit)
