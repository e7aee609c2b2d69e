"""One smoke path on the embedded default: SQLite and the embedded broker, no servers."""

import sqlite3

from fastapi.testclient import TestClient

from app.core.config import Settings
from app.core.migrations import upgrade
from app.main import create_app
from tests.conftest import Api, job_body, make_project, question_rows, wait_for


def test_embedded_default_end_to_end(tmp_path, monkeypatch):
    for var in ("AGENT_RFT_DATABASE_URL", "AGENT_RFT_BROKER_URL"):
        monkeypatch.delenv(var, raising=False)
    settings = Settings(_env_file=None, data_dir=tmp_path, outbound_allowlist=["127.0.0.1"])
    assert settings.resolved_database_url.startswith("sqlite:///")
    upgrade(settings.resolved_database_url)
    project = make_project(settings)
    with TestClient(create_app(settings)) as client:
        api = Api(client, project["key"])
        file_id = api.upload_ok(question_rows(3))
        job_id = api.post("/v1/fine_tuning/jobs", json=job_body(file_id, metadata={"where": "sqlite"})).json()["id"]
        wait_for(lambda: api.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"] == "queued")
        assert [j["id"] for j in api.get("/v1/fine_tuning/jobs", params={"metadata[where]": "sqlite"}).json()["data"]] == [job_id]
        assert api.post(f"/v1/fine_tuning/jobs/{job_id}/pause").json()["status"] == "paused"
        assert api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").json()["status"] == "cancelled"
        messages = [e["message"] for e in api.get(f"/v1/fine_tuning/jobs/{job_id}/events").json()["data"]]
        assert "Job sent to the training queue." in messages
    # The task message sits in the embedded broker's SQLite file, carrying the job id.
    with sqlite3.connect(tmp_path / "broker.sqlite3") as broker:
        payloads = [row[0] for row in broker.execute("SELECT payload FROM kombu_message")]
    assert any(job_id in p for p in payloads)
