"""The inference server on its vLLM backend (AGENT_RFT_INFERENCE_BACKEND=vllm): a real
`agent-rft inference` subprocess in front of a real vLLM server serving SmolLM2-135M-Instruct, a
checkpoint's LoRA adapter loaded on demand; the server runs in a process where torch cannot be
imported (it holds tokenizers only). Train/serve parity is checked as for the engine
backend: the endpoint answers what a rollout sampled on the same vLLM answers."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema
import pytest

from app.core.config import Settings
from tests.conftest import VLLM_MODEL, agent_rft_inference, free_port
from tests.rl.test_vllm_sampler import adapter, served
from workers.models.loading import load_model
from workers.engine.prompting import ChatFormatter
from workers.engine.rollout import EngineConfig, RolloutEngine, RolloutSpec
from workers.engine.vllm_sampler import VLLMSampler

TOKEN = "vllm-serving-token"
QUESTION = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Name three colours of the rainbow."}]
AGENT_QUESTION = [  # a worked example: the call syntax the model continues when a call is forced
    {"role": "system", "content": 'You have a tool named search. Example:\nUser: What was Foo Corp revenue in 2021?\n'
                                  'Assistant: <tool_call>{"name": "search", "arguments": {"query": "Foo Corp revenue '
                                  '2021"}}</tool_call>'},
    {"role": "user", "content": "What was ACME's revenue in 2023?"}]
SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the reports",
                                           "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                          "required": ["query"]}}}


@dataclass
class Served:
    url: str
    vllm: str
    checkpoint: Path  # a LoRA adapter under the server's checkpoint directory
    full: Path  # a full model directory there
    wide: Path  # a LoRA adapter of a rank the servers cannot load

    def ask(self, request: dict, *, checkpoint: Path | None = None, name: str = "ft:test") -> httpx.Response:
        model = {"name": name, "base": VLLM_MODEL, "checkpoint_path": str(checkpoint) if checkpoint else None}
        return httpx.post(f"{self.url}/internal/v1/chat/completions", json={"request": request, "model": model},
                          headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/healthz", timeout=10).json()


@pytest.fixture(scope="module")
def smollm2():  # noqa: ANN201
    return load_model(VLLM_MODEL)


@pytest.fixture(scope="module")
def on_vllm(vllm_server: str, smollm2, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:  # noqa: ANN001
    root = tmp_path_factory.mktemp("vllm-serving")
    checkpoints = root / "checkpoints"
    checkpoint = adapter(smollm2, checkpoints / "ftjob-x" / "step-2", seed=11)
    full = checkpoints / "ftjob-full" / "step-1"
    shutil.copytree(smollm2.path, full)
    wide = wide_adapter(checkpoints / "ftjob-wide" / "step-1")
    settings = Settings(_env_file=None, data_dir=root / "data", checkpoint_dir=checkpoints, inference_backend="vllm",
                        vllm_urls=[vllm_server], inference_models=[VLLM_MODEL])
    settings.data_dir.mkdir(parents=True)
    # The front of a vLLM fleet holds tokenizers only: it runs where torch cannot be imported.
    with agent_rft_inference(settings, token=TOKEN, without_torch=True) as (url, _, _):
        yield Served(url, vllm_server, checkpoint, full, wide)


def wide_adapter(folder: Path) -> Path:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load_model(VLLM_MODEL).model, LoraConfig(r=32, lora_alpha=64, target_modules=["q_proj"]))
    model.save_pretrained(str(folder))
    return folder


def rollout_answer(vllm_url: str, smollm2, checkpoint: Path | None, *, tokens: int):  # noqa: ANN001, ANN201
    """One greedy rollout of the training engine sampled on vLLM, with `checkpoint` published as its policy."""
    config = EngineConfig(temperature=0.0, max_tokens_per_turn=tokens, max_tokens_per_rollout=tokens)
    sampler = VLLMSampler([vllm_url], model=VLLM_MODEL, config=config, adapter_prefix="parity")

    async def go():  # noqa: ANN202
        if checkpoint is not None:
            await sampler.publish_policy(1, checkpoint)
        engine = RolloutEngine(smollm2.model, smollm2.tokenizer, ChatFormatter(smollm2.tokenizer), None, config,
                               sampler=sampler)
        try:
            return (await engine.run([RolloutSpec(0, QUESTION, [], {}, seed=0)]))[0]
        finally:
            await sampler.release()

    return asyncio.run(go())


def test_parity_with_rollouts_sampled_on_the_same_vllm(on_vllm: Served, smollm2):  # noqa: ANN001
    """Greedy, the endpoint gives the text and token counts of a training rollout on the same fleet:
    for the base model and for a checkpoint whose adapter it loaded on demand."""
    answers = {}
    for checkpoint in (None, on_vllm.checkpoint):
        record = rollout_answer(on_vllm.vllm, smollm2, checkpoint, tokens=24)
        response = on_vllm.ask({"messages": QUESTION, "max_tokens": 24, "temperature": 0}, checkpoint=checkpoint)
        assert response.status_code == 200, response.text
        body = response.json()
        answers[checkpoint] = body["choices"][0]["message"]["content"]
        assert answers[checkpoint] == record.messages[-1]["content"]
        assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (record.prompt_tokens,
                                                                                      record.completion_tokens)
    assert len(set(answers[None])) > 5 and answers[None] != answers[on_vllm.checkpoint]  # the adapter is applied
    loaded = on_vllm.health()["adapters"]
    assert len(loaded) == 1 and loaded[0] in served(on_vllm.vllm)  # loaded on the server on demand


def test_streaming_gives_the_same_answer_and_tool_calls(on_vllm: Served):
    request = {"messages": QUESTION, "max_tokens": 24, "temperature": 0}
    whole = on_vllm.ask(request, checkpoint=on_vllm.checkpoint).json()["choices"][0]["message"]["content"]
    events = stream(on_vllm, {**request, "stream": True, "stream_options": {"include_usage": True}})
    assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]) == whole
    assert len([e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]) > 3  # token by token
    assert events[-1]["usage"]["completion_tokens"] == 24
    # A call forced by name (whether SmolLM2 calls on its own depends on the CPU's kernels): streamed,
    # it is the call the whole answer holds, in OpenAI's shape, whatever arguments the model wrote.
    called = {"messages": AGENT_QUESTION, "max_tokens": 40, "temperature": 0, "tools": [SEARCH],
              "tool_choice": {"type": "function", "function": {"name": "search"}}}
    answer = on_vllm.ask(called).json()["choices"][0]
    assert answer["finish_reason"] == "tool_calls", answer
    (call,) = answer["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "search"
    assert isinstance(json.loads(call["function"]["arguments"]), dict)
    events = stream(on_vllm, {**called, "stream": True}, checkpoint=None)
    calls = [c["delta"]["tool_calls"] for e in events for c in e["choices"] if c["delta"].get("tool_calls")]
    assert [(d[0]["function"]["name"], d[0]["function"]["arguments"]) for d in calls] == [
        ("search", call["function"]["arguments"])]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any("<tool_call>" in (c["delta"].get("content") or "") for e in events for c in e["choices"])


def stream(on_vllm: Served, request: dict, checkpoint: Path | None | bool = True) -> list[dict]:
    checkpoint = on_vllm.checkpoint if checkpoint is True else checkpoint
    model = {"name": "ft:test", "base": VLLM_MODEL, "checkpoint_path": str(checkpoint) if checkpoint else None}
    with httpx.stream("POST", f"{on_vllm.url}/internal/v1/chat/completions", json={"request": request, "model": model},
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_an_adapter_the_server_lost_is_loaded_again(on_vllm: Served):
    """A vLLM server that restarted no longer has the adapters it was given: the next request loads
    the checkpoint's adapter again and is answered."""
    request = {"messages": QUESTION, "max_tokens": 8, "temperature": 0}
    first = on_vllm.ask(request, checkpoint=on_vllm.checkpoint)
    assert first.status_code == 200
    (name,) = on_vllm.health()["adapters"]
    httpx.post(f"{on_vllm.vllm}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30).raise_for_status()
    assert name not in served(on_vllm.vllm)
    again = on_vllm.ask(request, checkpoint=on_vllm.checkpoint)
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
    assert on_vllm.health()["reloads"] == 1 and name in served(on_vllm.vllm)


def test_what_vllm_cannot_serve_is_a_clear_error(on_vllm: Served):
    request = {"messages": QUESTION, "max_tokens": 4}
    full = on_vllm.ask(request, checkpoint=on_vllm.full)
    assert full.status_code == 400 and full.json()["error"]["code"] == "model_not_supported"
    assert "AGENT_RFT_INFERENCE_BACKEND=engine" in full.json()["error"]["message"]
    gone = on_vllm.ask(request, checkpoint=on_vllm.checkpoint.parent / "step-9")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "checkpoint_files_missing"
    wide = on_vllm.ask(request, checkpoint=on_vllm.wide)  # rank 32: over the servers' --max-lora-rank 16
    assert wide.status_code == 503 and wide.json()["error"]["code"] == "vllm_error"
    assert "rank" in wide.json()["error"]["message"].lower()
    long = on_vllm.ask({"messages": [{"role": "user", "content": "word " * 5000}], "max_tokens": 4})
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    assert "4096" in long.json()["error"]["message"]  # the fleet's window (--max-model-len), not the model's


def test_an_inference_server_whose_vllm_does_not_answer_does_not_start(tmp_path: Path):
    dead = f"http://127.0.0.1:{free_port()}"
    env = {"AGENT_RFT_WORKER_TOKEN": TOKEN, "AGENT_RFT_INFERENCE_BACKEND": "vllm", "AGENT_RFT_VLLM_URLS": dead,
           "AGENT_RFT_INFERENCE_MODELS": VLLM_MODEL, "AGENT_RFT_DATA_DIR": str(tmp_path)}
    done = subprocess.run([str(Path(sys.executable).parent / "agent-rft"), "inference", "--port", str(free_port())],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"No vLLM server can sample {VLLM_MODEL}: {dead}" in done.stdout + done.stderr


def test_responses_on_the_vllm_backend_are_its_chat_completions(on_vllm: Served, settings: Settings):
    """The Responses API through an API whose inference server runs on vLLM: the greedy answer and a
    forced call are those of chat completions of the same conversation."""
    import openai

    from tests.conftest import live_server, make_project

    settings.inference_url, settings.inference_models = on_vllm.url, [VLLM_MODEL]
    settings.worker_token = type(settings.worker_token)(TOKEN)
    key = make_project(settings)["key"]
    forced = {"type": "function", "function": {"name": "search"}}
    tool = {"type": "function", "name": "search", "description": SEARCH["function"]["description"],
            "parameters": SEARCH["function"]["parameters"]}
    with live_server(settings) as base, openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0) as sdk:
        chat = sdk.chat.completions.create(model=VLLM_MODEL, messages=QUESTION, max_tokens=16, temperature=0)
        response = sdk.responses.create(model=VLLM_MODEL, instructions=QUESTION[0]["content"],
                                        input=QUESTION[1]["content"], max_output_tokens=16, temperature=0, store=False)
        chat_call = sdk.chat.completions.create(model=VLLM_MODEL, messages=AGENT_QUESTION, tools=[SEARCH],
                                                tool_choice=forced, max_tokens=60, temperature=0)
        called = sdk.responses.create(model=VLLM_MODEL, instructions=AGENT_QUESTION[0]["content"],
                                      input=AGENT_QUESTION[1]["content"], tools=[tool], max_output_tokens=60,
                                      tool_choice={"type": "function", "name": "search"}, temperature=0, store=False)
        schema = {"type": "object", "properties": {"colours": {"type": "array", "maxItems": 3, "items": {
            "type": "string", "maxLength": 12}}}, "required": ["colours"], "additionalProperties": False}
        structured = sdk.responses.create(model=VLLM_MODEL, input=QUESTION[1]["content"], max_output_tokens=80,
                                          temperature=0, store=False, text={"format": {
                                              "type": "json_schema", "name": "colours", "strict": True, "schema": schema}})
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.output_tokens == chat.usage.completion_tokens
    # vLLM enforces the format itself (its own structured outputs)
    assert structured.status == "completed", structured.output_text
    jsonschema.validate(json.loads(structured.output_text), schema)
    [expected] = chat_call.choices[0].message.tool_calls
    [call] = [item for item in called.output if item.type == "function_call"]
    assert (call.name, call.arguments) == (expected.function.name, expected.function.arguments)
