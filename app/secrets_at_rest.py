"""`agent-rft secrets reencrypt` and `decrypt`: one pass over every stored secret (the tool and
grader headers in jobs' and diagnostics' `method`, in evals' testing criteria and in eval runs'
tool endpoints, the webhook endpoints' signing secrets, the projects' W&B API keys).

reencrypt seals each under the newest key of AGENT_RFT_SECRET_KEYS, plain values stored before
encryption included; a value already under the newest key is left as it is, so a second run
changes nothing. decrypt writes every value back in plain text, which only a downgrade below
revision 0007 needs. Rows go in batches, each locked in its own transaction."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from app.core.crypto import SecretBox, is_sealed
from app.jobs.tool_headers import reseal_headers, unseal_headers
from app.models import (  # every table: their foreign keys resolve
    Diagnostic, Eval, EvalRun, IntegrationSecret, Job, WebhookEndpoint)

BATCH = 200
WEBHOOK_SECRETS = ("signing_secret", "previous_signing_secret")


@dataclass
class Rewritten:
    """How many stored values a pass rewrote."""

    headers: int = 0  # values in a `method`, an eval's criteria or a run's tools: tools' and graders'
    webhook_secrets: int = 0
    integration_keys: int = 0  # projects' integration keys (W&B API keys)


def _locked_batches(factory: sessionmaker[Session], model: Any) -> Iterator[list[Any]]:
    """Every row of `model` in primary-key order, BATCH at a time; what the caller changes in a
    batch commits before the next one is read."""
    after = 0
    while True:
        with factory.begin() as session:
            rows = list(session.scalars(select(model).where(model.seq > after).order_by(model.seq)
                                        .limit(BATCH).with_for_update()))
            if not rows:
                return
            yield rows
            after = rows[-1].seq


def _rewrite_secrets(ep: WebhookEndpoint, rewrite: Callable[[str], str | None]) -> int:
    changed = 0
    for column in WEBHOOK_SECRETS:
        stored = getattr(ep, column)
        new = rewrite(stored) if stored else None
        if new is not None:
            setattr(ep, column, new)
            changed += 1
    return changed


def _pass(factory: sessionmaker[Session], method: Callable[[dict], tuple[dict, int]],
          secret: Callable[[str], str | None]) -> Rewritten:
    done = Rewritten()
    for model in (Job, Diagnostic):
        for rows in _locked_batches(factory, model):
            for row in rows:
                new, changed = method(row.method)
                if changed:
                    row.method, done.headers = new, done.headers + changed
    done.headers += _rewrite_eval_headers(factory, method)
    for endpoints in _locked_batches(factory, WebhookEndpoint):
        done.webhook_secrets += sum(_rewrite_secrets(ep, secret) for ep in endpoints)
    done.integration_keys = _rewrite_integration_keys(factory, secret)
    return done


def _rewrite_eval_headers(factory: sessionmaker[Session], method: Callable[[dict], tuple[dict, int]]) -> int:
    """Evals' criteria and runs' tool endpoints, each passed through `method` as a job's block would be."""
    changed = 0
    for rows in _locked_batches(factory, Eval):
        for row in rows:
            new = [method({"reinforcement": {"grader": criterion}}) for criterion in row.testing_criteria]
            if any(count for _, count in new):
                row.testing_criteria = [block["reinforcement"]["grader"] for block, _ in new]
                changed += sum(count for _, count in new)
    for rows in _locked_batches(factory, EvalRun):
        for row in rows:
            agent = row.data_source.get("x_open_model") or {}
            block, count = method({"reinforcement": {"tools": agent.get("tools") or []}})
            if count:
                row.data_source = {**row.data_source, "x_open_model": {**agent, "tools": block["reinforcement"]["tools"]}}
                changed += count
    return changed


def _rewrite_integration_keys(factory: sessionmaker[Session], rewrite: Callable[[str], str | None]) -> int:
    """The projects' integration keys, in one transaction: one row per project and integration."""
    changed = 0
    with factory.begin() as session:
        for secret in session.scalars(select(IntegrationSecret).with_for_update()):
            new = rewrite(secret.sealed)
            if new is not None:
                secret.sealed, changed = new, changed + 1
    return changed


def reencrypt(factory: sessionmaker[Session], box: SecretBox) -> Rewritten:
    return _pass(factory, lambda method: reseal_headers(method, box), box.reseal)


def decrypt(factory: sessionmaker[Session], box: SecretBox) -> Rewritten:
    return _pass(factory, lambda method: unseal_headers(method, box),
                 lambda stored: box.open(stored) if is_sealed(stored) else None)
