"""Serving end to end: the official `openai` SDK against the live API and a real inference server
(`agent-rft inference`, a subprocess), real PostgreSQL, Redis and a Celery worker that trained
the job. One job (tiny model, LoRA, 3 steps with a checkpoint each) is trained once for the module."""

from __future__ import annotations

import asyncio
import json
import io
import shutil
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from app.core.config import Settings
from examples.financial_reports.demo import http_ok
from tests.conftest import (
    REDIS_URL, _truncate_all, agent_rft_inference, agent_rft_process, agent_rft_worker, free_port, jsonl, live_server,
    make_project, wait_for,
)
from tests.harness_tool_server import TOKEN as HARNESS_TOKEN, harness_tool_server
from tests.rl.tool_server import tool_server

TOKEN = "serving-worker-token"
SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the reports",
                                           "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                          "required": ["query"]}}}
SMOLLM2 = "SmolLM2-135M-Instruct"
WORKED_EXAMPLE = """You have a tool named search. Example:
User: What was Foo Corp revenue in 2021?
Assistant: <tool_call>{"name": "search", "arguments": {"query": "Foo Corp revenue 2021"}}</tool_call>"""
HELLO = [{"role": "user", "content": "What was ACME's revenue in 2001?"}]


@dataclass
class Trained:
    settings: Settings
    api_url: str
    inference_url: str
    inference_log: Path
    key: str
    other_key: str
    job_id: str
    model: str
    checkpoints: dict[int, tuple[str, str, str]]  # step -> (checkpoint id, model name, path)
    full_model: str  # a full-fine-tuned job's model (one step)
    full_path: str

    def sdk(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.api_url}/v1", api_key=key or self.key, max_retries=0, timeout=120)

    def pool(self) -> dict:
        return httpx.get(f"{self.inference_url}/healthz", timeout=10).json()


def _train(sdk: openai.OpenAI, tool_url: str, *, rows: int = 6, **options) -> str:  # noqa: ANN003
    rows = [{"messages": list(HELLO), "tools": [SEARCH], "reference_answer": f"{100 + i}"} for i in range(rows)]
    uploaded = sdk.files.create(file=("train.jsonl", io.BytesIO(jsonl(rows))), purpose="fine-tune")
    job = sdk.fine_tuning.jobs.create(model="tiny-smollm2", training_file=uploaded.id, seed=3, suffix="serve", method={
        "type": "reinforcement", "reinforcement": {
            # Rewards that differ between rollouts (random text scores by its characters), so every
            # step updates the adapters and each checkpoint is a different model.
            "grader": {"type": "python", "name": "spread",
                       "source": "def grade(sample, item):\n    return sum(map(ord, sample['output_text'])) % 10 / 10\n"},
            "tools": [{"name": "search", "server_url": tool_url}],
            "hyperparameters": {"batch_size": 2, "compute_multiplier": 0.5, "n_epochs": 1, "eval_interval": 1,
                                "eval_samples": 2},
            "max_episode_steps": 1,
            "x_open_model": {"lora_rank": 4, "max_tokens_per_turn": 8, "max_tokens_per_rollout": 16,
                             "learning_rate": 0.05, **options},
        }})
    return job.id


def _finished(sdk: openai.OpenAI, job_id: str, log: Path):  # noqa: ANN202
    wait_for(lambda: sdk.fine_tuning.jobs.retrieve(job_id).status in ("succeeded", "failed", "cancelled"),
             timeout=300, interval=0.5)
    job = sdk.fine_tuning.jobs.retrieve(job_id)
    assert job.status == "succeeded", (job.error, log.read_text()[-3000:])
    return job


@pytest.fixture(scope="module")
def trained(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trained]:
    root = tmp_path_factory.mktemp("serving")
    settings = Settings(_env_file=None, data_dir=root / "data", database_url=pg_url, broker_url=REDIS_URL,
                        training_queue=f"test-serving-{uuid.uuid4().hex[:8]}", outbound_allowlist=["127.0.0.1"],
                        checkpoint_dir=root / "checkpoints", worker_token=TOKEN, lease_seconds=10,
                        inference_models=["tiny-smollm2", SMOLLM2], inference_pool_size=2)
    project, other = make_project(settings), make_project(settings)
    try:
        with agent_rft_inference(settings, token=TOKEN) as (inference_url, _, inference_log):
            settings.inference_url = inference_url
            with live_server(settings) as api_url, tool_server() as (tool_url, _):
                with agent_rft_worker(settings, api_url, token=TOKEN, queues=settings.training_queue) as (_, log):
                    sdk = openai.OpenAI(base_url=f"{api_url}/v1", api_key=project["key"], max_retries=0)
                    job_id = _train(sdk, tool_url)
                    full_id = _train(sdk, tool_url, rows=2, training_mode="full")
                    job, full = _finished(sdk, job_id, log), _finished(sdk, full_id, log)
                paths = _checkpoint_paths(pg_url, job_id)
                checkpoints = {c.step_number: (c.id, c.fine_tuned_model_checkpoint, paths[c.id])
                               for c in sdk.fine_tuning.jobs.checkpoints.list(job_id)}
                full_path = next(iter(_checkpoint_paths(pg_url, full_id).values()))
                yield Trained(settings, api_url, inference_url, inference_log, project["key"], other["key"], job_id,
                              job.fine_tuned_model, checkpoints, full.fine_tuned_model, full_path)
    finally:
        _truncate_all(pg_url)


def _checkpoint_paths(pg_url: str, job_id: str) -> dict[str, str]:
    import psycopg

    with psycopg.connect(pg_url) as conn:
        return dict(conn.execute("SELECT id, path FROM checkpoints WHERE job_id = %s", (job_id,)).fetchall())


def ask(sdk: openai.OpenAI, model: str, **kwargs):  # noqa: ANN003, ANN201
    kwargs.setdefault("messages", HELLO)
    kwargs.setdefault("max_tokens", 12)
    kwargs.setdefault("temperature", 0)
    return sdk.chat.completions.create(model=model, **kwargs)


# --- the trained model and its checkpoints ---------------------------------------------------------


def test_the_fine_tuned_model_and_a_checkpoint_answer(trained: Trained):
    assert sorted(trained.checkpoints) == [1, 2, 3]
    with trained.sdk() as sdk:
        final = ask(sdk, trained.model)
        checkpoint = ask(sdk, trained.checkpoints[1][1])
        base = ask(sdk, "tiny-smollm2")
    for answer, name in ((final, trained.model), (checkpoint, trained.checkpoints[1][1]), (base, "tiny-smollm2")):
        assert answer.object == "chat.completion" and answer.model == name
        assert answer.choices[0].message.role == "assistant"
        assert answer.choices[0].finish_reason in ("stop", "length")
        assert answer.usage.completion_tokens == 12 or answer.choices[0].finish_reason == "stop"
        assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    # The fine-tuned model is its job's last checkpoint.
    with trained.sdk() as sdk:
        last = ask(sdk, trained.checkpoints[3][1])
    assert final.choices[0].message.content == last.choices[0].message.content


def test_with_tools_the_tiny_model_still_answers_in_text(trained: Trained):
    with trained.sdk() as sdk:
        answer = ask(sdk, trained.model, tools=[SEARCH], tool_choice="auto")
        streamed = list(ask(sdk, trained.checkpoints[1][1], tools=[SEARCH], stream=True))
        plain = ask(sdk, trained.checkpoints[1][1], tools=[SEARCH])
    # Random weights never write a tool call: the answer is text, read by the training parser.
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.choices[0].message.tool_calls is None
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == plain.choices[0].message.content
    assert not any(c.choices and c.choices[0].delta.tool_calls for c in streamed)


def test_streaming_gives_the_same_text_as_a_plain_request(trained: Trained):
    with trained.sdk() as sdk:
        plain = ask(sdk, trained.model, max_tokens=16)
        chunks = list(ask(sdk, trained.model, max_tokens=16, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_seed_n_and_stop(trained: Trained):
    with trained.sdk() as sdk:
        first = ask(sdk, trained.model, temperature=1.0, seed=11, n=3, max_tokens=10)
        again = ask(sdk, trained.model, temperature=1.0, seed=11, n=3, max_tokens=10)
        other = ask(sdk, trained.model, temperature=1.0, seed=12, n=3, max_tokens=10)
        single = ask(sdk, trained.model, max_tokens=1)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]  # same seed, same output
    assert texts != [c.message.content for c in other.choices]
    assert len(set(texts)) > 1  # the n choices are different samples
    assert 0 < first.usage.completion_tokens <= 3 * 10
    assert first.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt is counted once, not per choice


def test_a_stop_sequence_cuts_the_answer_before_it(trained: Trained):
    with trained.sdk() as sdk:
        sampled = dict(max_tokens=16, temperature=1.0, seed=5)
        greedy = ask(sdk, trained.model, **sampled).choices[0].message.content
        # Three characters from the second half that are not all blank (a blank stop would be ambiguous).
        stop = next(greedy[i:i + 3] for i in range(len(greedy) // 2, len(greedy) - 2) if greedy[i:i + 3].strip())
        cut = ask(sdk, trained.model, stop=[stop], **sampled).choices[0]
    assert cut.finish_reason == "stop" and stop not in cut.message.content
    assert greedy.startswith(cut.message.content) and len(cut.message.content) < len(greedy)


def _engine_answer(loaded, conversation: list[dict], *, temperature: float, seed: int, tokens: int):  # noqa: ANN001, ANN202
    """One rollout of the training engine (no tools): its answer text and token counts."""
    import asyncio

    from workers.engine.prompting import ChatFormatter
    from workers.engine.rollout import EngineConfig, RolloutEngine, RolloutSpec

    engine = RolloutEngine(loaded.model, loaded.tokenizer, ChatFormatter(loaded.tokenizer), None,
                           EngineConfig(temperature=temperature, max_tokens_per_turn=tokens, max_tokens_per_rollout=tokens))
    return asyncio.run(engine.run([RolloutSpec(0, conversation, [], {}, seed=seed)]))[0]


def test_parity_with_the_training_engine(trained: Trained):
    """The endpoint and the rollout engine, with a checkpoint loaded as `agent-rft eval` loads it, give
    the same text: greedy, and sampled with the same seed (a rollout with seed s samples its first
    turn with seed s * 1000)."""
    from workers.models.loading import load_model
    from workers.commands.rollout_command import load_policy

    _, name, path = trained.checkpoints[2]
    conversation = [{"role": "system", "content": "Answer briefly."}, *HELLO]
    checkpoint = load_policy(path)
    with trained.sdk() as sdk:
        for temperature, seed in ((0.0, 0), (1.0, 7)):
            record = _engine_answer(checkpoint, conversation, temperature=temperature, seed=seed, tokens=20)
            served = ask(sdk, name, messages=conversation, max_tokens=20, temperature=temperature, seed=seed * 1000)
            assert served.choices[0].message.content == record.messages[-1]["content"]
            assert (served.usage.prompt_tokens, served.usage.completion_tokens) == (record.prompt_tokens,
                                                                                  record.completion_tokens)
        base = ask(sdk, "tiny-smollm2", messages=conversation, max_tokens=20, temperature=1.0, seed=7000)
        assert base.choices[0].message.content != served.choices[0].message.content  # the adapter is applied
        # A real model, greedy: SmolLM2 writes text, not newlines, so the comparison has teeth.
        smol = load_model(SMOLLM2)
        question = [{"role": "user", "content": "Name three colours of the rainbow."}]
        record = _engine_answer(smol, question, temperature=0.0, seed=0, tokens=24)
        served = ask(sdk, SMOLLM2, messages=question, max_tokens=24)
    assert len(set(record.messages[-1]["content"])) > 5
    assert served.choices[0].message.content == record.messages[-1]["content"]


def test_a_full_fine_tuned_model_is_served_like_the_engine_runs_it(trained: Trained):
    from workers.commands.rollout_command import load_policy

    conversation = [{"role": "system", "content": "Answer briefly."}, *HELLO]
    record = _engine_answer(load_policy(trained.full_path), conversation, temperature=1.0, seed=3, tokens=16)
    with trained.sdk() as sdk:
        served = ask(sdk, trained.full_model, messages=conversation, max_tokens=16, temperature=1.0, seed=3000)
        base = ask(sdk, "tiny-smollm2", messages=conversation, max_tokens=16, temperature=1.0, seed=3000)
    assert served.choices[0].message.content == record.messages[-1]["content"]
    assert served.choices[0].message.content != base.choices[0].message.content
    assert str(Path(trained.full_path).resolve()) in trained.pool()["pool"]  # one pool for adapters and full models


# --- models ----------------------------------------------------------------------------------------


def test_models_are_listed_retrieved_and_scoped_to_the_project(trained: Trained):
    with trained.sdk() as sdk, trained.sdk(trained.other_key) as other:
        mine = {m.id: m for m in sdk.models.list()}
        theirs = {m.id for m in other.models.list()}
        assert {"tiny-smollm2", SMOLLM2, trained.model} | {c[1] for c in trained.checkpoints.values()} <= set(mine)
        assert mine[trained.model].owned_by != "agent-rft" and mine["tiny-smollm2"].owned_by == "agent-rft"
        assert sdk.models.retrieve(trained.model).id == trained.model
        assert sdk.models.retrieve(trained.checkpoints[1][1]).object == "model"
        assert theirs == {"tiny-smollm2", SMOLLM2}
        for name in (trained.model, trained.checkpoints[1][1]):
            with pytest.raises(openai.NotFoundError) as caught:
                ask(other, name)
            assert caught.value.code == "model_not_found"
            with pytest.raises(openai.NotFoundError):
                other.models.retrieve(name)
        with pytest.raises(openai.NotFoundError) as unknown:
            ask(sdk, "ft:tiny-smollm2:nobody::ftjob-nothing")
        assert unknown.value.code == "model_not_found"
        assert str(unknown.value.body["message"]) == str(caught.value.body["message"]).replace(
            trained.checkpoints[1][1], "ft:tiny-smollm2:nobody::ftjob-nothing")


# --- the pool --------------------------------------------------------------------------------------


def test_more_adapters_than_the_pool_holds_are_evicted_and_reloaded(trained: Trained):
    names = [trained.checkpoints[step][1] for step in (1, 2, 3)]
    with trained.sdk() as sdk:
        sampled = dict(temperature=1.0, seed=5)
        first = {name: ask(sdk, name, **sampled).choices[0].message.content for name in names}
        before = trained.pool()
        assert len(before["pool"]) == 2 == before["pool_capacity"]
        again = ask(sdk, names[0], **sampled).choices[0].message.content  # evicted by the third: loaded again
    assert len(set(first.values())) == 3  # three different models answered
    after = trained.pool()
    assert again == first[names[0]]
    assert after["loads"] > before["loads"] and after["evictions"] > before["evictions"]
    assert trained.checkpoints[1][2] in after["pool"]


# --- bad input -------------------------------------------------------------------------------------


def test_bad_requests_answer_openai_errors(trained: Trained):
    with trained.sdk() as sdk:
        cases = [
            (dict(max_tokens=9000), "context_length_exceeded", "messages"),
            (dict(messages=[{"role": "wizard", "content": "hi"}]), "invalid_value", "messages"),
            (dict(messages=[]), "invalid_value", "messages"),
            (dict(logit_bias={"42": 5}), "unsupported_parameter", "logit_bias"),
            (dict(logprobs=True), "unsupported_parameter", "logprobs"),
            (dict(response_format={"type": "xml"}), "invalid_value", "response_format"),
            (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}),
             "invalid_value", "response_format"),
            (dict(extra_body={"best_of": 2}), "unsupported_parameter", "best_of"),
            (dict(tools=[SEARCH], tool_choice={"type": "function", "function": {"name": "nope"}}), "invalid_value",
             "tool_choice"),
            (dict(n=0), "invalid_value", "n"),
            (dict(temperature=3), "invalid_value", "temperature"),
        ]
        for kwargs, code, param in cases:
            with pytest.raises(openai.BadRequestError) as caught:
                ask(sdk, trained.model, **kwargs)
            assert (caught.value.code, caught.value.param) == (code, param), (kwargs, caught.value.body)
        with pytest.raises(openai.BadRequestError) as long_prompt:
            ask(sdk, "tiny-smollm2", messages=[{"role": "user", "content": "word " * 9000}])
        assert long_prompt.value.code == "context_length_exceeded"
        assert "maximum context length is 8192 tokens" in long_prompt.value.message


# --- a burst of requests ------------------------------------------------------------------------------

@contextmanager
def second_api_process(trained: Trained) -> Iterator[str]:
    """`agent-rft serve` in its own process, on the module's database, storage and inference server, with
    the default pool and thread sizes: the load test's burst and its client share no interpreter."""
    port = free_port()
    settings = trained.settings
    env = {"AGENT_RFT_DATABASE_URL": settings.database_url, "AGENT_RFT_BROKER_URL": REDIS_URL,
           "AGENT_RFT_DATA_DIR": str(settings.data_dir), "AGENT_RFT_INFERENCE_URL": trained.inference_url,
           "AGENT_RFT_INFERENCE_MODELS": ",".join(settings.inference_models), "AGENT_RFT_WORKER_TOKEN": TOKEN,
           "AGENT_RFT_CHECKPOINT_DIR": str(settings.checkpoint_dir)}
    url = f"http://127.0.0.1:{port}"
    log = settings.data_dir / f"api-{uuid.uuid4().hex[:6]}.log"
    with agent_rft_process(["serve", "--port", str(port)], env, log, lambda: http_ok(f"{url}/healthz")):
        yield url


def burst_requests(trained: Trained) -> list[tuple[str, str, dict]]:
    """200 requests (method, path, JSON body): cheap routes, and slow ones (completions, downloads)."""
    checkpoint_id = trained.checkpoints[3][0]
    chat = {"model": trained.model, "messages": HELLO, "max_tokens": 4, "temperature": 0}
    jobs = f"/v1/fine_tuning/jobs/{trained.job_id}"
    return ([("GET", "/v1/models", {})] * 60 + [("GET", f"{jobs}/events", {})] * 30 + [("GET", jobs, {})] * 30
            + [("POST", "/v1/chat/completions", chat)] * 30
            + [("POST", "/v1/chat/completions", {**chat, "stream": True})] * 30
            + [("GET", f"{jobs}/checkpoints/{checkpoint_id}/content", {})] * 20)


async def send_all(url: str, key: str, requests: list[tuple[str, str, dict]]) -> list[tuple[int, dict, bytes] | str]:
    """Every request at once, each on its own connection; (status, headers, body) or the transport error."""
    async def one(method: str, path: str, body: dict) -> tuple[int, dict, bytes] | str:
        async with httpx.AsyncClient(base_url=url, timeout=120, headers={"Authorization": f"Bearer {key}"}) as http:
            try:
                answer = await http.request(method, path, json=body or None)
                return answer.status_code, dict(answer.headers), answer.content
            except httpx.TransportError as exc:
                return f"{type(exc).__name__}: {exc}"

    return await asyncio.gather(*(one(*request) for request in requests))


def watch_health(url: str, stop: threading.Event, took: list[float]) -> None:
    with httpx.Client(base_url=url, timeout=30) as http:
        while not stop.is_set():
            began = time.perf_counter()
            assert http.get("/healthz").status_code == 200
            took.append(time.perf_counter() - began)
            stop.wait(0.1)


def test_a_burst_of_200_requests_is_answered_or_refused_with_retry_after(trained: Trained):
    """Past the API's turns at the database or the inference server's queue, a request waits or is
    refused with Retry-After: never a 500, a reset, or a stalled liveness probe."""
    with second_api_process(trained) as url:
        stop, health = threading.Event(), []
        prober = threading.Thread(target=watch_health, args=(url, stop, health))
        prober.start()
        try:
            answers = asyncio.run(send_all(url, trained.key, burst_requests(trained)))
        finally:
            stop.set()
            prober.join()
    failed = [a for a in answers if isinstance(a, str)]
    assert not failed, failed[:3]
    statuses = Counter(status for status, _, _ in answers)
    assert set(statuses) <= {200, 429, 503}, (statuses, [b[:300] for s, _, b in answers if s not in (200, 429, 503)][:3])
    refused = [headers for status, headers, _ in answers if status != 200]
    assert all("retry-after" in headers for headers in refused), statuses
    assert statuses[200] >= 150, statuses  # the cheap routes and the downloads are never refused
    assert len(health) >= 3 and max(health) < 1.0, health
    downloads = [body for status, _, body in answers[-20:] if status == 200]
    assert downloads and all(len(body) == len(downloads[0]) for body in downloads)


def test_a_checkpoint_whose_files_are_gone_is_404(trained: Trained):
    _, name, path = trained.checkpoints[1]
    moved = Path(path).with_name("moved-away")
    shutil.move(path, moved)
    try:
        with trained.sdk() as sdk:
            ask(sdk, trained.checkpoints[2][1])  # pushes step 1 out of the pool (capacity 2)
            ask(sdk, trained.checkpoints[3][1])
            with pytest.raises(openai.NotFoundError) as caught:
                ask(sdk, name)
    finally:
        shutil.move(moved, path)
    assert caught.value.code == "checkpoint_files_missing"
    assert "gone" in caught.value.message


def test_an_unreachable_inference_server_is_503_quickly(trained: Trained, pg_url: str):
    settings = trained.settings.model_copy(update={"inference_url": f"http://127.0.0.1:{free_port()}"})
    with live_server(settings) as api_url, \
            openai.OpenAI(base_url=f"{api_url}/v1", api_key=trained.key, max_retries=0, timeout=30) as sdk:
        with pytest.raises(openai.InternalServerError) as caught:
            ask(sdk, "tiny-smollm2")
        with pytest.raises(openai.InternalServerError):
            ask(sdk, "tiny-smollm2", stream=True)
    assert caught.value.status_code == 503 and caught.value.code == "inference_unavailable"


# --- a real model: tool calls and an agent loop ------------------------------------------------------


def test_smollm2_tool_call_round_trip(trained: Trained):
    """A tool call forced by name comes back in OpenAI's shape, streamed as it is answered whole; the
    caller runs it and sends the result back, and the model answers. Whether SmolLM2 would call the
    tool on its own depends on the CPU's kernels, so the call is forced (tool_choice), as a client
    does when the first step must be a search; its arguments are whatever the model wrote."""
    question = [{"role": "system", "content": WORKED_EXAMPLE},
                {"role": "user", "content": "What was Acme Corp revenue in 2022?"}]
    forced = {"type": "function", "function": {"name": "search"}}
    with trained.sdk() as sdk:
        first = ask(sdk, SMOLLM2, messages=question, tools=[SEARCH], tool_choice=forced, max_tokens=60)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "search" and call.id.startswith("call_")
        assert isinstance(json.loads(call.function.arguments), dict)
        streamed = list(ask(sdk, SMOLLM2, messages=question, tools=[SEARCH], tool_choice=forced, max_tokens=60,
                            stream=True))
        deltas = [c.choices[0].delta for c in streamed if c.choices and c.choices[0].delta.tool_calls]
        assert [(d.tool_calls[0].function.name, d.tool_calls[0].function.arguments) for d in deltas] == [
            ("search", call.function.arguments)]
        assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "tool_calls"
        assert not "".join(c.choices[0].delta.content or "" for c in streamed if c.choices).count("<tool_call>")
        history = question + [choice.message.model_dump(exclude_none=True),
                              {"role": "tool", "tool_call_id": call.id,
                               "content": "Acme Corp annual report 2022: revenue was $713.8 million."}]
        final = ask(sdk, SMOLLM2, messages=history, tools=[SEARCH], tool_choice="none", max_tokens=40)
    answer = final.choices[0]
    assert answer.message.tool_calls is None and answer.finish_reason in ("stop", "length")
    assert final.usage.prompt_tokens > first.usage.prompt_tokens  # the tool result was in the prompt


# --- the CLI -----------------------------------------------------------------------------------------


def test_agent_rft_chat_shows_answers_and_tool_calls(trained: Trained, tmp_path: Path):
    import subprocess
    import sys

    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([SEARCH["function"]]))
    cli = [str(Path(sys.executable).parent / "agent-rft"), "chat", "--base-url", f"{trained.api_url}/v1",
           "--api-key", trained.key]
    called = subprocess.run([*cli, SMOLLM2, "--tools", str(tools), "--system", WORKED_EXAMPLE, "--max-tokens", "60",
                             "--tool-choice", "search", "-m", "What was Acme Corp revenue in 2022?"],
                            capture_output=True, text=True, timeout=120)
    assert called.returncode == 0, called.stderr
    assert "→ tool call search({" in called.stdout and "[finish_reason: tool_calls]" in called.stdout
    talked = subprocess.run([*cli, trained.model, "--max-tokens", "5"], input="Hello\nAgain\n\n", capture_output=True,
                            text=True, timeout=120)
    assert talked.returncode == 0, talked.stderr
    finishes = [line for line in talked.stdout.splitlines() if line.startswith("[finish_reason: ")]
    assert len(finishes) == 2 and set(finishes) <= {"[finish_reason: length]", "[finish_reason: stop]"}  # two answers
    toolless = subprocess.run([*cli, SMOLLM2, "--tool-choice", "search", "-m", "hi"], capture_output=True, text=True,
                              timeout=60)  # a forced call without --tools: the server's clear error, not ignored
    assert toolless.returncode == 1 and "tool_choice" in toolless.stderr + toolless.stdout
    unknown = subprocess.run([*cli, "ft:nope", "-m", "hi"], capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 1 and "model_not_found" in unknown.stderr + unknown.stdout


# --- deleting a model (last: it changes what the module's job serves) ----------------------------------


def test_deleting_the_fine_tuned_model_keeps_its_checkpoints(trained: Trained):
    with trained.sdk() as sdk, trained.sdk(trained.other_key) as other:
        with pytest.raises(openai.NotFoundError):
            other.models.delete(trained.model)  # another project's model: not found, not deleted
        with pytest.raises(openai.PermissionDeniedError):
            sdk.models.delete("tiny-smollm2")
        with pytest.raises(openai.BadRequestError) as checkpoint:
            sdk.models.delete(trained.checkpoints[1][1])
        assert checkpoint.value.code == "model_not_deletable"
        deleted = sdk.models.delete(trained.model)
        assert (deleted.id, deleted.deleted, deleted.object) == (trained.model, True, "model")
        listed = {m.id for m in sdk.models.list()}
        assert trained.model not in listed and trained.checkpoints[3][1] in listed
        with pytest.raises(openai.NotFoundError) as gone:
            ask(sdk, trained.model)
        assert gone.value.code == "model_not_found"
        with pytest.raises(openai.NotFoundError):
            sdk.models.delete(trained.model)  # deleting twice
        assert ask(sdk, trained.checkpoints[3][1]).choices  # the checkpoints stay callable


# --- the Responses API ----------------------------------------------------------------------------------

SEARCH_TOOL = {"type": "function", "name": "search", "description": "Search the reports", "strict": True,
               "parameters": SEARCH["function"]["parameters"]}
# What a forced call is asked with, as in the chat round trip above: SmolLM2 then closes its call.
CALL = {"instructions": WORKED_EXAMPLE, "input": "What was Acme Corp revenue in 2022?", "tools": [SEARCH_TOOL],
        "max_output_tokens": 60, "temperature": 0, "store": False}


def test_a_response_is_the_greedy_chat_completion_of_the_same_conversation(trained: Trained):
    with trained.sdk() as sdk:
        chat = ask(sdk, SMOLLM2, messages=[{"role": "system", "content": "Be brief."}, *HELLO])
        response = sdk.responses.create(model=SMOLLM2, instructions="Be brief.", input=HELLO[0]["content"],
                                        max_output_tokens=12, temperature=0, store=False)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    [message] = response.output
    assert (message.type, message.role, message.content[0].type) == ("message", "assistant", "output_text")


def test_a_required_tool_call_is_a_function_call_item_and_its_output_continues(trained: Trained):
    with trained.sdk() as sdk:
        first = sdk.responses.create(model=SMOLLM2, tool_choice="required", reasoning={"effort": "low"},
                                     include=["reasoning.encrypted_content"], parallel_tool_calls=True, **CALL)
        calls = [item for item in first.output if item.type == "function_call"]
        assert calls and calls[0].name == "search" and calls[0].call_id
        assert isinstance(json.loads(calls[0].arguments), dict)
        assert not [item for item in first.output if item.type == "reasoning"]  # no reasoning to include
        context = [{"role": "user", "content": CALL["input"]}, *[item.model_dump() for item in first.output],
                   {"type": "function_call_output", "call_id": calls[0].call_id,
                    "output": json.dumps({"document": "ACME revenue 2001 was 101 million"})}]
        second = sdk.responses.create(model=SMOLLM2, **{**CALL, "input": context, "tool_choice": "none",
                                                         "max_output_tokens": 12})
    assert second.output_text and second.output[0].type == "message"


def streamed(sdk: openai.OpenAI, **options):  # noqa: ANN003, ANN201
    """(the event types, the final response) of `client.responses.stream`; an answer cut by
    max_output_tokens ends with `response.incomplete`, which the SDK's get_final_response does not take."""
    with sdk.responses.stream(**options) as stream:
        events = list(stream)
    return [event.type for event in events], events[-1].response


def test_streamed_responses_build_the_same_answer_and_tool_call(trained: Trained):
    options = {"model": SMOLLM2, "input": HELLO, "temperature": 0, "store": False}
    with trained.sdk() as sdk:
        plain = sdk.responses.create(max_output_tokens=12, **options)
        kinds, final = streamed(sdk, max_output_tokens=12, **options)
        assert final.output_text == plain.output_text and final.status == plain.status
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] in ("response.completed", "response.incomplete")
        assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds
        called = dict(CALL, model=SMOLLM2, tool_choice={"type": "function", "name": "search"})
        plain_call = sdk.responses.create(**called)
        kinds, streamed_call = streamed(sdk, **called)
    [call] = [item for item in streamed_call.output if item.type == "function_call"]
    [expected] = [item for item in plain_call.output if item.type == "function_call"]
    assert (call.name, call.arguments) == (expected.name, expected.arguments)
    assert "response.function_call_arguments.done" in kinds


def test_stored_responses_continue_are_read_and_deleted_within_their_project(trained: Trained):
    with trained.sdk() as sdk, trained.sdk(trained.other_key) as other:
        first = sdk.responses.create(model=SMOLLM2, input=HELLO, temperature=0, max_output_tokens=8,
                                     metadata={"run": "a"})
        assert sdk.responses.retrieve(first.id).output_text == first.output_text
        second = sdk.responses.create(model=SMOLLM2, input="And in 2002?", previous_response_id=first.id,
                                      temperature=0, max_output_tokens=8)
        # The chain is the conversation: the same as sending the whole history at once.
        whole = sdk.responses.create(model=SMOLLM2, temperature=0, max_output_tokens=8, store=False, input=[
            *HELLO, {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And in 2002?"}])
        assert second.output_text == whole.output_text and second.previous_response_id == first.id
        for refused in (lambda: other.responses.retrieve(first.id),
                        lambda: other.responses.create(model=SMOLLM2, input="hi", previous_response_id=first.id)):
            with pytest.raises(openai.NotFoundError):
                refused()
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve(whole.id)  # store=False kept nothing
        sdk.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve(first.id)


def test_bad_responses_requests_name_the_parameter(trained: Trained):
    with trained.sdk() as sdk:
        for kwargs, param in (({"input": "hi", "extra_body": {"frobnicate": 1}}, "frobnicate"),
                              ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
                              ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format"),
                              ({"input": "hi", "truncation": "auto"}, "truncation")):
            with pytest.raises(openai.BadRequestError) as refused:
                sdk.responses.create(model=SMOLLM2, **kwargs)
            assert refused.value.param == param, refused.value


def run_harness_item(sdk: openai.OpenAI, base_url: str, tools_url: str, item: dict, *, text_format: dict | None,
                     budget: int = 3) -> dict:
    """One item of OpenAI's Agent RFT evaluation loop, written from its public contract: the Responses
    API with the harness's arguments, every function call run through tool/run and its `output` fed
    back, until a final message; then the answer graded through graders/run. The first turn must
    search (tool_choice "required", as a harness does when a lookup must come first); the last one,
    at the budget, must answer."""
    context: list = [{"role": "user", "content": item["question"]}]
    usage = {"input_tokens": 0, "output_tokens": 0}
    tools = [SEARCH_TOOL]
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {sdk.api_key}"}, timeout=120) as http:
        for turn in range(budget):
            choice = "required" if turn == 0 else ("none" if turn == budget - 1 else "auto")
            response = sdk.responses.create(
                model=SMOLLM2, instructions=WORKED_EXAMPLE, input=context, tools=tools, tool_choice=choice,
                reasoning={"effort": "low"}, store=False, include=["reasoning.encrypted_content"],
                parallel_tool_calls=True, text={"format": text_format}, max_output_tokens=60, temperature=0)
            usage = {key: usage[key] + getattr(response.usage, key) for key in usage}
            context += response.output
            calls = [o for o in response.output if o.type == "function_call"]
            if not calls:
                return {"answer": response.output_text, "usage": usage, "turns": turn + 1,
                        "grade": sdk.fine_tuning.alpha.graders.run(
                            grader={"type": "endpoint", "name": "checker", "url": f"{tools_url}/grade"},
                            model_sample=response.output_text, item=item)}
            for call in calls:
                ran = http.post("/v1/fine_tuning/alpha/tool/run", json={
                    "type": "function_call", "name": call.name, "server_url": f"{tools_url}/{call.name}",
                    "headers": {"Accept": "application/json", "Content-Type": "application/json",
                                "Authorization": f"Bearer {HARNESS_TOKEN}"},
                    "arguments": call.arguments, "item": item, "trace_id": f"trace_{item['id']}", "id": "tmp_user_id",
                    "call_id": call.call_id})
                assert ran.status_code == 200, ran.text
                context.append({"type": "function_call_output", "call_id": call.call_id, "output": ran.json()["output"]})
    raise AssertionError(f"no final message within {budget} turns")


# Bounded, so that any answer fits in the tokens the tests allow (a constrained value is valid once complete).
ANSWER_SCHEMA = {"type": "object", "properties": {"company": {"type": "string", "maxLength": 24},
                                                  "revenue_millions": {"type": "integer", "minimum": 0, "maximum": 99999}},
                 "required": ["company", "revenue_millions"], "additionalProperties": False}
STRICT_FORMAT = {"type": "json_schema", "name": "answer", "strict": True, "schema": ANSWER_SCHEMA}


@pytest.mark.parametrize("text_format", [None, STRICT_FORMAT], ids=["text", "strict_json_schema"])
def test_openai_agent_rft_harness_loop_runs_unchanged(trained: Trained, text_format: dict | None):
    items = [{"id": 1, "question": "What was ACME revenue in 2023?", "reference_answer": "412"},
             {"id": 2, "question": "What was Globex revenue in 2023?", "reference_answer": "97"}]
    with harness_tool_server() as (tools_url, received), trained.sdk() as sdk:
        results = [run_harness_item(sdk, trained.api_url, tools_url, item, text_format=text_format) for item in items]
    for item, result in zip(items, results):
        assert isinstance(result["answer"], str) and result["turns"] >= 2
        if text_format is not None:  # every final answer of SmolLM2 parses and fits the schema
            jsonschema.validate(json.loads(result["answer"]), ANSWER_SCHEMA)
        assert result["usage"]["input_tokens"] > 0 and result["usage"]["output_tokens"] > 0
        assert result["grade"].reward in (0.0, 1.0)
    searched = [c for c in received.calls if c["path"] == "/search"]
    assert {c["body"]["trace_id"] for c in searched} == {"trace_1", "trace_2"}
    assert all(c["body"]["item"]["id"] in (1, 2) and c["headers"]["authorization"] == f"Bearer {HARNESS_TOKEN}"
               for c in searched)
    graded = [c["body"] for c in received.calls if c["path"] == "/grade"]
    assert [g["item"]["id"] for g in graded] == [1, 2] and [g["sample"]["output_text"] for g in graded] == [
        r["answer"] for r in results]


def test_a_json_schema_or_json_object_format_constrains_the_answer(trained: Trained):
    """Sampled (not greedy) on the base model and streamed from a fine-tuned checkpoint: every complete
    answer parses and fits; the Responses API's text.format does the same."""
    schema_format = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": ANSWER_SCHEMA}}
    with trained.sdk() as sdk:
        sampled = ask(sdk, SMOLLM2, response_format=schema_format, max_tokens=80, seed=5, temperature=0.7)
        assert sampled.choices[0].finish_reason == "stop", sampled.choices[0].message.content
        jsonschema.validate(json.loads(sampled.choices[0].message.content), ANSWER_SCHEMA)
        # A checkpoint: the job's model name is deleted by an earlier test of this module.
        chunks = list(ask(sdk, trained.checkpoints[3][1], response_format=schema_format, max_tokens=80, stream=True))
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)),
                            ANSWER_SCHEMA)
        anything = ask(sdk, SMOLLM2, response_format={"type": "json_object"}, max_tokens=80)
        if anything.choices[0].finish_reason == "stop":  # an open object has no bound: a cut one is not complete
            assert isinstance(json.loads(anything.choices[0].message.content), dict)
        response = sdk.responses.create(model=SMOLLM2, input=HELLO, text={"format": STRICT_FORMAT},
                                        max_output_tokens=80, temperature=0, store=False)
    assert response.status == "completed" and response.text.format.type == "json_schema"
    jsonschema.validate(json.loads(response.output_text), ANSWER_SCHEMA)
