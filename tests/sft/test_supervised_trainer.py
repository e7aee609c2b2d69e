"""Supervised fine-tuning on the worker: OpenAI chat rows rendered exactly as rollouts render them,
the loss on the assistant tokens a rollout samples, and the shared lifecycle (checkpoints, pause,
resume from the saved state)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.rl.test_trainer import RecordingHooks
from workers.models.loading import load_model
from workers.engine.prompting import ChatFormatter
from workers.engine.toolcalls import as_tool_schemas
from workers.methods.supervised.data import examples_from_rows, render_example
from workers.methods.supervised.hyperparameters import SupervisedConfig, auto_epochs
from workers.methods.supervised.trainer import SupervisedTrainer

TINY = "tiny-smollm2"  # SmolLM2's tokenizer and chat template, random weights: quick to train
SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the reports",
                                           "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": json.dumps({"query": "ACME 2023"})}}
BROWSING = {"tools": [SEARCH], "messages": [
    {"role": "system", "content": "You answer questions about company reports."},
    {"role": "user", "content": "What was ACME's revenue in 2023?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "ACME 2023 annual report: revenue $12.5 million."},
    {"role": "assistant", "content": "ACME's revenue in 2023 was $12.5 million."},
    {"role": "user", "content": "Thanks!"},
]}


@pytest.fixture(scope="module")
def tiny():  # noqa: ANN201
    return load_model(TINY)


def test_a_row_is_rendered_as_a_rollout_and_the_loss_covers_what_the_model_samples(tiny):  # noqa: ANN001
    formatter = ChatFormatter(tiny.tokenizer)
    ids, mask = render_example(formatter, BROWSING)
    # The text is the rollout engine's rendering of the conversation up to its last assistant turn.
    assert formatter.decode(ids) == formatter.render(BROWSING["messages"][:5], BROWSING["tools"],
                                                     add_generation_prompt=False)
    learned = _spans(ids, mask)
    call = '<tool_call>{"name": "search", "arguments": {"query": "ACME 2023"}}</tool_call>'
    # The call turn ends on the parser's stop string (generation stops there: no end-of-turn token to
    # learn); the answer turn learns the end-of-turn token that stops it.
    assert [formatter.decode(span) for span in learned] == [call, "ACME's revenue in 2023 was $12.5 million.<|im_end|>"]
    assert formatter.parser.parse(formatter.decode(learned[0]), as_tool_schemas([SEARCH])).calls[0].name == "search"
    quiet = {**BROWSING, "messages": [dict(m, weight=0) if (m.get("content") or "").startswith("ACME's") else m
                                      for m in BROWSING["messages"]]}
    assert [formatter.decode(s) for s in _spans(*render_example(formatter, quiet))] == [call]


def _spans(ids: list[int], mask: list[int]) -> list[list[int]]:
    spans, current = [], []
    for token, flag in zip(ids, mask):
        if flag:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    return spans + ([current] if current else [])


def test_rows_the_template_cannot_render_name_their_line_and_long_rows_are_truncated(tiny):  # noqa: ANN001
    formatter = ChatFormatter(tiny.tokenizer)
    rows = [BROWSING, {"messages": [{"role": "user", "content": "hi"}]}]
    with pytest.raises(ValueError, match="training file, line 2: the row has no assistant message"):
        examples_from_rows(rows, formatter, max_tokens=4096, source="training")
    examples = examples_from_rows([BROWSING, BROWSING], formatter, max_tokens=40, source="training")
    assert examples.truncated == 2 and all(len(s.token_ids) == 40 for s in examples.sequences)


def test_auto_epochs_see_about_300_examples():
    assert [auto_epochs(n) for n in (10, 80, 100, 1000)] == [10, 4, 3, 1]


ANSWERS = [f"The code for item {i} is {word}." for i, word in enumerate(["amber", "cobalt", "violet", "saffron"])]


def rows() -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"What is the code for item {i}?"},
                          {"role": "assistant", "content": answer}]} for i, answer in enumerate(ANSWERS)]


def trainer(tmp_path: Path, hooks: RecordingHooks, resume_state: Path | None = None,
            **options) -> SupervisedTrainer:  # noqa: ANN003
    """A run on a fresh model (LoRA wraps the model it is given)."""
    config = SupervisedConfig(**{"batch_size": 4, "n_epochs": 6, "learning_rate": 3e-2, "eval_interval": 3, "training_mode": "full",
                                 "lora_rank": 8, "lora_alpha": 16, **options})
    return SupervisedTrainer(loaded=load_model(TINY), config=config, train_rows=rows(), valid_rows=rows()[:2],
                             work_dir=tmp_path, hooks=hooks, resume_state=resume_state)


def test_supervised_training_lowers_the_loss_and_checkpoints_like_a_reinforcement_job(tmp_path):
    hooks = RecordingHooks(keep_checkpoints=2)
    outcome = asyncio.run(trainer(tmp_path, hooks).run())
    assert outcome.status == "succeeded" and outcome.completed_steps == 6, hooks.events
    losses = [m["train_loss"] for m in hooks.metrics]
    assert losses[-1] < 0.5 * losses[0], losses
    assert hooks.metrics[-1]["train_mean_token_accuracy"] > hooks.metrics[0]["train_mean_token_accuracy"]
    evaluated = [m for m in hooks.metrics if "valid_loss" in m]
    assert [m["step"] for m in evaluated] == [3, 6] and evaluated[1]["valid_loss"] < evaluated[0]["valid_loss"]
    assert "full_valid_loss" in hooks.metrics[-1] and "full_valid_loss" not in hooks.metrics[-2]
    assert [p.name for p in hooks.checkpoints] == ["step-3", "step-6"]
    assert (outcome.final_checkpoint / "config.json").is_file()  # full fine-tuning: a whole model


def test_a_paused_supervised_run_resumes_where_it_stopped(tmp_path):
    whole = RecordingHooks()
    asyncio.run(trainer(tmp_path / "whole", whole, n_epochs=3).run())
    first = RecordingHooks(["continue", "pause"])
    paused = asyncio.run(trainer(tmp_path / "split", first, n_epochs=3).run())
    assert paused.status == "paused" and paused.completed_steps == 1
    state = tmp_path / "split" / "state"
    second = RecordingHooks()
    resumed = asyncio.run(trainer(tmp_path / "split", second, n_epochs=3, resume_state=state).run())
    assert resumed.status == "succeeded"
    split = [m["train_loss"] for m in first.metrics + second.metrics]
    assert split == pytest.approx([m["train_loss"] for m in whole.metrics], rel=1e-4)
