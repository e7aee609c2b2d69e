"""score_model, label_model and endpoint graders, batch grading, and /alpha/graders/run|validate,
against real HTTP servers on 127.0.0.1: a chat-completions judge and a customer grader whose
answers each test scripts, and the real app driven by the official `openai` SDK."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import TypeAdapter

from agent_rft.graders.batch import grade_many
from agent_rft.graders.core import GradeResult, GraderContext, Sample, grade
from agent_rft.graders.judges import close_http_client
from agent_rft.graders.schemas import Grader
from app.main import create_app
from tests.conftest import free_port, serve_app

GRADER = TypeAdapter(Grader)
JUDGE_KEY = "judge-secret-key"


# --- real servers on 127.0.0.1 ----------------------------------------------------------------


@contextmanager
def serve(app: Any) -> Iterator[str]:
    """Any ASGI app under uvicorn in a thread; yields its base URL."""
    with serve_app(app) as port:
        yield f"http://127.0.0.1:{port}"


class Scripted:
    """A server that records every POST and answers what the test scripted, in order.

    An answer is (status, body) where body is a dict (sent as JSON) or text, or (status, body,
    headers); once the script is used up, `default` answers. `delay_s` is waited before answering."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.script: deque[tuple[int, Any]] = deque()
        self.default: tuple[int, Any] = (500, {"error": "nothing scripted"})
        self.delay_s = 0.0
        self.in_flight = self.max_in_flight = 0  # requests being answered at once
        self.lock = threading.Lock()
        self.app = FastAPI()
        self.app.add_api_route("/{path:path}", self._answer, methods=["POST"])

    def reset(self, *answers: tuple[int, Any], default: tuple[int, Any] | None = None, delay_s: float = 0.0) -> None:
        with self.lock:
            self.requests.clear()
            self.script = deque(answers)
            self.default = default or (500, {"error": "nothing scripted"})
            self.delay_s = delay_s
            self.in_flight = self.max_in_flight = 0

    async def _answer(self, path: str, request: Request):  # noqa: ANN202
        arrived = time.monotonic()
        body = await request.body()
        with self.lock:
            status, answer, *extra = self.script.popleft() if self.script else self.default
            self.requests.append({"path": "/" + path, "headers": dict(request.headers), "body": body, "at": arrived})
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
        finally:
            with self.lock:
                self.in_flight -= 1
        headers = extra[0] if extra else None
        if isinstance(answer, str):
            return PlainTextResponse(answer, status_code=status, headers=headers)
        return JSONResponse(answer, status_code=status, headers=headers)

    def json_bodies(self) -> list[Any]:
        return [json.loads(r["body"]) for r in self.requests]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[Scripted, str]]:
    scripted = Scripted()
    with serve(scripted.app) as base_url:
        yield scripted, base_url


@pytest.fixture
def judge(server) -> tuple[Scripted, str]:  # noqa: ANN001
    scripted, base_url = server
    scripted.reset()
    return scripted, base_url


def completion(content: str | None, *, model: str = "judge-model-1", finish_reason: str = "stop",
               refusal: str | None = None, usage: tuple[int, int] = (120, 30)) -> tuple[int, dict[str, Any]]:
    return 200, {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": model,
        "choices": [{"index": 0, "finish_reason": finish_reason,
                     "message": {"role": "assistant", "content": content, "refusal": refusal}}],
        "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)},
    }


def context(base_url: str | None = None, **overrides: Any) -> GraderContext:
    values: dict[str, Any] = {"outbound_allowlist": ["127.0.0.1"], "request_timeout_s": 5.0}
    if base_url:
        values.update(judge_base_url=f"{base_url}/v1", judge_api_key=JUDGE_KEY)
    values.update(overrides)
    return GraderContext(**values)


ITEM = {"question": "Revenue in 2023?", "reference": "412.5"}


def run_grade(config: dict[str, Any], model_sample: Any, item: dict[str, Any] | None = None,
              ctx: GraderContext | None = None, trace_id: str | None = None) -> GradeResult:
    async def go() -> GradeResult:
        try:
            return await grade(GRADER.validate_python(config), Sample.from_model_sample(model_sample),
                               ITEM if item is None else item, ctx, trace_id)
        finally:
            await close_http_client(ctx)

    return asyncio.run(go())


def set_flags(result: GradeResult) -> list[str]:
    return sorted(k for k, v in result.to_run_response()["metadata"]["errors"].items() if v is True)


SCORE_GRADER = {
    "type": "score_model", "name": "quality", "model": "judge-model-1",
    "input": [
        {"role": "system", "content": "You grade answers to finance questions."},
        {"role": "user", "content": [
            {"type": "input_text", "text": "Question: {{item.question}}"},
            {"type": "input_text", "text": "Answer: {{sample.output_text}}"},
        ]},
    ],
    "sampling_params": {"temperature": 0.2, "top_p": 0.9, "seed": 7, "max_completions_tokens": 300},
}


def score_grader(**overrides: Any) -> dict[str, Any]:
    return {**SCORE_GRADER, **overrides}


LABEL_GRADER = {
    "type": "label_model", "name": "verdict", "model": "judge-model-1",
    "input": [{"role": "developer", "content": "Label the answer."},
              {"role": "user", "content": "{{sample.output_text}} (expected {{item.reference}})"}],
    "labels": ["correct", "partially_correct", "incorrect"], "passing_labels": ["correct"],
}


# --- score_model ------------------------------------------------------------------------------


def test_score_model_sends_the_rendered_prompt_and_reports_usage(judge):
    scripted, base_url = judge
    scripted.reset(completion('{"steps": [{"description": "checked", "conclusion": "right"}], "result": 0.8}'))

    result = run_grade(score_grader(), "Revenue was 412.5", {"question": "Revenue in 2023?"}, context(base_url))

    assert result.reward == pytest.approx(0.8) and set_flags(result) == []
    request = scripted.requests[0]
    assert request["path"] == "/v1/chat/completions"
    assert request["headers"]["authorization"] == f"Bearer {JUDGE_KEY}"
    sent = scripted.json_bodies()[0]
    assert sent["model"] == "judge-model-1"
    assert (sent["temperature"], sent["top_p"], sent["seed"], sent["max_completion_tokens"]) == (0.2, 0.9, 7, 300)
    system, user = sent["messages"]
    assert system["role"] == "system" and system["content"].startswith("You grade answers to finance questions.")
    assert '"result"' in system["content"] and "from 0 to 1" in system["content"]
    assert user == {"role": "user", "content": "Question: Revenue in 2023?\nAnswer: Revenue was 412.5"}
    assert result.token_usage == 150 and result.sampled_model_name == "judge-model-1"
    assert result.model_token_usage == {"judge-model-1": {"prompt_tokens": 120, "completion_tokens": 30, "total_tokens": 150}}
    assert result.scores["steps"] == [{"description": "checked", "conclusion": "right"}]


def test_score_model_clamps_to_the_range(judge):
    scripted, base_url = judge
    scripted.reset(completion('{"result": 7}'), completion('{"result": -2}'), completion('{"result": 3.5}'))
    ctx = context(base_url)
    assert run_grade(score_grader(range=[0, 5]), "x", ctx=ctx).reward == 5
    assert run_grade(score_grader(), "x", ctx=ctx).reward == 0
    clamped = run_grade(score_grader(range=[1, 10], pass_threshold=3), "x", ctx=ctx)
    assert clamped.reward == 3.5 and clamped.passed is True
    assert "from 1 to 10" in scripted.json_bodies()[2]["messages"][0]["content"]


def test_score_model_reads_json_in_code_fences_or_prose(judge):
    scripted, base_url = judge
    scripted.reset(
        completion('Here is my grade:\n```json\n{"steps": [], "result": 0.25}\n```\nHope it helps.'),
        completion('I checked the numbers. {"result": 0.6, "steps": [{"description": "a", "conclusion": "b"}]} Done.'),
    )
    ctx = context(base_url)
    assert run_grade(score_grader(), "x", ctx=ctx).reward == pytest.approx(0.25)
    assert run_grade(score_grader(), "x", ctx=ctx).reward == pytest.approx(0.6)


def test_score_model_unparseable_answer_is_a_parse_error(judge):
    scripted, base_url = judge
    scripted.reset(completion("I think the answer is quite good."), completion('{"result": "great"}'))
    ctx = context(base_url)
    for _ in range(2):
        result = run_grade(score_grader(), "x", ctx=ctx)
        assert set_flags(result) == ["model_grader_parse_error"] and result.reward == 0
        assert "judge replied" in result.errors["details"]
        assert result.token_usage == 150  # the judge's tokens were spent all the same


def test_score_model_refusals(judge):
    scripted, base_url = judge
    scripted.reset(completion(None, refusal="I can't help with grading that."),
                   completion("", finish_reason="content_filter"))
    ctx = context(base_url)
    refused = run_grade(score_grader(), "x", ctx=ctx)
    assert set_flags(refused) == ["model_grader_refusal_error"] and refused.reward == 0
    assert "can't help" in refused.errors["details"]
    assert set_flags(run_grade(score_grader(), "x", ctx=ctx)) == ["model_grader_refusal_error"]


def test_judge_500_is_retried(judge):
    scripted, base_url = judge
    scripted.reset((500, {"error": "overloaded"}), completion('{"result": 1}'))
    result = run_grade(score_grader(), "x", ctx=context(base_url))
    assert result.reward == 1 and set_flags(result) == []
    assert len(scripted.requests) == 2


def test_judge_that_keeps_failing_is_a_server_error(judge):
    scripted, base_url = judge
    scripted.reset(default=(503, {"error": "down for maintenance"}))
    result = run_grade(score_grader(), "x", ctx=context(base_url))
    assert set_flags(result) == ["model_grader_server_error"] and result.reward == 0
    response = result.to_run_response()["metadata"]["errors"]
    assert "503" in response["model_grader_server_error_details"]
    assert "down for maintenance" in response["model_grader_server_error_details"]
    assert len(scripted.requests) == 3


def test_judge_4xx_and_unreachable_judge_are_server_errors(judge):
    scripted, base_url = judge
    scripted.reset((404, {"error": {"message": "model 'judge-model-1' not found"}}))
    not_found = run_grade(score_grader(), "x", ctx=context(base_url))
    assert set_flags(not_found) == ["model_grader_server_error"] and "404" in not_found.errors["details"]
    assert len(scripted.requests) == 1  # a 4xx is not retried

    closed_port = f"http://127.0.0.1:{free_port()}"
    unreachable = run_grade(score_grader(), "x", ctx=context(closed_port))
    assert set_flags(unreachable) == ["model_grader_server_error"] and "cannot reach" in unreachable.errors["details"]


def test_no_judge_configured_names_the_settings():
    result = run_grade(score_grader(), "x", ctx=context())
    assert set_flags(result) == ["model_grader_server_error"]
    assert "AGENT_RFT_JUDGE_BASE_URL" in result.errors["details"]
    assert "AGENT_RFT_JUDGE_LOCAL_MODEL" in result.errors["details"]


def test_missing_template_variable_is_flagged_before_calling_the_judge(judge):
    scripted, base_url = judge
    result = run_grade(score_grader(), "x", {}, context(base_url))  # no item.question
    assert set_flags(result) == ["invalid_variable_error"] and scripted.requests == []


# --- label_model ------------------------------------------------------------------------------


def test_label_model_pass_fail_and_unknown_label(judge):
    scripted, base_url = judge
    scripted.reset(
        completion('{"result": "correct"}'),
        completion('```json\n{"result": "partially_correct"}\n```'),
        completion("Incorrect."),
        completion('{"result": "excellent"}'),
    )
    ctx = context(base_url)
    item = {"reference": "412.5"}
    passed = run_grade(LABEL_GRADER, "412.5", item, ctx)
    assert (passed.reward, passed.passed, set_flags(passed)) == (1.0, True, [])
    assert passed.scores == {"label": "correct"}
    partial = run_grade(LABEL_GRADER, "about 400", item, ctx)
    assert (partial.reward, partial.passed, set_flags(partial)) == (0.0, False, [])
    plain = run_grade(LABEL_GRADER, "9", item, ctx)
    assert (plain.reward, plain.scores) == (0.0, {"label": "incorrect"})
    unknown = run_grade(LABEL_GRADER, "412.5", item, ctx)
    assert set_flags(unknown) == ["model_grader_parse_error"] and "excellent" in unknown.errors["details"]

    system, user = scripted.json_bodies()[0]["messages"]
    assert system["role"] == "system" and system["content"].startswith("Label the answer.")
    assert '"correct", "partially_correct", "incorrect"' in system["content"]
    assert user["content"] == "412.5 (expected 412.5)"


# --- endpoint ---------------------------------------------------------------------------------


def endpoint_grader(base_url: str, **overrides: Any) -> dict[str, Any]:
    return {"type": "endpoint", "name": "checker", "url": f"{base_url}/grade",
            "headers": {"Authorization": "Bearer grader-token-123"}, **overrides}


STRUCTURED_SAMPLE = {
    "output_text": "412.5",
    "output_tools": [{"type": "function", "function": {"name": "search", "arguments": "{}"}}],
    "trajectory": [{"role": "user", "content": "Revenue?"}, {"role": "assistant", "content": "412.5"}],
    "usage": {"total_tokens": 42},
}


def test_endpoint_receives_sample_item_trace_id_and_headers(judge):
    scripted, base_url = judge
    scripted.reset((200, {"score": 0.75}), (200, {"reward": 0.25}))
    ctx = context()
    result = run_grade(endpoint_grader(base_url, pass_threshold=0.5), STRUCTURED_SAMPLE,
                       {"reference_answer": "412.5"}, ctx, trace_id="trace_abc")
    assert (result.reward, result.passed, set_flags(result)) == (0.75, True, [])
    assert scripted.requests[0]["path"] == "/grade"
    assert scripted.requests[0]["headers"]["authorization"] == "Bearer grader-token-123"
    sent = scripted.json_bodies()[0]
    assert sent == {
        "sample": {"output_text": "412.5", "output_json": None, "choices": [],
                   "output_tools": STRUCTURED_SAMPLE["output_tools"], "trajectory": STRUCTURED_SAMPLE["trajectory"],
                   "usage": {"total_tokens": 42}},
        "item": {"reference_answer": "412.5"},
        "trace_id": "trace_abc",
    }
    below = run_grade(endpoint_grader(base_url, pass_threshold=0.5), "x", ctx=ctx)
    assert (below.reward, below.passed) == (0.25, False)
    assert scripted.json_bodies()[1]["trace_id"].startswith("trace_")  # one is made up when none is given


def test_endpoint_and_judge_requests_carry_the_rollouts_traceparent(judge):
    """Every attempt carries `traceparent: 00-<the trace id of the body's trace_id>-<new span>-01`."""
    import re

    from agent_rft.tracing import w3c_trace_id

    scripted, base_url = judge
    trace_id = "trace_" + "ab12" * 8
    scripted.reset((503, "busy"), (200, {"score": 1.0}))
    run_grade(endpoint_grader(base_url), "412.5", ctx=context(), trace_id=trace_id)
    first, second = (r["headers"]["traceparent"] for r in scripted.requests)
    for header in (first, second):
        assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-01", header)
        assert header.split("-")[1] == w3c_trace_id(trace_id) == "ab12" * 8
    assert first.split("-")[2] != second.split("-")[2]  # each attempt is its own span

    scripted.reset(completion('{"steps": [], "result": 0.5}'))
    run_grade(score_grader(), "412.5", ctx=context(base_url), trace_id=trace_id)
    assert scripted.requests[0]["headers"]["traceparent"].split("-")[1] == "ab12" * 8


def test_endpoint_5xx_is_retried_until_it_answers(judge):
    scripted, base_url = judge
    scripted.reset((503, "busy"), (503, "busy"), (200, {"score": 1.0}))
    result = run_grade(endpoint_grader(base_url), "x", ctx=context())
    assert result.reward == 1.0 and set_flags(result) == []
    assert len(scripted.requests) == 3
    assert len({r["body"] for r in scripted.requests}) == 1  # a retry repeats the same request


def test_endpoint_that_keeps_failing_is_unresponsive(judge):
    scripted, base_url = judge
    scripted.reset(default=(500, "Internal Server Error"))
    result = run_grade(endpoint_grader(base_url), "x", ctx=context())
    assert set_flags(result) == ["unresponsive_reward_error"] and result.reward == 0
    assert "500" in result.errors["details"] and "4 attempts" in result.errors["details"]
    assert len(scripted.requests) == 4  # the first try and 3 retries



def test_endpoint_408_and_429_are_retried_but_other_4xx_are_final(judge):
    scripted, base_url = judge
    scripted.reset((429, "slow down"), (408, "request timeout"), (200, {"score": 0.5}))
    result = run_grade(endpoint_grader(base_url), "x", ctx=context())
    assert result.reward == 0.5 and set_flags(result) == []
    assert len(scripted.requests) == 3

    scripted.reset((409, "conflict"), (200, {"score": 1.0}))
    conflict = run_grade(endpoint_grader(base_url), "x", ctx=context())
    assert set_flags(conflict) == ["other_error"] and "409" in conflict.errors["details"]
    assert len(scripted.requests) == 1


def test_judge_429_is_retried(judge):
    scripted, base_url = judge
    scripted.reset((429, {"error": "rate limited"}), completion('{"result": 1}'))
    result = run_grade(score_grader(), "x", ctx=context(base_url))
    assert result.reward == 1 and set_flags(result) == []
    assert len(scripted.requests) == 2

def test_endpoint_429_with_retry_after_waits_as_asked_without_spending_attempts(judge):
    scripted, base_url = judge
    scripted.reset((429, "slow down", {"Retry-After": "1"}), (200, {"score": 1.0}))
    started = time.monotonic()
    result = run_grade(endpoint_grader(base_url), "x", ctx=context())
    assert result.reward == 1.0 and set_flags(result) == []
    gap = scripted.requests[1]["at"] - scripted.requests[0]["at"]
    assert 0.95 <= gap < 3 and time.monotonic() - started < 5  # the asked second, not a backoff

    # More throttled answers than the endpoint grader's 4 attempts: none of them spends one.
    # Each Retry-After (an hour) is cut to the context's cap.
    scripted.reset(*[(429, "slow down", {"Retry-After": "3600"})] * 5, (503, "busy", {"Retry-After": "3600"}),
                   (200, {"score": 0.5}))
    started = time.monotonic()
    result = run_grade(endpoint_grader(base_url), "x", ctx=context(max_retry_after_s=0.2))
    assert result.reward == 0.5 and set_flags(result) == []
    assert len(scripted.requests) == 7 and 1.1 <= time.monotonic() - started < 5


def test_judge_503_with_an_http_date_retry_after_is_waited_out(judge):
    from email.utils import formatdate

    scripted, base_url = judge
    scripted.reset((503, {"error": "overloaded"}, {"Retry-After": formatdate(time.time() + 2, usegmt=True)}),
                   completion('{"result": 1}'))
    result = run_grade(score_grader(), "x", ctx=context(base_url))
    assert result.reward == 1 and set_flags(result) == []
    gap = scripted.requests[1]["at"] - scripted.requests[0]["at"]
    assert 0.9 <= gap < 3.5  # the date's second, whole seconds only


def test_graders_that_throttle_get_fewer_requests_at_once(judge):
    """The URL's AIMD limit: a burst of 20 gradings, 8 at once, meets twelve 429s; the limit halves
    (once per round of requests) and has not grown back to 8 by the end; every grading succeeds."""
    from agent_rft.graders.judges import backpressure_stats

    scripted, base_url = judge
    scripted.reset(*[(429, "busy", {"Retry-After": "0"})] * 12, default=(200, {"score": 1}), delay_s=0.05)
    config = GRADER.validate_python(endpoint_grader(base_url))
    ctx = context(max_concurrency_per_url=8)

    async def twenty_at_once() -> tuple[list[GradeResult], dict[str, Any]]:
        try:
            results = await asyncio.gather(*(grade(config, Sample(output_text=str(i)), {}, ctx) for i in range(20)))
            return results, backpressure_stats(ctx)
        finally:
            await close_http_client(ctx)

    results, stats = asyncio.run(twenty_at_once())
    assert all(r.reward == 1 for r in results)
    (url_stats,) = stats.values()
    assert url_stats["throttled"] == 12 and url_stats["max_concurrency"] == 8
    assert scripted.max_in_flight == 8 and url_stats["concurrency"] < 8  # halved, not yet grown back


def test_a_steps_grader_load_counts_the_throttled_answers_of_that_step_only(judge):
    """The trainer's `graders` step metrics: throttled answers and waits between two snapshots
    (one step's grading), the URL's concurrency limit as it stands."""
    from workers.methods.reinforcement.step_report import GraderLoad

    scripted, base_url = judge
    config = GRADER.validate_python(endpoint_grader(base_url))
    ctx = context(max_concurrency_per_url=8)

    async def two_steps() -> list[dict[str, Any]]:
        try:
            loads = []
            for throttled in (3, 0):
                scripted.reset(*[(429, "busy", {"Retry-After": "0"})] * throttled, default=(200, {"score": 1}))
                before = GraderLoad.of(ctx)
                await asyncio.gather(*(grade(config, Sample(output_text=str(i)), {}, ctx) for i in range(4)))
                loads.append(GraderLoad.of(ctx).since(before))
            return loads
        finally:
            await close_http_client(ctx)

    first, second = asyncio.run(two_steps())
    assert first["throttled"] == 3 and second["throttled"] == 0 and second["throttle_wait_s"] == 0
    assert 1 <= first["concurrency"] <= 8


def test_a_grading_cancelled_mid_wait_counts_the_wait_as_far_as_it_went(judge):
    """The endpoint answers 429 Retry-After: 1 and the grading is cancelled 0.4 s into that wait
    (a deadline around it): the URL's account holds the throttled answer and the 0.4 s waited,
    not the second it asked for."""
    from agent_rft.graders.judges import backpressure_stats

    scripted, base_url = judge
    scripted.reset(default=(429, "busy", {"Retry-After": "1"}))
    config = GRADER.validate_python(endpoint_grader(base_url))
    ctx = context()

    async def cancelled_mid_wait() -> dict[str, Any]:
        try:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.4):
                    await grade(config, Sample(output_text="x"), {}, ctx)
            return backpressure_stats(ctx)
        finally:
            await close_http_client(ctx)

    (url_stats,) = asyncio.run(cancelled_mid_wait()).values()
    assert len(scripted.requests) == 1 and url_stats["throttled"] == 1
    assert 0.2 <= url_stats["throttle_wait_s"] <= 0.4


def test_endpoint_4xx_bad_json_and_missing_score_are_other_errors(judge):
    scripted, base_url = judge
    scripted.reset((400, {"detail": "item.reference_answer is required"}), (200, "<html>oops</html>"),
                   (200, {"points": 3}))
    ctx = context()
    rejected = run_grade(endpoint_grader(base_url), "x", ctx=ctx)
    assert set_flags(rejected) == ["other_error"]
    assert "400" in rejected.errors["details"] and "reference_answer is required" in rejected.errors["details"]
    assert len(scripted.requests) == 1  # no retry on 4xx
    not_json = run_grade(endpoint_grader(base_url), "x", ctx=ctx)
    assert set_flags(not_json) == ["other_error"] and "not JSON" in not_json.errors["details"]
    no_score = run_grade(endpoint_grader(base_url), "x", ctx=ctx)
    assert set_flags(no_score) == ["other_error"] and '"score"' in no_score.errors["details"]


def test_endpoint_rate_limit_holds_across_concurrent_gradings(judge):
    scripted, base_url = judge
    scripted.reset(default=(200, {"score": 1}))
    config = GRADER.validate_python(endpoint_grader(base_url, rate_limit=5))
    ctx = context()

    async def twenty_at_once() -> list[GradeResult]:
        try:
            return await asyncio.gather(*(grade(config, Sample(output_text=str(i)), {}, ctx) for i in range(20)))
        finally:
            await close_http_client(ctx)

    started = time.monotonic()
    results = asyncio.run(twenty_at_once())
    elapsed = time.monotonic() - started

    assert all(r.reward == 1 for r in results)
    assert elapsed >= 3.0
    arrivals = sorted(r["at"] for r in scripted.requests)
    assert len(arrivals) == 20
    # No one-second window holds more than 5 requests (small tolerance for scheduling jitter).
    assert min(later - earlier for earlier, later in zip(arrivals, arrivals[5:])) >= 0.9


def test_endpoint_on_a_private_address_needs_the_allowlist(judge):
    scripted, base_url = judge
    result = run_grade(endpoint_grader(base_url), "x", ctx=context(outbound_allowlist=[]))
    assert set_flags(result) == ["other_error"]
    assert "non-public address" in result.errors["details"]
    assert "AGENT_RFT_OUTBOUND_ALLOWLIST" in result.errors["details"]
    assert scripted.requests == []


# --- batch grading ----------------------------------------------------------------------------


def test_grade_many_runs_concurrently_and_keeps_order(judge):
    scripted, base_url = judge
    scripted.reset(default=(200, {"score": 1.0}), delay_s=0.05)
    config = GRADER.validate_python(endpoint_grader(base_url, pass_threshold=1))
    jobs = [(Sample(output_text=f"answer {i}"), {"i": i}, f"trace_{i}") for i in range(100)]
    ctx = context()

    async def batch():  # noqa: ANN202
        try:
            return await grade_many(config, jobs, ctx, concurrency=32)
        finally:
            await close_http_client(ctx)

    grades = asyncio.run(batch())

    # Concurrent, within the bound: many gradings were waiting on the judge at once, never over 32
    # (counted at the server, so a loaded machine cannot make this flaky).
    assert 8 <= scripted.max_in_flight <= 32, scripted.max_in_flight
    assert [g.index for g in grades] == list(range(100))
    assert [g.trace_id for g in grades] == [f"trace_{i}" for i in range(100)]
    assert all(g.reward == 1.0 and g.passed and g.errors == [] and g.latency_s >= 0.05 for g in grades)
    received = {body["trace_id"]: body["item"]["i"] for body in scripted.json_bodies()}
    assert received == {f"trace_{i}": i for i in range(100)}


def test_grade_many_reports_each_failure_on_its_own(judge):
    scripted, base_url = judge
    scripted.reset((200, {"score": 0.5}), (400, "bad sample"), (200, {"score": 0.5}))
    config = GRADER.validate_python(endpoint_grader(base_url))
    ctx = context()

    async def batch():  # noqa: ANN202
        try:
            return await grade_many(config, [(Sample(output_text=str(i)), {}, None) for i in range(3)], ctx, concurrency=1)
        finally:
            await close_http_client(ctx)

    grades = asyncio.run(batch())
    assert [g.reward for g in grades] == [0.5, 0.0, 0.5]
    assert [g.errors for g in grades] == [[], ["other_error"], []]
    assert "bad sample" in grades[1].details and grades[1].result.failed


# --- the API, driven by the openai SDK ---------------------------------------------------------


@pytest.fixture
def sdk(settings, project, server):  # noqa: ANN001, ANN201
    scripted, base_url = server
    scripted.reset()
    app_settings = settings.model_copy(update={"judge_base_url": f"{base_url}/v1", "judge_api_key": None})
    app = create_app(app_settings)
    if not any(getattr(route, "path", "").startswith("/v1/fine_tuning/alpha/graders") for route in app.routes):
        from app.graders.router import router as graders_router  # until app/main.py includes it

        app.include_router(graders_router)
    with serve(app) as api_url:
        with openai.OpenAI(base_url=f"{api_url}/v1", api_key=project["key"], max_retries=0) as client:
            yield client, scripted, base_url, api_url


def test_run_and_validate_with_the_openai_sdk(sdk):
    client, scripted, base_url, _ = sdk
    scripted.reset(completion('{"result": 0.9, "steps": []}', model="judge-model-1"))

    result = client.fine_tuning.alpha.graders.run(
        grader=score_grader(), model_sample="Revenue was 412.5", item={"question": "Revenue in 2023?"},
    )
    assert result.reward == pytest.approx(0.9)
    assert result.metadata.name == "quality" and result.metadata.type == "score_model"
    assert result.metadata.errors.api_model_grader_server_error is False
    assert result.metadata.errors.api_model_grader_parse_error is False
    assert result.metadata.token_usage == 150 and result.metadata.sampled_model_name == "judge-model-1"
    assert result.api_model_grader_token_usage_per_model == {
        "judge-model-1": {"prompt_tokens": 120, "completion_tokens": 30, "total_tokens": 150}}
    assert "authorization" not in scripted.requests[0]["headers"]  # no judge key configured, none sent

    scripted.reset(default=(500, "judge crashed"))
    failed = client.fine_tuning.alpha.graders.run(grader=score_grader(), model_sample="x", item={"question": "q"})
    assert failed.reward == 0 and failed.metadata.errors.api_model_grader_server_error is True
    assert "judge crashed" in failed.metadata.errors.api_model_grader_server_error_details

    scripted.reset((200, {"score": 0.4}))
    endpoint = client.fine_tuning.alpha.graders.run(
        grader=endpoint_grader(base_url), model_sample={"output_text": "412.5", "trajectory": []},  # type: ignore[arg-type]
        item={"reference_answer": "412.5"},
    )
    assert endpoint.reward == pytest.approx(0.4) and endpoint.metadata.errors.unresponsive_reward_error is False
    assert scripted.json_bodies()[0]["sample"]["output_text"] == "412.5"
    # The request's own headers are sent as given (nothing is stored, so nothing is sealed) ...
    assert scripted.requests[0]["headers"]["authorization"] == "Bearer grader-token-123"
    # ... and the answer that echoes the grader masks them, as every answer that shows a grader does.
    echoed = client.post("/fine_tuning/alpha/graders/validate", cast_to=object, body={"grader": endpoint_grader(base_url)})
    assert echoed["grader"]["headers"] == {"Authorization": "****-123"}

    validated = client.fine_tuning.alpha.graders.validate(grader=score_grader(range=[0, 10]))
    assert validated.grader.type == "score_model" and validated.grader.range == [0, 10]
    assert validated.grader.input[1].content[0].text == "Question: {{item.question}}"


def test_graders_api_refuses_bad_graders_and_missing_keys(sdk):
    client, _, _, api_url = sdk
    with pytest.raises(openai.BadRequestError) as bad:
        client.fine_tuning.alpha.graders.validate(grader=score_grader(range=[5, 1]))
    assert bad.value.param == "grader.range"
    with pytest.raises(openai.BadRequestError) as bad_sample:
        client.fine_tuning.alpha.graders.run(grader=score_grader(), model_sample={"output_tools": "nope"})  # type: ignore[arg-type]
    assert bad_sample.value.param == "model_sample.output_tools"
    with pytest.raises(openai.BadRequestError) as unknown_type:
        client.fine_tuning.alpha.graders.run(grader={"type": "magic", "name": "m"}, model_sample="x")  # type: ignore[arg-type]
    assert unknown_type.value.param == "grader"

    with openai.OpenAI(base_url=f"{api_url}/v1", api_key="sk-wrong", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError):
            stranger.fine_tuning.alpha.graders.validate(grader=score_grader())
        with pytest.raises(openai.AuthenticationError):
            stranger.fine_tuning.alpha.graders.run(grader=score_grader(), model_sample="x")


def test_graders_run_refuses_a_url_the_ssrf_guard_refuses_and_says_why(settings, project, server):  # noqa: ANN001
    """As job creation does (400 url_not_allowed naming the grader's url), not a 200 with reward 0
    and an other_error flag that does not say why."""
    scripted, base_url = server
    scripted.reset((200, {"score": 1.0}))
    app = create_app(settings.model_copy(update={"outbound_allowlist": []}))
    nested = {"type": "multi", "name": "both", "calculate_output": "inner", "graders": {
        "inner": endpoint_grader(base_url)}}
    with serve(app) as api_url, openai.OpenAI(base_url=f"{api_url}/v1", api_key=project["key"],
                                              max_retries=0) as client:
        for grader, param in ((endpoint_grader(base_url), "grader.url"), (nested, "grader.graders.inner.url")):
            with pytest.raises(openai.BadRequestError) as refused:
                client.fine_tuning.alpha.graders.run(grader=grader, model_sample="x", item={})  # type: ignore[arg-type]
            assert refused.value.code == "url_not_allowed" and refused.value.param == param
            assert "non-public address" in refused.value.message and "AGENT_RFT_OUTBOUND_ALLOWLIST" in refused.value.message
    assert scripted.requests == []  # nothing was sent to the refused address


# --- a real local judge -----------------------------------------------------------------------


def test_a_process_without_a_model_loader_cannot_use_a_local_judge():
    result = run_grade(score_grader(), "Revenue was 412.5", {"question": "Revenue in 2023?"},
                       GraderContext(judge_local_model="SmolLM2-135M-Instruct"))
    assert set_flags(result) == ["model_grader_server_error"] and result.reward == 0


def test_local_smollm2_judge():
    from workers.models.loading import load_model

    ctx = GraderContext(judge_local_model="SmolLM2-135M-Instruct", load_judge_model=load_model)
    config = score_grader(sampling_params={"max_completions_tokens": 24})
    first = run_grade(config, "Revenue was 412.5", {"question": "Revenue in 2023?"}, ctx)
    loaded = ctx.shared["graders.local_judge"]
    again = run_grade(config, "Revenue was 412.5", {"question": "Revenue in 2023?"}, ctx)

    # A 135M model may or may not write valid JSON; either way it ran, greedily, and was counted.
    assert first.sampled_model_name == "SmolLM2-135M-Instruct"
    assert set_flags(first) in ([], ["model_grader_parse_error"])
    assert 0 <= first.reward <= 1
    usage = first.model_token_usage["SmolLM2-135M-Instruct"]
    assert usage["prompt_tokens"] > 20 and 0 < usage["completion_tokens"] <= 24
    assert (again.reward, again.token_usage) == (first.reward, first.token_usage)  # greedy: same answer
    assert ctx.shared["graders.local_judge"] is loaded  # loaded once per context, not per grading
