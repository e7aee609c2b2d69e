"""OpenTelemetry spans of a real training run (workers/spans.py), read from the SDK's in-memory
exporter: a span per step, per rollout (its trace id is the rollout's trace_id), per tool call and
per grader call; the tool server's `traceparent` names the tool call's span, so a customer's
tool-server spans join the rollout's trace. Off unless configured."""

from __future__ import annotations

import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agent_rft.tracing import w3c_trace_id
from tests.rl.policies import ScriptedPolicy
from tests.rl.test_trainer import RecordingHooks, config, rows, train
from tests.rl.tool_server import tool_server
from workers import spans
from workers.models.loading import load_model
from workers.models.registry import LoadedModel
from workers.engine.rollout import EngineConfig

CALL = '<tool_call>{"name": "search", "arguments": {"query": "acme revenue"}}</tool_call>'


def scripted_caller() -> LoadedModel:
    tokenizer = load_model("tiny-smollm2").tokenizer
    policy = ScriptedPolicy(tokenizer, {"caller": [CALL, "done"]})
    return LoadedModel(policy, tokenizer, "scripted", torch.device("cpu"), torch.float32, None, "")


def test_a_run_exports_step_rollout_tool_and_grader_spans_joined_to_the_tool_servers_trace(tmp_path):
    exporter = InMemorySpanExporter()
    provider = TracerProvider(id_generator=spans.id_generator())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    spans.install(provider)
    try:
        hooks = RecordingHooks()
        cfg = config(training_mode="full", batch_size=2, group_size=2, eval_samples=2,
                     engine=EngineConfig(max_tokens_per_turn=64, max_tokens_per_rollout=128))
        with tool_server() as (url, recorder):
            outcome, _ = train(tmp_path, url, cfg, rows(2, "x", script="caller"), hooks, loaded=scripted_caller())
    finally:
        spans.install(None)
    # The scripted policy has no weights to save: the run fails at its checkpoint, after its step
    # and its evaluation, which is all this test needs.
    assert hooks.steps() == [1] and "save_pretrained" in outcome.error["message"]
    finished = exporter.get_finished_spans()
    by_name: dict[str, list] = {}
    for span in finished:  # "tool call search" counts as a "tool call"
        by_name.setdefault("tool call" if span.name.startswith("tool call ") else span.name, []).append(span)
    steps = by_name["training step"]
    assert [s.attributes["agent_rft.step"] for s in steps] == [1]
    rollouts = {s.attributes["agent_rft.trace_id"]: s for s in by_name["rollout"]}
    trained = {r["trace_id"] for r in hooks.train_records[0]}
    assert trained <= set(rollouts) and len(rollouts) == 2 * 2 + 2  # the step's rollouts and the eval's
    for trace_id, rollout in rollouts.items():
        assert format(rollout.context.trace_id, "032x") == w3c_trace_id(trace_id)  # the rollout's own trace
        assert rollout.parent is None
        assert [link.context.span_id for link in rollout.links] == [steps[0].context.span_id]  # sampled by step 1
    calls = by_name["tool call"]
    assert len(calls) == len(rollouts) and all(c.attributes["agent_rft.tool"] == "search" for c in calls)
    by_span = {c.context.span_id: c for c in calls}
    for call in calls:
        parent = next(r for r in rollouts.values() if r.context.span_id == call.parent.span_id)
        assert call.context.trace_id == parent.context.trace_id
    # The tool server saw a traceparent naming the rollout's trace and the tool call's span.
    for entry in recorder.calls:
        _, trace_hex, parent_span, _ = entry["headers"]["traceparent"].split("-")
        assert trace_hex == w3c_trace_id(entry["body"]["trace_id"])
        assert int(parent_span, 16) in by_span
    graders = by_name["grader call"]
    assert {g.parent.span_id for g in graders} <= {r.context.span_id for r in rollouts.values()}
    assert len(graders) == len(rollouts) and all(g.attributes["agent_rft.grader"] == "string_check" for g in graders)


def test_spans_are_off_unless_configured(tmp_path):
    assert spans.current_span_id("trace_" + "a" * 32) is None
    with spans.rollout_span("trace_" + "a" * 32, 0) as span, spans.tool_call_span("search") as call:
        assert span is None and call is None
