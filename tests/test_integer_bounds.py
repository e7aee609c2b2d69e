"""Query numbers beyond what an INTEGER column holds: a clear 400 naming the
parameter, never PostgreSQL's "integer out of range" as a 500; at the bound they still work."""

from __future__ import annotations

import pytest

from app.core.deps import INT32_MAX
from tests.conftest import job_body, question_rows

DIAGNOSTICS = "/v1/fine_tuning/alpha/diagnostics"


@pytest.fixture
def ids(api) -> dict[str, str]:  # noqa: ANN001
    file_id = api.upload_ok(question_rows(3))
    job = api.post("/v1/fine_tuning/jobs", json=job_body(file_id))
    diagnostic = api.post(DIAGNOSTICS, json=job_body(file_id))
    assert job.status_code == 200 and diagnostic.status_code == 200, (job.text, diagnostic.text)
    return {"job": job.json()["id"], "diagnostic": diagnostic.json()["id"]}


@pytest.mark.parametrize(("path", "param"), [
    ("/v1/fine_tuning/jobs/{job}/rollouts?step={n}", "step"),
    (DIAGNOSTICS + "/{diagnostic}/rollouts?sample_index={n}", "sample_index"),
])
def test_numbers_beyond_an_integer_column_are_refused_by_name(api, ids, path, param):  # noqa: ANN001
    for number in (INT32_MAX + 1, 99_999_999_999, 10**30):
        response = api.get(path.format(n=number, **ids))
        assert response.status_code == 400, (number, response.text)
        assert response.json()["error"]["param"] == param
    at_bound = api.get(path.format(n=INT32_MAX, **ids))
    assert at_bound.status_code == 200 and at_bound.json()["data"] == []
