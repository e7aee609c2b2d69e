"""The diagnostics API on the embedded default (SQLite and the embedded broker), worker routes
and rollout paging included."""

from fastapi.testclient import TestClient

from app.core.config import Settings
from app.core.migrations import upgrade
from app.main import create_app
from tests.conftest import Api, job_body, make_project, question_rows, wait_for
from tests.diagnostics.test_api import BASE, record
from tests.test_internal import Worker


def test_diagnostics_on_sqlite(tmp_path, monkeypatch):
    for var in ("AGENT_RFT_DATABASE_URL", "AGENT_RFT_BROKER_URL"):
        monkeypatch.delenv(var, raising=False)
    settings = Settings(_env_file=None, data_dir=tmp_path, outbound_allowlist=["127.0.0.1"])
    upgrade(settings.resolved_database_url)
    project = make_project(settings)
    with TestClient(create_app(settings)) as client:
        api = Api(client, project["key"])
        body = {**job_body(api.upload_ok(question_rows(2))), "runs_per_sample": 2}
        diag_id = api.post(BASE, json=body).json()["id"]
        wait_for(lambda: api.get(f"{BASE}/{diag_id}").json()["status"] == "queued")
        worker = Worker(client, settings.worker_token.get_secret_value())
        worker.lease_id = worker.call("POST", f"/diagnostics/{diag_id}/claim", {"worker_id": "w"}).json()["lease_id"]
        pushed = worker.leased("POST", f"/diagnostics/{diag_id}/rollouts", samples_total=2,
                               records=[record(0, 0, 0.0), record(0, 1, 1.0), record(1, 0, 1.0), record(1, 1, 1.0)])
        assert pushed.json() == {"stored": 4, "samples_done": 2, "rollouts_done": 4}
        assert worker.leased("POST", f"/diagnostics/{diag_id}/finish", status="succeeded").json()["status"] == "succeeded"
        done = api.get(f"{BASE}/{diag_id}").json()
        assert [s["signal"] for s in done["samples"]] == ["mixed", "always_1"]
        first = api.get(f"{BASE}/{diag_id}/rollouts", params={"limit": 3}).json()
        rest = api.get(f"{BASE}/{diag_id}/rollouts", params={"after": first["last_id"]}).json()
        assert [r["id"] for r in first["data"] + rest["data"]] == ["trace_0_0", "trace_0_1", "trace_1_0", "trace_1_1"]
