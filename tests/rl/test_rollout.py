"""The rollout engine against a real HTTP tool server, with a scripted policy (the engine is
what is under test) and with real models for the token-level checks."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from tests.rl.policies import ScriptedPolicy
from tests.rl.tool_server import tool_server
from tests.rl.trained_adapter import MODEL, QUESTION, SEARCH, merged_policy
from workers.models.loading import load_model
from workers.engine.prompting import ChatFormatter
from workers.engine.rollout import EngineConfig, RolloutEngine, RolloutSpec
from workers.engine.toolcalls import ToolSchema
from workers.engine.tools_client import ToolClient, ToolClientOptions

TOOLS = [
    ToolSchema("search", "Search the reports", {"type": "object", "properties": {"query": {"type": "string"}},
                                                "required": ["query"]}),
    ToolSchema("cat", "Read a document", {"type": "object", "properties": {"path": {"type": "string"}},
                                          "required": ["path"]}),
    ToolSchema("broken", "Always fails", {"type": "object", "properties": {}}),
]


def call(name: str, **arguments) -> str:  # noqa: ANN003
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    return load_model("tiny-smollm2").tokenizer


def spec(i: int, script: str, item: dict | None = None) -> RolloutSpec:
    return RolloutSpec(sample_index=i, messages=[{"role": "user", "content": f"Question {i}. SCRIPT={script}"}],
                       tools=TOOLS, item=item or {"id": i}, seed=i)


def run(tokenizer, scripts, specs, url, *, config=None, latency_s=0.0, headers=None):  # noqa: ANN001, ANN201
    policy = ScriptedPolicy(tokenizer, scripts)
    endpoints = [{"name": t.name, "server_url": url, "headers": headers or {}} for t in TOOLS]

    async def go():  # noqa: ANN202
        async with ToolClient(endpoints, allowlist=["127.0.0.1"],
                              options=ToolClientOptions(backoff_base_s=0.01, backoff_max_s=0.02)) as client:
            engine = RolloutEngine(policy, tokenizer, ChatFormatter(tokenizer), client, config or EngineConfig())
            return await engine.run(specs), engine

    return asyncio.run(go())


def test_trace_ids_call_ids_item_and_headers(tokenizer):
    scripts = {"a": [call("search", query="revenue 2023"), call("cat", path="acme/2023/10k"), "The answer is 42."]}
    with tool_server() as (url, recorder):
        records, _ = run(tokenizer, scripts, [spec(i, "a", {"id": i, "answer": "42"}) for i in range(4)], url,
                         headers={"Authorization": "Bearer t0k"})
    assert [r.finish_reason for r in records] == ["answered"] * 4
    assert all(r.final_answer == "The answer is 42." for r in records)
    by_trace: dict[str, list[dict]] = {}
    for entry in recorder.calls:
        body = entry["body"]
        assert body["type"] == "function_call" and body["id"].startswith("fc_") and body["call_id"].startswith("call_")
        assert isinstance(body["arguments"], str) and entry["headers"]["authorization"] == "Bearer t0k"
        by_trace.setdefault(body["trace_id"], []).append(body)
    assert set(by_trace) == {r.trace_id for r in records}  # one trace id per rollout, all distinct
    for record in records:
        bodies = by_trace[record.trace_id]
        assert [b["name"] for b in bodies] == ["search", "cat"]
        assert all(b["item"] == {"id": record.sample_index, "answer": "42"} for b in bodies)
        assert [c.call_id for c in record.tool_calls] == [b["call_id"] for b in bodies]
        assert record.calls_by_tool() == {"search": 1, "cat": 1}
        assert "search result for" in record.messages[2]["content"]
    assert len({b["call_id"] for b in (e["body"] for e in recorder.calls)}) == len(recorder.calls)


def graded_finish(record) -> tuple[str, str]:  # noqa: ANN001
    """(the finish reason a grader's sample gives, in OpenAI's words; the rollout's own, kept beside it)."""
    choice = record.grader_sample()["choices"][0]
    return choice["finish_reason"], choice["x_finish_reason"]


def test_tool_budget_is_enforced_and_announced(tokenizer):
    scripts = {"greedy": [call("search", query=f"q{i}") for i in range(6)]}
    with tool_server() as (url, recorder):
        records, _ = run(tokenizer, scripts, [spec(0, "greedy")], url, config=EngineConfig(max_episode_steps=2))
    record = records[0]
    assert record.finish_reason == "tool_budget"
    assert graded_finish(record) == ("tool_calls", "tool_budget")
    assert len(recorder.calls) == 2 and len(record.tool_calls) == 2
    notice = [m["content"] for m in record.messages if m["role"] == "user" and "used all your tool calls" in m["content"]]
    # The notice repeats the question, so a small model answers it rather than the tool output.
    assert len(notice) == 1 and notice[0].endswith("The question: " + record.messages[0]["content"])


def test_next_turns_after_staggered_tool_calls_share_one_batch(tokenizer):
    # Tool results come back 10-160 ms apart; the batcher waits for every live rollout (at most
    # batch_wait_s) instead of starting a batch per returning rollout.
    delays = (10, 60, 110, 160)
    scripts = {f"w{ms}": [call("search", query=f"wait {ms}"), "Done."] for ms in delays}
    with tool_server() as (url, recorder):
        records, engine = run(tokenizer, scripts, [spec(i, f"w{ms}") for i, ms in enumerate(delays)], url,
                              config=EngineConfig(batch_wait_s=5.0))
    assert [r.finish_reason for r in records] == ["answered"] * 4 and len(recorder.calls) == 4
    assert engine.prefill_rows == [4, 4]


def test_budget_notice_repeats_a_long_question_cut_short():
    from workers.engine.prompting import QUESTION_ECHO_CHARS, budget_spent_message

    short = budget_spent_message([{"role": "system", "content": "sys"}, {"role": "user", "content": " What was X? "}])
    assert short == "You have used all your tool calls. Answer now, without calling tools. The question: What was X?"
    long = budget_spent_message([{"role": "user", "content": "why " * 400}])
    assert long.endswith("…") and len(long) < QUESTION_ECHO_CHARS + 100
    assert budget_spent_message([{"role": "user", "content": [{"type": "text", "text": "x"}]}]).endswith("tools.")


def test_client_errors_reach_the_model_and_server_errors_end_the_rollout(tokenizer):
    scripts = {"recover": [call("search", query="bad"), call("search", query="good query"), "Done."],
               "fail": [call("broken"), "never reached"]}
    with tool_server() as (url, recorder):
        records, _ = run(tokenizer, scripts, [spec(0, "recover"), spec(1, "fail")], url)
    recover, fail = records
    assert recover.finish_reason == "answered"
    assert recover.tool_calls[0].status == "client_error" and recover.tool_calls[0].status_code == 400
    assert "query too short" in recover.messages[2]["content"]
    assert fail.finish_reason == "tool_failure" and fail.tool_calls[0].status == "failed"
    assert graded_finish(recover) == ("stop", "answered") and graded_finish(fail) == ("tool_calls", "tool_failure")
    assert sum(1 for e in recorder.calls if e["body"]["name"] == "broken") == 4  # 1 + 3 retries


def test_parse_errors_are_fed_back_then_end_the_rollout(tokenizer):
    scripts = {"fix": ['<tool_call>{"name": "search", "arguments": {"query": 5}}</tool_call>',
                       call("search", query="revenue"), "Fine."],
               "junk": ["<tool_call>{oops</tool_call>"] * 5}
    with tool_server() as (url, recorder):
        records, _ = run(tokenizer, scripts, [spec(0, "fix"), spec(1, "junk")], url)
    fixed, junk = records
    assert fixed.finish_reason == "answered" and fixed.parse_errors == 1 and len(fixed.tool_calls) == 1
    assert "query" in fixed.messages[2]["content"]  # the feedback names the bad argument
    assert junk.finish_reason == "parse_error" and junk.parse_errors == 3 and junk.tool_calls == []
    assert graded_finish(junk) == ("stop", "parse_error")


def test_token_cap_and_context_overflow(tokenizer):
    long_answer = "word " * 400
    scripts = {"long": [long_answer], "tools": [call("search", query="x" * 50)] * 20}
    with tool_server() as (url, _):
        capped, _ = run(tokenizer, scripts, [spec(0, "long")], url,
                        config=EngineConfig(max_tokens_per_turn=64, max_tokens_per_rollout=100))
        capped_total, _ = run(tokenizer, {"long": [call("search", query="y" * 30)] * 20}, [spec(2, "long")], url,
                              config=EngineConfig(max_tokens_per_rollout=100, max_episode_steps=50))
        overflow, _ = run(tokenizer, scripts, [spec(1, "tools")], url,
                          config=EngineConfig(max_context_tokens=700, max_episode_steps=50))
    assert capped[0].finish_reason == "token_cap" and capped[0].completion_tokens == 64  # the per-turn cap
    assert capped_total[0].finish_reason == "token_cap" and capped_total[0].completion_tokens == 100
    assert overflow[0].finish_reason == "truncated" and len(overflow[0].token_ids) <= 700
    assert graded_finish(capped[0]) == ("length", "token_cap") and graded_finish(overflow[0]) == ("length", "truncated")


def test_loss_mask_marks_exactly_the_sampled_tokens(tokenizer):
    turns = [call("search", query="acme revenue"), call("cat", path="acme/2023"), "Revenue was 412.5."]
    with tool_server() as (url, _):
        records, _ = run(tokenizer, {"m": turns}, [spec(0, "m")], url)
    record = records[0]
    assert len(record.token_ids) == len(record.loss_mask) == len(record.logprobs)
    sampled = [t for t, m in zip(record.token_ids, record.loss_mask) if m]
    assert sampled.count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 1  # only the final answer's own end
    text = tokenizer.decode(sampled)
    assert text == "".join(turns) + "<|im_end|>"
    context = tokenizer.decode([t for t, m in zip(record.token_ids, record.loss_mask) if not m])
    assert "cat result for" in context and "search result for" in context and "SCRIPT=m" in context
    # Spans: each assistant turn is one run of 1s, everything else 0s.
    runs = sum(1 for i, m in enumerate(record.loss_mask) if m and (i == 0 or not record.loss_mask[i - 1]))
    assert runs == 3
    assert record.completion_tokens == len(sampled) and record.tool_output_tokens > 0
    # Token-in/token-out: the sequence decodes to the rendered conversation.
    rendered = ChatFormatter(tokenizer).render(record.messages, TOOLS, add_generation_prompt=False)
    assert tokenizer.decode(record.token_ids) == rendered


def test_generation_is_batched_while_tools_run_concurrently(tokenizer):
    scripts = {"two": [call("search", query="alpha"), call("cat", path="b"), "ok"]}
    n = 12
    with tool_server(latency_s=0.3) as (url, recorder):
        records, engine = run(tokenizer, scripts, [spec(i, "two") for i in range(n)], url)
    assert all(r.finish_reason == "answered" for r in records)
    assert len(recorder.calls) == 2 * n
    assert recorder.max_in_flight() == n  # every rollout's call was in flight at once
    assert engine.largest_batch == n  # and every rollout's turn shared one generation batch


def test_sampled_logprobs_match_a_forward_pass_on_a_real_model():
    from workers.engine.generation import sequence_logprobs

    loaded = load_model("tiny-smollm2")
    with tool_server() as (url, _):
        async def go():  # noqa: ANN202
            async with ToolClient([{"name": "search", "server_url": url}], allowlist=["127.0.0.1"]) as client:
                engine = RolloutEngine(loaded.model, loaded.tokenizer, ChatFormatter(loaded.tokenizer), client,
                                       EngineConfig(max_tokens_per_turn=24, max_tokens_per_rollout=24))
                specs = [RolloutSpec(i, [{"role": "user", "content": "hi " * (i * 3 + 1)}], TOOLS[:1], {}, seed=i)
                         for i in range(3)]
                return await engine.run(specs)

        records = asyncio.run(go())
    for record in records:
        recomputed = sequence_logprobs(loaded.model, record.token_ids)
        for i, (mask, sampled) in enumerate(zip(record.loss_mask, record.logprobs)):
            if mask:
                assert abs(recomputed[i] - sampled) < 1e-3, (i, recomputed[i], sampled)


def test_under_a_response_format_the_trainer_scores_the_distribution_the_sampler_drew_from():
    """A job's JSON answer format masks each sampled token's distribution; the trainer's log-probs
    (the update's own collate and token_logprobs) are taken under the same masks, so they equal the
    sampler's, where the unmasked model's are larger in magnitude: the PPO ratio starts at 1."""
    import torch

    from workers.training.sequences import TrainSequence, collate, token_logprobs

    loaded = load_model("tiny-smollm2", dtype="float32")
    answer_format = {"type": "json_schema", "json_schema": {"name": "a", "strict": True, "schema": {
        "type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}}, "required": ["answer"],
        "additionalProperties": False}}}
    with tool_server() as (url, _):
        async def go():  # noqa: ANN202
            async with ToolClient([{"name": "search", "server_url": url}], allowlist=["127.0.0.1"]) as client:
                engine = RolloutEngine(loaded.model, loaded.tokenizer, ChatFormatter(loaded.tokenizer), client,
                                       EngineConfig(max_tokens_per_turn=24, max_tokens_per_rollout=24,
                                                    sampling_weights=False, response_format=answer_format))
                specs = [RolloutSpec(i, [{"role": "user", "content": "hi " * (i + 1)}], TOOLS[:1], {}, seed=i)
                         for i in range(3)]
                return await engine.run(specs)

        records = asyncio.run(go())
    assert all(len(r.allowed) == r.completion_tokens > 0 for r in records)
    for record in records:  # random weights, held to the format: every answer that ended is JSON that fits
        if record.finish_reason == "answered":
            assert record.grader_sample()["output_json"] == json.loads(record.final_answer)
            jsonschema.validate(json.loads(record.final_answer), answer_format["json_schema"]["schema"])
    sequences = [TrainSequence.from_record(r, 1.0) for r in records]
    collated = collate(sequences, 0, torch.device("cpu"))
    with torch.no_grad():
        trained = token_logprobs(loaded.model, collated, 1.0)[collated.loss_mask]
        unmasked = token_logprobs(loaded.model, collate([TrainSequence(s.token_ids, s.loss_mask, s.sampling_logprobs,
                                                                       1.0) for s in sequences], 0,
                                                        torch.device("cpu")), 1.0)[collated.loss_mask]
    sampled = collated.sampling_logprobs[collated.loss_mask]
    assert (trained - sampled).abs().max() < 1e-3
    assert (unmasked - sampled).abs().max() > 0.1  # without the masks, the ratio would be off


def test_smollm2_calls_a_real_tool_and_its_logprobs_match_a_forward_pass(tool_calling_adapter):  # noqa: ANN001
    """The real 135M model, with an adapter trained to search (tests/rl/trained_adapter.py), calls the
    real tool server in its sampled rollouts and continues after the result; the multi-turn record
    keeps exact log-probs."""
    from workers.engine.generation import sequence_logprobs

    loaded = load_model(MODEL)
    policy = merged_policy(tool_calling_adapter)
    with tool_server() as (url, recorder):
        async def go():  # noqa: ANN202
            async with ToolClient([{"name": "search", "server_url": url}], allowlist=["127.0.0.1"]) as client:
                engine = RolloutEngine(policy, loaded.tokenizer, ChatFormatter(loaded.tokenizer), client,
                                       EngineConfig(max_tokens_per_turn=40, max_tokens_per_rollout=100,
                                                    max_episode_steps=1, temperature=0.7))
                return await engine.run([RolloutSpec(i, QUESTION, [SEARCH], {"answer": "412.5"}, seed=i)
                                         for i in range(8)])

        records = asyncio.run(go())
    callers = [r for r in records if r.tool_calls]
    assert len(callers) >= 6, [r.messages[-1] for r in records]  # the adapter's call: p > 0.99 at every token
    assert {e["body"]["trace_id"] for e in recorder.calls} == {r.trace_id for r in callers}
    for record in callers:
        assert record.tool_calls[0].status == "ok" and json.loads(record.tool_calls[0].arguments)["query"]
        assert any(m["role"] == "tool" and "search result for" in m["content"] for m in record.messages)
        assert record.turns >= 2 and record.loss_mask.count(1) == record.completion_tokens
        recomputed = sequence_logprobs(policy, record.token_ids, temperature=0.7)
        worst = max(abs(recomputed[i] - lp) for i, (m, lp) in enumerate(zip(record.loss_mask, record.logprobs)) if m)
        assert worst < 2e-3, worst


def test_kept_caches_spare_prefill_tokens_within_their_memory_bound(tokenizer):
    # Three turns per rollout: with caches kept, turns 2 and 3 prefill only their new tokens; with no
    # room (0 MB) or too little (the scripted policy caches 8 bytes a token: 5 KB holds about one
    # rollout's), a turn re-prefills its whole context. The rollouts are the same token
    # for token either way. (Distinct prompts: identical contexts would be prefilled once anyway.)
    scripts = {f"m{k}": [call("search", query=f"alpha {k}"), call("cat", path=f"b{k}"), "ok"] for k in range(4)}
    specs = [spec(k, f"m{k}") for k in range(4)]
    runs = {}
    with tool_server() as (url, _):
        for label, megabytes in (("kept", 512.0), ("none", 0.0), ("tight", 0.005)):
            runs[label] = run(tokenizer, scripts, specs, url, config=EngineConfig(kv_cache_mb=megabytes))
    records = {label: [r.token_ids for r in recs] for label, (recs, _) in runs.items()}
    assert records["kept"] == records["none"] == records["tight"]
    rollouts = runs["kept"][0]
    assert all(r.finish_reason == "answered" and r.turns == 3 for r in rollouts)
    spans = [r.sampled_spans() for r in rollouts]  # (start, end) of each turn's sampled tokens
    full_contexts = sum(start for turns in spans for start, _ in turns)
    # With a kept cache a turn feeds what follows the previous turn's last fed token.
    new_tokens = sum(start - (end - 1) for turns in spans for (_, end), (start, _) in zip(turns, turns[1:]))
    kept, none, tight = (runs[label][1].prefill_tokens for label in ("kept", "none", "tight"))
    assert none == full_contexts
    assert kept == sum(r.prompt_tokens for r in rollouts) + new_tokens
    assert kept < tight < none



def test_a_rollout_deadline_cancels_a_slow_tool_call_and_stops_further_turns(tokenizer):
    """x_open_model.rollout_timeout: a call still running at the deadline is cancelled (a tool
    failure, recorded as such); a rollout past it after a turn stops there (`deadline`)."""
    scripts = {"busy": [call("search", query="wait 10"), call("search", query="wait 10"), "Done."],
               "slow": [call("search", query="wait 3000"), "never reached"]}
    config = EngineConfig(rollout_timeout_s=1.0, batch_wait_s=10.0)  # busy's 2nd turn waits for slow's batch
    with tool_server() as (url, recorder):
        records, _ = run(tokenizer, scripts, [spec(0, "busy"), spec(1, "slow")], url, config=config)
    busy, slow = records
    assert slow.finish_reason == "tool_failure" and slow.tool_failure
    assert slow.tool_calls[0].status == "failed" and "deadline of 1 s" in slow.tool_calls[0].error
    assert 1.0 <= slow.wall_time_s < 2.5  # not the tool's 3 s
    assert busy.finish_reason == "deadline" and len(busy.tool_calls) == 1  # its 2nd call was never sent
    assert sum(1 for e in recorder.calls if e["body"]["trace_id"] == busy.trace_id) == 1
