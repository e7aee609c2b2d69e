"""Checkpoint permissions through the official `openai` SDK against a real uvicorn server
(`client.fine_tuning.checkpoints.permissions`): sharing, listing, revoking, who may do what, and
the effect of a share on serving and on starting a job, and of a revoked share on a job that has
not finished. Checkpoints are recorded as a worker's push
records them, without training; no inference server runs, so a served name answers 503 once it
resolves (404 when it does not), and the resolution itself is checked with `resolve`."""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from openai.types.fine_tuning.checkpoints import (
    PermissionCreateResponse,
    PermissionDeleteResponse,
    PermissionListResponse,
    PermissionRetrieveResponse,
)
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.db import make_engine, make_session_factory
from app.core.errors import APIError
from app.jobs import service
from app.jobs.lineage import start_point
from app.jobs.models import Job
from app.jobs.schemas import MAX_PERMISSION_PROJECTS
from app.jobs.worker_service import fine_tuned_model_name
from app.serving.service import ResolvedModel, resolve
from tests.conftest import free_port, job_body, jsonl, live_server, make_project, question_rows, wait_for

BASE = "SmolLM2-135M-Instruct"


@dataclass
class Tenant:
    """A project as its user sees it: its id, name and an SDK client with its key."""

    project_id: str
    name: str
    sdk: openai.OpenAI


@dataclass
class World:
    owner: Tenant
    grantee: Tenant
    stranger: Tenant
    others: list[Tenant]  # more projects to share with


def strict(model_type, obj):  # noqa: ANN001, ANN201
    """Validate what the SDK parsed against its own pydantic type."""
    return model_type.model_validate(obj.model_dump(mode="json"))


@pytest.fixture
def world(settings, project) -> Iterator[World]:  # noqa: ANN001
    settings.inference_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    projects = [project] + [make_project(settings) for _ in range(4)]
    with live_server(settings) as url:
        tenants = [Tenant(p["project_id"], p["name"], openai.OpenAI(base_url=f"{url}/v1", api_key=p["key"],
                                                                     max_retries=0)) for p in projects]
        try:
            yield World(owner=tenants[0], grantee=tenants[1], stranger=tenants[2], others=tenants[3:])
        finally:
            for tenant in tenants:
                tenant.sdk.close()


@contextmanager
def db(settings) -> Iterator[Session]:  # noqa: ANN001
    engine = make_engine(settings.resolved_database_url)
    try:
        with make_session_factory(engine).begin() as session:
            yield session
    finally:
        engine.dispose()


def create_job(tenant: Tenant, model: str) -> str:
    uploaded = tenant.sdk.files.create(file=("train.jsonl", io.BytesIO(jsonl(question_rows()))), purpose="fine-tune")
    job = tenant.sdk.fine_tuning.jobs.create(**job_body(uploaded.id, model=model))
    assert job.status == "validating_files" and job.model == model
    return job.id


def add_checkpoint(settings, job_id: str, step: int) -> tuple[str, str]:  # noqa: ANN001
    """A checkpoint of the job as a worker's push records it, named as the control plane names it;
    (its fine_tuned_model_checkpoint, its path)."""
    with db(settings) as session:
        job = session.scalar(select(Job).where(Job.id == job_id))
        name = f"{fine_tuned_model_name(session, job)}:ckpt-step-{step}"
        checkpoint = service.record_checkpoint(session=session, job=job, step_number=step, model_ref=name, metrics={})
        checkpoint.path = f"/checkpoints/{job_id}/step-{step}"
        return name, checkpoint.path


def checkpointed_job(settings, tenant: Tenant, model: str = BASE, step: int = 2) -> tuple[str, str, str]:  # noqa
    """A job of the tenant's with one checkpoint: (job id, checkpoint name, checkpoint path)."""
    job_id = create_job(tenant, model)
    return (job_id, *add_checkpoint(settings, job_id, step))


def resolved(settings, tenant: Tenant, name: str):  # noqa: ANN001, ANN201
    with db(settings) as session:
        return resolve(session=session, settings=settings, project_id=tenant.project_id, name=name)


def ask(tenant: Tenant, model: str):  # noqa: ANN201
    return tenant.sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}])


def test_share_list_page_and_revoke_with_the_sdk(world, settings):
    owner, shared_with = world.owner, [world.grantee, *world.others]
    _, name, _ = checkpointed_job(settings, owner)
    permissions = owner.sdk.fine_tuning.checkpoints.permissions

    created = permissions.create(name, project_ids=[t.project_id for t in shared_with])
    assert [p.project_id for p in created] == [t.project_id for t in shared_with]
    for permission in created.data:
        strict(PermissionCreateResponse, permission)
        assert permission.id.startswith("cp_") and permission.object == "checkpoint.permission"
    ids = [p.id for p in created.data]

    again = permissions.create(name, project_ids=[world.grantee.project_id, world.grantee.project_id])
    assert [p.id for p in again] == [ids[0]]  # the existing permission, no duplicate

    newest_first = list(reversed(ids))
    first = permissions.list(name, limit=2)
    assert [p.id for p in first.data] == newest_first[:2] and first.has_more is True
    assert first.last_id == newest_first[1]
    assert [p.id for p in permissions.list(name, limit=2, after=first.last_id).data] == newest_first[2:]
    assert [p.id for p in permissions.list(name, limit=1)] == newest_first  # the SDK follows has_more/last_id
    assert [p.id for p in permissions.list(name, order="ascending")] == ids
    for permission in permissions.list(name).data:
        strict(PermissionListResponse, permission)
    only = permissions.list(name, project_id=world.others[0].project_id)
    assert [(p.id, p.project_id) for p in only] == [(ids[1], world.others[0].project_id)]
    assert list(permissions.list(name, project_id=world.stranger.project_id)) == []
    with pytest.warns(DeprecationWarning):
        page = permissions.retrieve(name, limit=2, order="ascending")
    page = strict(PermissionRetrieveResponse, page)
    assert [p.id for p in page.data] == ids[:2] and page.has_more and page.first_id == ids[0] and page.object == "list"

    deleted = strict(PermissionDeleteResponse, permissions.delete(ids[0], fine_tuned_model_checkpoint=name))
    assert (deleted.id, deleted.deleted, deleted.object) == (ids[0], True, "checkpoint.permission")
    assert [p.id for p in permissions.list(name, order="ascending")] == ids[1:]
    with pytest.raises(openai.NotFoundError) as missing:
        permissions.delete(ids[0], fine_tuned_model_checkpoint=name)
    assert (missing.value.code, missing.value.param) == ("checkpoint_permission_not_found", "permission_id")
    regranted = permissions.create(name, project_ids=[world.grantee.project_id])
    assert regranted.data[0].id not in ids  # a new permission after a revocation


def test_only_the_owner_sees_grants_and_revokes(world, settings):
    owner = world.owner
    job_id, name, _ = checkpointed_job(settings, owner)
    _, other_name, _ = checkpointed_job(settings, owner, step=4)
    owners = owner.sdk.fine_tuning.checkpoints.permissions
    permission = owners.create(name, project_ids=[world.grantee.project_id]).data[0]

    for outsider in (world.grantee, world.stranger):  # the grantee too: it may use the checkpoint, not manage it
        permissions = outsider.sdk.fine_tuning.checkpoints.permissions
        calls = [lambda: permissions.list(name),
                 lambda: permissions.delete(permission.id, fine_tuned_model_checkpoint=name),
                 lambda: permissions.create(name, project_ids=[outsider.project_id])]
        for call in calls:
            with pytest.raises(openai.NotFoundError) as refused:
                call()
            assert (refused.value.code, refused.value.param) == ("model_not_found", "fine_tuned_model_checkpoint")
    assert [p.id for p in owners.list(name)] == [permission.id]  # nothing was deleted

    # The owner's permission id under another of its checkpoints is not that checkpoint's.
    with pytest.raises(openai.NotFoundError):
        owners.delete(permission.id, fine_tuned_model_checkpoint=other_name)
    with pytest.raises(openai.BadRequestError) as foreign_cursor:
        owners.list(other_name, after=permission.id)
    assert foreign_cursor.value.param == "after"
    # Only checkpoint names are shared: a job's model name, or a name that does not exist, is not found.
    with db(settings) as session:
        session.scalar(select(Job).where(Job.id == job_id)).fine_tuned_model = name.removesuffix(":ckpt-step-2")
    for unknown in (name.removesuffix(":ckpt-step-2"), f"ft:{BASE}:{owner.name}::ftjob-none:ckpt-step-1"):
        with pytest.raises(openai.NotFoundError):
            owners.create(unknown, project_ids=[world.grantee.project_id])


def test_the_grantee_serves_and_fine_tunes_from_a_shared_checkpoint_until_revoked(world, settings):
    owner, grantee, stranger = world.owner, world.grantee, world.stranger
    # A chain inside the owner's project: job B starts from job A's checkpoint; B's checkpoint is shared.
    _, first_name, _ = checkpointed_job(settings, owner)
    second_job, name, path = checkpointed_job(settings, owner, model=first_name, step=3)
    assert name == f"ft:{BASE}:{owner.name}::{second_job}:ckpt-step-3"
    permissions = owner.sdk.fine_tuning.checkpoints.permissions
    permission = permissions.create(name, project_ids=[grantee.project_id]).data[0]

    # Serving: the name resolves for the grantee to the owner's checkpoint on the base model at the
    # chain's root (followed in the owner's project: A's checkpoint is not shared).
    found = resolved(settings, grantee, name)
    assert (found.name, found.base, found.checkpoint_path) == (name, BASE, path)
    with pytest.raises(openai.InternalServerError) as forwarded:  # resolved, then forwarded: no server runs
        ask(grantee, name)
    assert forwarded.value.status_code == 503
    assert grantee.sdk.models.retrieve(name).owned_by == owner.project_id
    second_model = name.removesuffix(":ckpt-step-3")
    with db(settings) as session:  # job B's own model name, as its finish records it: never shared
        session.scalar(select(Job).where(Job.id == second_job)).fine_tuned_model = second_model
    assert resolved(settings, owner, second_model).checkpoint_path == path
    for name_not_shared in (first_name, second_model):
        with pytest.raises(openai.NotFoundError):
            ask(grantee, name_not_shared)
    with pytest.raises(openai.NotFoundError):
        ask(stranger, name)
    with pytest.raises(APIError) as unresolved:
        resolved(settings, stranger, name)
    assert unresolved.value.code == "model_not_found"

    # Fine-tuning: the grantee's job starts from the owner's checkpoint.
    grantee_job = create_job(grantee, name)
    with db(settings) as session:
        job = session.scalar(select(Job).where(Job.id == grantee_job))
        start = start_point(session, job)
        assert (start.checkpoint_path, start.base_model, start.training_mode) == (path, BASE, "lora")
        assert fine_tuned_model_name(session, job) == f"ft:{BASE}:{grantee.name}::{grantee_job}"
    with pytest.raises(openai.NotFoundError) as third:
        create_job(stranger, name)
    assert third.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        create_job(grantee, first_name)
    own_name, own_path = add_checkpoint(settings, grantee_job, 1)  # what the grantee's job trained
    assert own_name == f"ft:{BASE}:{grantee.name}::{grantee_job}:ckpt-step-1"

    # Revoked: the next request is refused.
    permissions.delete(permission.id, fine_tuned_model_checkpoint=name)
    with pytest.raises(openai.NotFoundError) as refused:
        create_job(grantee, name)
    assert refused.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        ask(grantee, name)
    with pytest.raises(openai.NotFoundError):
        grantee.sdk.models.retrieve(name)
    with db(settings) as session:  # a worker claiming the grantee's job now finds no weights to start from
        assert start_point(session, session.scalar(select(Job).where(Job.id == grantee_job))) is None
    # What the grantee trained is its own: still served, on the base model at the chain's root.
    assert resolved(settings, grantee, own_name) == ResolvedModel(
        name=own_name, base=BASE, checkpoint_path=own_path)
    with pytest.raises(openai.InternalServerError):  # resolved, then forwarded
        ask(grantee, own_name)


def test_a_shared_checkpoint_is_not_deletable_by_the_grantee(world, settings):
    _, name, _ = checkpointed_job(settings, world.owner)
    world.owner.sdk.fine_tuning.checkpoints.permissions.create(name, project_ids=[world.grantee.project_id])
    with pytest.raises(openai.PermissionDeniedError) as refused:
        world.grantee.sdk.models.delete(name)
    assert refused.value.code == "model_not_deletable"
    assert resolved(settings, world.grantee, name).name == name


def test_a_checkpoint_whose_base_model_has_a_slash(world, settings):
    """A Hub id as the base model puts a '/' in the name; the SDK sends it as %2F."""
    _, name, _ = checkpointed_job(settings, world.owner, model="HuggingFaceTB/SmolLM2-135M-Instruct")
    assert "/" in name
    permissions = world.owner.sdk.fine_tuning.checkpoints.permissions
    permission = permissions.create(name, project_ids=[world.grantee.project_id]).data[0]
    assert [p.id for p in permissions.list(name)] == [permission.id]
    assert permissions.delete(permission.id, fine_tuned_model_checkpoint=name).deleted is True


def test_bad_requests_name_the_parameter(world, settings):
    owner = world.owner
    _, name, _ = checkpointed_job(settings, owner)
    permissions = owner.sdk.fine_tuning.checkpoints.permissions
    bodies = [
        ({"project_ids": []}, "invalid_value", "project_ids"),
        ({}, "missing_required_parameter", "project_ids"),
        ({"project_ids": "proj_x"}, "invalid_value", "project_ids"),
        ({"project_ids": [7]}, "invalid_value", "project_ids[0]"),
        ({"project_ids": [""]}, "invalid_value", "project_ids[0]"),
        ({"project_ids": ["p" * 65]}, "invalid_value", "project_ids[0]"),
        ({"project_ids": [world.grantee.project_id] * (MAX_PERMISSION_PROJECTS + 1)}, "invalid_value", "project_ids"),
        ({"project_ids": [world.grantee.project_id], "role": "admin"}, "invalid_value", "role"),
        ({"project_ids": [world.grantee.project_id, "proj_nope"]}, "invalid_project", "project_ids"),
        ({"project_ids": [owner.project_id]}, "invalid_project", "project_ids"),
    ]
    url = f"/fine_tuning/checkpoints/{name}/permissions"
    for body, code, param in bodies:
        with pytest.raises(openai.BadRequestError) as bad:
            owner.sdk.post(url, body=body, cast_to=object)
        assert (bad.value.code, bad.value.param) == (code, param), body
    assert list(permissions.list(name)) == []  # a refused request shares with nobody

    queries = [({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"order": "sideways"}, "order"),
               ({"after": "cp_none"}, "after"), ({"project_id": "p" * 65}, "project_id")]
    for query, param in queries:
        with pytest.raises(openai.BadRequestError) as bad:
            permissions.list(name, **query)
        assert bad.value.param == param, query


# --- a revoked share during a job -------------------------------------------------------------------

class WorkerCalls:
    """The internal API as a worker calls it, with the worker token."""

    def __init__(self, tenant: Tenant, settings) -> None:  # noqa: ANN001
        base = str(tenant.sdk.base_url).removesuffix("/").removesuffix("/v1")
        self.http = httpx.Client(base_url=f"{base}/internal/v1", timeout=30,
                                 headers={"Authorization": f"Bearer {settings.worker_token.get_secret_value()}"})
        self.lease_id: str | None = None

    def claim(self, job_id: str) -> httpx.Response:
        answer = self.http.post(f"/jobs/{job_id}/claim", json={"worker_id": "gpu-1"})
        if answer.status_code == 200:
            self.lease_id = answer.json()["lease_id"]
        return answer

    def leased(self, method: str, url: str, /, **body: Any) -> httpx.Response:
        answer = self.http.request(method, url, json={"lease_id": self.lease_id, **body})
        assert answer.status_code == 200, answer.text
        return answer

    def train_then_stop_for_a_pause(self, tenant: Tenant, job_id: str, *, steps: int, total: int) -> None:
        """Claim, report `steps` of `total` steps (a checkpoint at the last one), save the state, then
        stop for a pause as a worker does."""
        wait_for(lambda: tenant.sdk.fine_tuning.jobs.retrieve(job_id).status == "queued")
        assert self.claim(job_id).status_code == 200
        for step in range(1, steps + 1):
            self.leased("PUT", f"/jobs/{job_id}/steps/{step}", metrics={"step": step, "total_steps": total,
                                                                         "scores": {"train_reward_mean": 0.5}})
        self.leased("PUT", f"/jobs/{job_id}/checkpoints/{steps}", path=f"/checkpoints/{job_id}/step-{steps}")
        self.leased("POST", f"/jobs/{job_id}/state", completed_steps=steps, resume_state=f"/ckpt/{job_id}/state")
        tenant.sdk.fine_tuning.jobs.pause(job_id)
        assert self.leased("POST", f"/jobs/{job_id}/heartbeat").json()["action"] == "pause"
        self.leased("POST", f"/jobs/{job_id}/finish", status="paused")


def test_a_job_whose_shared_base_is_revoked_fails_at_the_claim_unless_its_state_covers_every_step(world, settings):
    owner, grantee = world.owner, world.grantee
    _, name, _ = checkpointed_job(settings, owner)
    permissions = owner.sdk.fine_tuning.checkpoints.permissions
    permission = permissions.create(name, project_ids=[grantee.project_id]).data[0]
    halfway, finished = create_job(grantee, name), create_job(grantee, name)
    worker = WorkerCalls(grantee, settings)
    worker.train_then_stop_for_a_pause(grantee, halfway, steps=1, total=3)
    worker.train_then_stop_for_a_pause(grantee, finished, steps=2, total=2)  # stopped before reporting its end

    permissions.delete(permission.id, fine_tuned_model_checkpoint=name)
    for job_id in (halfway, finished):
        grantee.sdk.fine_tuning.jobs.resume(job_id)

    refused = worker.claim(halfway)  # before any work: the worker is told there is nothing to run
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "not_claimable"
    job = grantee.sdk.fine_tuning.jobs.retrieve(halfway)
    assert job.status == "failed" and job.fine_tuned_model is None
    assert (job.error.code, job.error.param) == ("base_model_revoked", "model")
    assert name in job.error.message and "no longer shares" in job.error.message
    assert "no longer shares" in refused.json()["error"]["message"]

    done = worker.claim(finished)
    assert done.status_code == 409 and "succeeded without a worker" in done.json()["error"]["message"]
    job = grantee.sdk.fine_tuning.jobs.retrieve(finished)
    assert job.status == "succeeded" and job.fine_tuned_model == f"ft:{BASE}:{grantee.name}::{finished}"
    results = grantee.sdk.files.content(job.result_files[0]).text.splitlines()
    assert [line.split(",")[0] for line in results[1:]] == ["1", "2"]
    events = [e.message for e in grantee.sdk.fine_tuning.jobs.list_events(finished, limit=50)]
    assert events[0] == "The job has successfully completed"
