"""A job's `integrations` (Weights & Biases, the one type OpenAI defines): checked at creation,
stored on the job, shown as OpenAI shows them, and handed to the worker that claims the job with
the project's key for each integration it uses opened. The keys are project secrets, one per
integration type (`integration_secrets`; `agent-rft projects set-wandb-key`), sealed at rest like
tool headers and never part of any `/v1` answer."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.auth.models import IntegrationSecret
from app.core.crypto import SecretBox
from app.core.errors import bad_request
from app.jobs.schemas import Integration

WANDB = "wandb"


def _stored_key(session: Session, project_id: str, integration: str) -> str | None:
    return session.scalar(select(IntegrationSecret.sealed).where(IntegrationSecret.project_id == project_id,
                                                                 IntegrationSecret.integration == integration))


def check_integrations(session: Session, project_id: str,
                       integrations: list[Integration] | None) -> list[dict[str, Any]] | None:
    """The stored form of `integrations`; 400 when W&B is asked for and the project has no key,
    since the run could not log anywhere and the user would find out only after training."""
    if not integrations:
        return None
    if len(integrations) > 1:  # every entry is `wandb` (the only type), and a job is one run
        raise bad_request("A job logs to one Weights & Biases run: give a single wandb integration.",
                          param="integrations[1]")
    if _stored_key(session, project_id, WANDB) is None:
        raise bad_request("This job asks for the Weights & Biases integration, but its project has no W&B API "
                          "key. An administrator sets one with `agent-rft projects set-wandb-key <project> "
                          "--key-stdin`.", param="integrations", code="wandb_api_key_missing")
    return [integration.model_dump(mode="json") for integration in integrations]


def public_integrations(stored: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """What the job object shows (OpenAI's FineTuningJobWandbIntegrationObject): the settings only."""
    if not stored:
        return None
    return [{"type": item["type"], WANDB: {key: item[WANDB].get(key) for key in ("project", "name", "entity", "tags")}}
            for item in stored]


def wandb_of(stored: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The job's `wandb` settings, or None."""
    return next((item[WANDB] for item in stored or [] if item.get("type") == WANDB), None)


def keys_for_claim(session: Session, project_id: str, stored: list[dict[str, Any]] | None,
                   box: SecretBox) -> dict[str, str]:
    """The project's keys in plain text, by integration type, for the integrations the claimed job uses."""
    keys = {}
    for integration in {item["type"] for item in stored or []}:
        sealed = _stored_key(session, project_id, integration)
        if sealed:
            keys[integration] = box.open(sealed)
    return keys
