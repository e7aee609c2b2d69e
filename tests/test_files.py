"""/v1/files: upload, list, retrieve, content, delete, limits, idempotency."""

import hashlib

from app.files.storage import CHUNK
from tests.conftest import Api, job_body, jsonl, question_rows


def test_upload_retrieve_content_roundtrip(api, settings):
    content = jsonl(question_rows(5))
    response = api.upload(content, filename="train.jsonl")
    assert response.status_code == 200
    file = response.json()
    assert file["id"].startswith("file-") and file["object"] == "file"
    assert file["bytes"] == len(content) and file["filename"] == "train.jsonl"
    assert file["purpose"] == "fine-tune" and file["status"] == "processed"
    assert isinstance(file["created_at"], int)

    assert api.get(f"/v1/files/{file['id']}").json() == file
    downloaded = api.get(f"/v1/files/{file['id']}/content")
    assert downloaded.status_code == 200 and downloaded.content == content
    # Stored on disk under the storage directory, byte for byte.
    stored = [p for p in settings.resolved_storage_dir.rglob("*") if p.is_file()]
    assert [hashlib.sha256(p.read_bytes()).hexdigest() for p in stored] == [hashlib.sha256(content).hexdigest()]


def test_large_upload_streams_in_chunks(api):
    row = jsonl(question_rows(1))
    content = row * (3 * CHUNK // len(row) + 1)  # > 3 MiB: spans several storage chunks
    file_id = api.upload_ok(content)
    assert api.get(f"/v1/files/{file_id}").json()["bytes"] == len(content)
    assert api.get(f"/v1/files/{file_id}/content").content == content


def test_purpose_other_than_fine_tune_is_rejected(api):
    for purpose in ("assistants", "batch", "whatever"):
        response = api.upload(question_rows(), purpose=purpose)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "purpose"
    missing = api.post("/v1/files", files={"file": ("a.jsonl", b"{}")})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "purpose"
    no_file = api.post("/v1/files", data={"purpose": "fine-tune"})
    assert no_file.status_code == 400 and no_file.json()["error"]["param"] == "file"
    assert api.get("/v1/files").json()["data"] == []


def test_size_limit_answers_413_and_keeps_nothing(client, app, project):
    app.state.settings.max_upload_bytes = 1000
    api = Api(client, project["key"])
    response = api.upload(b"x" * 1001)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "file_too_large"
    # Declared length far over the limit: refused before the body is read.
    big = api.upload(b"x" * 200_000)
    assert big.status_code == 413
    assert api.get("/v1/files").json()["data"] == []
    storage = app.state.settings.resolved_storage_dir
    assert not [p for p in storage.rglob("*") if p.is_file()]
    assert api.upload(b"x" * 1000).status_code == 200


def test_list_is_paginated_newest_first(api):
    ids = [api.upload_ok(question_rows(1), filename=f"f{i}.jsonl") for i in range(5)]
    first = api.get("/v1/files", params={"limit": 2}).json()
    assert [f["id"] for f in first["data"]] == ids[::-1][:2] and first["has_more"] is True
    assert first["first_id"] == ids[4] and first["last_id"] == ids[3]
    second = api.get("/v1/files", params={"limit": 2, "after": first["last_id"]}).json()
    assert [f["id"] for f in second["data"]] == ids[::-1][2:4]
    last = api.get("/v1/files", params={"limit": 2, "after": second["last_id"]}).json()
    assert [f["id"] for f in last["data"]] == ids[:1] and last["has_more"] is False
    ascending = api.get("/v1/files", params={"order": "asc"}).json()
    assert [f["id"] for f in ascending["data"]] == ids
    assert api.get("/v1/files", params={"limit": 0}).status_code == 400
    assert api.get("/v1/files", params={"after": "file-nope"}).json()["error"]["param"] == "after"


def test_delete_removes_row_and_bytes(api, settings):
    file_id = api.upload_ok(question_rows())
    deleted = api.delete(f"/v1/files/{file_id}")
    assert deleted.json() == {"id": file_id, "object": "file", "deleted": True}
    assert api.get(f"/v1/files/{file_id}").status_code == 404
    assert api.delete(f"/v1/files/{file_id}").status_code == 404
    assert not [p for p in settings.resolved_storage_dir.rglob("*") if p.is_file()]


def test_file_of_an_unfinished_job_cannot_be_deleted(api):
    file_id = api.upload_ok(question_rows())
    job_id = api.post("/v1/fine_tuning/jobs", json=job_body(file_id)).json()["id"]
    refused = api.delete(f"/v1/files/{file_id}")
    assert refused.status_code == 409 and job_id in refused.json()["error"]["message"]
    api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")
    assert api.delete(f"/v1/files/{file_id}").status_code == 200


def test_idempotent_upload(api):
    content = jsonl(question_rows())
    first = api.upload(content, headers={"Idempotency-Key": "upload-1"})
    again = api.upload(content, headers={"Idempotency-Key": "upload-1"})
    assert again.status_code == 200 and again.json() == first.json()
    other = api.upload(content + b"\n", headers={"Idempotency-Key": "upload-1"})
    assert other.status_code == 409 and other.json()["error"]["code"] == "idempotency_key_reused"
    assert len(api.get("/v1/files").json()["data"]) == 1
