"""The dashboard on the embedded default (SQLite): the same pages, filters and chart data."""

from __future__ import annotations

from fastapi.testclient import TestClient

from app.core.config import Settings
from app.core.migrations import upgrade
from app.main import create_app
from tests.conftest import Api, job_body, make_project, question_rows, wait_for
from tests.dashboard.helpers import login, report_steps
from tests.test_internal import Worker


def test_dashboard_on_sqlite(tmp_path, monkeypatch):
    for var in ("AGENT_RFT_DATABASE_URL", "AGENT_RFT_BROKER_URL"):
        monkeypatch.delenv(var, raising=False)
    settings = Settings(_env_file=None, data_dir=tmp_path, outbound_allowlist=["127.0.0.1"], watchdog_interval_s=3600)
    upgrade(settings.resolved_database_url)
    project = make_project(settings)
    with TestClient(create_app(settings)) as client:
        api = Api(client, project["key"])
        job_id = api.post("/v1/fine_tuning/jobs", json=job_body(api.upload_ok(question_rows(3)))).json()["id"]
        wait_for(lambda: api.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"] == "queued")
        worker = Worker(client, settings.worker_token.get_secret_value())
        assert worker.claim(job_id).status_code == 200
        report_steps(worker, job_id, range(1, 4), total=3)
        login(client, project["key"])
        assert "3 / 3" in client.get("/dashboard/jobs").text
        series = client.get(f"/dashboard/jobs/{job_id}/data?after_step=1").json()["series"]
        assert series["scores.train_reward_mean"]["x"] == [2, 3]
        page = client.get(f"/dashboard/jobs/{job_id}/rollouts", params={"tool": "cat", "step": "3"}).text
        assert "trace_s3_r0" in page and "trace_s3_r3" in page and "trace_s3_r1" not in page
        assert client.get(f"/dashboard/jobs/{job_id}/rollouts/trace_s3_r0").status_code == 200
