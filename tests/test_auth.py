"""API keys and project scoping."""

from tests.conftest import Api, job_body, make_project, question_rows


def _assert_error_shape(body: dict) -> dict:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_missing_and_wrong_keys_get_401(client):
    missing = client.get("/v1/files")
    assert missing.status_code == 401
    assert _assert_error_shape(missing.json())["code"] == "missing_api_key"
    for header in ("Bearer sk-not-a-real-key", "Bearer nonsense", "Basic dXNlcjpwYXNz", "Bearer"):
        wrong = client.get("/v1/fine_tuning/jobs", headers={"Authorization": header})
        assert wrong.status_code == 401, header
        assert _assert_error_shape(wrong.json())["code"] == "invalid_api_key"


def test_a_project_cannot_see_or_touch_another_projects_objects(client, settings, api):
    file_id = api.upload_ok(question_rows())
    job_id = api.post("/v1/fine_tuning/jobs", json=job_body(file_id)).json()["id"]

    other = Api(client, make_project(settings)["key"])
    for method, url in [
        ("GET", f"/v1/files/{file_id}"), ("GET", f"/v1/files/{file_id}/content"), ("DELETE", f"/v1/files/{file_id}"),
        ("GET", f"/v1/fine_tuning/jobs/{job_id}"), ("POST", f"/v1/fine_tuning/jobs/{job_id}/cancel"),
        ("POST", f"/v1/fine_tuning/jobs/{job_id}/pause"), ("GET", f"/v1/fine_tuning/jobs/{job_id}/events"),
        ("GET", f"/v1/fine_tuning/jobs/{job_id}/checkpoints"),
    ]:
        response = other.request(method, url)
        assert response.status_code == 404, (method, url, response.text)
        assert _assert_error_shape(response.json())["type"] == "invalid_request_error"
    assert other.get("/v1/files").json()["data"] == []
    assert other.get("/v1/fine_tuning/jobs").json()["data"] == []
    # Nor can it train on the other project's file.
    foreign = other.post("/v1/fine_tuning/jobs", json=job_body(file_id))
    assert foreign.status_code == 400 and foreign.json()["error"]["param"] == "training_file"
    # The owner still sees everything, untouched.
    assert api.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"] == "queued"


def test_every_key_of_a_project_sees_the_same_objects(client, settings, project):
    from app.auth.service import create_key
    from app.core.db import make_engine, make_session_factory

    engine = make_engine(settings.resolved_database_url)
    with make_session_factory(engine).begin() as session:
        second = create_key(session=session, project_name=project["name"]).secret
    engine.dispose()
    file_id = Api(client, project["key"]).upload_ok(question_rows())
    assert Api(client, second).get(f"/v1/files/{file_id}").status_code == 200


def test_unknown_route_answers_in_openai_error_shape(api):
    response = api.get("/v1/nothing-here")
    assert response.status_code == 404
    _assert_error_shape(response.json())
