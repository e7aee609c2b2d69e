"""Turns at the database (app/core/admission.py): past them a request waits, then is refused with
503 `server_busy` and `Retry-After`, which the `openai` SDK honours. The 200-request burst against the
whole stack is in tests/serving/test_chat_e2e.py."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from pydantic import ValidationError

from app.core.admission import DatabaseTurns
from app.core.config import Settings
from app.core.errors import APIError
from tests.conftest import live_server
from tests.webhook_helpers import receiver


def test_a_request_past_the_turns_waits_then_is_refused_with_retry_after():
    async def scenario() -> None:
        turns = DatabaseTurns(capacity=2, wait_s=0.2)
        first, second = await turns.take(), await turns.take()
        with pytest.raises(APIError) as refused:
            await turns.take()
        assert (refused.value.status_code, refused.value.code) == (503, "server_busy")
        assert refused.value.headers == {"Retry-After": "1"}
        waiting = asyncio.create_task(turns.take())
        await asyncio.sleep(0.05)
        first()
        first()  # giving a turn back twice gives back one turn
        third = await asyncio.wait_for(waiting, 1)
        with pytest.raises(APIError):
            await turns.take()
        second(), third()
        (await turns.take())()

    asyncio.run(scenario())


def test_one_turn_serves_a_burst_and_the_sdk_retries_the_refusals(settings, project):
    settings.api_db_requests, settings.api_queue_timeout_s = 1, 0.05
    with live_server(settings) as base:
        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {project['key']}"}) as http:
                return await asyncio.gather(*(http.get("/v1/models") for _ in range(60)))

        answers = asyncio.run(burst())
        statuses = {answer.status_code for answer in answers}
        assert statuses == {200, 503}, statuses
        busy = next(answer for answer in answers if answer.status_code == 503)
        assert busy.json()["error"]["code"] == "server_busy" and int(busy.headers["retry-after"]) >= 1
        scrape = httpx.get(f"{base}/metrics").text
        refusals = float(next(line.split()[1] for line in scrape.splitlines()
                              if line.startswith("agent_rft_api_busy_refusals_total ")))
        assert refusals >= sum(answer.status_code == 503 for answer in answers)
        with openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=8) as sdk, \
                ThreadPoolExecutor(8) as pool:
            listed = list(pool.map(lambda _: sdk.models.list().data, range(8)))  # refusals retried after Retry-After
        assert all(listed)


def test_more_database_requests_than_connections_is_refused_at_start():
    with pytest.raises(ValidationError, match="exceeds the connections"):
        Settings(_env_file=None, db_pool_size=5, db_max_overflow=5, api_db_requests=11)
    assert Settings(_env_file=None, db_pool_size=5, db_max_overflow=5).resolved_api_db_requests == 6


def test_a_request_waiting_on_a_slow_peer_gives_its_turn_back(settings, project):
    # One turn. A webhook test send waits on a receiver that holds its answer; meanwhile the API
    # serves other requests: the waiting request holds no turn and no connection.
    settings.api_db_requests, settings.api_queue_timeout_s = 1, 2.0
    settings.outbound_allowlist = ["127.0.0.1"]
    with receiver(block_first=True) as hook, live_server(settings) as base, \
            openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk:
        created = sdk.webhooks.create(name="slow", url=hook.url, event_types=["fine_tuning.job.succeeded"])
        hook.secret = created.signing_secret
        with ThreadPoolExecutor(1) as pool:
            sending = pool.submit(sdk.webhooks.test, created.id, event_type="fine_tuning.job.succeeded")
            assert hook.got_request.wait(10)
            assert [sdk.models.list().data for _ in range(5)]  # each within the 2 s a turn may be waited for
            hook.release.set()
            assert sending.result().status_code == 200
