"""DPO on the worker: preference rows rendered as supervised rows are (only the answer carries
loss), the reference is the starting model (the loss starts at log 2, also when the job continues a
fine-tuned adapter), the loss falls as the policy learns the preference, and the shared lifecycle
(checkpoints, pause, resume) holds."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.rl.test_trainer import RecordingHooks
from workers.methods.dpo.data import pairs_from_rows
from workers.methods.dpo.hyperparameters import DpoConfig, resolve_dpo
from workers.methods.dpo.trainer import DpoTrainer
from workers.models.loading import load_model
from workers.models.lora import load_start
from workers.engine.prompting import ChatFormatter
from workers.methods.supervised.data import BadExample, render_example
from workers.methods.supervised.hyperparameters import SupervisedConfig
from workers.methods.supervised.trainer import SupervisedTrainer

TINY = "tiny-smollm2"
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object",
                                                                            "properties": {"query": {"type": "string"}}}}}


def call(query: str, n: int = 1) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{n}", "type": "function", "function": {"name": "search", "arguments": json.dumps({"query": query})}}]}


def pair_row(i: int, *, old_names: bool = False) -> dict:
    """After a search result that holds the figure: answer now (preferred) or search again."""
    context = [{"role": "user", "content": f"What was item {i}'s revenue?"}, call(f"item {i} revenue"),
               {"role": "tool", "tool_call_id": "call_1", "content": f"Item {i}: revenue ${i}.5 million."}]
    answer = {"role": "assistant", "content": f"Item {i}'s revenue was ${i}.5 million."}
    names = ("preferred_completion", "non_preferred_completion") if old_names else \
        ("preferred_output", "non_preferred_output")
    return {"input": {"messages": context, "tools": [SEARCH]}, names[0]: [answer],
            names[1]: [call(f"item {i} annual report", 2)]}


@pytest.fixture(scope="module")
def tiny():  # noqa: ANN201
    return load_model(TINY)


def test_each_answer_is_rendered_after_the_conversation_and_only_it_carries_loss(tiny):  # noqa: ANN001
    formatter = ChatFormatter(tiny.tokenizer)
    row = pair_row(3)
    (pair,) = pairs_from_rows([row], formatter, max_tokens=4096, source="training").pairs
    for sequence, answer in ((pair.chosen, row["preferred_output"][0]), (pair.rejected, row["non_preferred_output"][0])):
        messages = [{**m, "weight": 0} if m["role"] == "assistant" else m for m in row["input"]["messages"]]
        ids, mask = render_example(formatter, {"messages": [*messages, answer], "tools": [SEARCH]})
        assert sequence.token_ids == ids  # exactly as a supervised row (and so a rollout) renders it
        first = mask.index(1)
        assert sum(mask) and all(mask[first:first + sum(mask)])  # one span: the answer, not the earlier call
        assert tiny.tokenizer.decode(ids[first:first + sum(mask)]).startswith(
            "Item 3" if answer.get("content") else "<tool_call>")
    (renamed,) = pairs_from_rows([pair_row(3, old_names=True)], formatter, max_tokens=4096, source="training").pairs
    assert renamed.chosen.token_ids == pair.chosen.token_ids and renamed.rejected.token_ids == pair.rejected.token_ids
    short = pairs_from_rows([row], formatter, max_tokens=len(pair.chosen.token_ids) - 2, source="training")
    assert short.truncated == 1
    bad = {**row, "input": {"messages": [{"role": "user", "content": {"not": "text"}}]}}
    with pytest.raises(BadExample, match="validation file, line 2"):
        pairs_from_rows([row, bad], formatter, max_tokens=4096, source="validation")


def test_auto_hyperparameters_resolve_with_beta():
    dpo = SimpleNamespace(hyperparameters=SimpleNamespace(batch_size="auto", n_epochs="auto", beta="auto",
                                                          learning_rate_multiplier=2),
                          x_open_model=SimpleNamespace(learning_rate=None, eval_interval=None, training_mode="lora",
                                                       lora_rank=8, lora_alpha=16, max_seq_tokens=512))
    config, resolved = resolve_dpo(dpo, n_train=20, seed=1)
    assert resolved == {"batch_size": 8, "n_epochs": 10, "learning_rate_multiplier": 2.0, "beta": 0.1}
    assert config.beta == 0.1 and config.learning_rate == pytest.approx(1e-4)


def trainer(tmp_path: Path, hooks: RecordingHooks, resume_state: Path | None = None, loaded=None,  # noqa: ANN001
            **options) -> DpoTrainer:  # noqa: ANN003
    config = DpoConfig(**{"batch_size": 4, "n_epochs": 3, "learning_rate": 1e-2, "eval_interval": 3, "beta": 0.5,
                          "training_mode": "lora", "lora_rank": 8, "lora_alpha": 16, **options})
    return DpoTrainer(loaded=loaded or load_model(TINY), config=config, train_rows=[pair_row(i) for i in range(8)],
                      valid_rows=[pair_row(i) for i in range(8, 11)], work_dir=tmp_path, hooks=hooks,
                      resume_state=resume_state)


def test_dpo_learns_the_preference_from_the_starting_model_and_checkpoints(tmp_path):
    hooks = RecordingHooks(keep_checkpoints=2)
    outcome = asyncio.run(trainer(tmp_path, hooks).run())
    assert outcome.status == "succeeded" and outcome.completed_steps == 6, hooks.events
    first, last = hooks.metrics[0], hooks.metrics[-1]
    # The reference is the starting model: before the first update, policy and reference agree.
    assert first["train_loss"] == pytest.approx(math.log(2), abs=1e-4) and first["train_reward_margin"] == \
        pytest.approx(0, abs=1e-4)
    assert first["train_preference_accuracy"] == 0  # ties are no preference
    assert last["train_loss"] < 0.5 * first["train_loss"] and last["train_preference_accuracy"] == 1
    evaluated = [m for m in hooks.metrics if "valid_loss" in m]
    assert [m["step"] for m in evaluated] == [3, 6] and evaluated[1]["valid_loss"] < evaluated[0]["valid_loss"]
    assert evaluated[1]["valid_logprob_margin"] > evaluated[0]["valid_logprob_margin"]
    assert "full_valid_preference_accuracy" in last and "full_valid_loss" not in hooks.metrics[-2]
    assert [p.name for p in hooks.checkpoints] == ["step-3", "step-6"]
    assert (outcome.final_checkpoint / "adapter_config.json").is_file()


def test_a_dpo_job_continuing_an_adapter_takes_that_adapter_as_its_reference(tmp_path):
    sft = SupervisedTrainer(loaded=load_model(TINY), config=SupervisedConfig(
        batch_size=4, n_epochs=2, learning_rate=3e-2, eval_interval=2, lora_rank=8, lora_alpha=16),
        train_rows=[{"messages": [*pair_row(i)["input"]["messages"], pair_row(i)["preferred_output"][0]]}
                    for i in range(4)], valid_rows=[], work_dir=tmp_path / "sft", hooks=RecordingHooks())
    adapter = asyncio.run(sft.run()).final_checkpoint
    start = SimpleNamespace(checkpoint_path=str(adapter), training_mode="lora", base_model=TINY)
    loaded, _ = load_start("ft:tiny", start, dtype="auto", training_mode="lora")
    hooks = RecordingHooks()
    asyncio.run(trainer(tmp_path / "dpo", hooks, loaded=loaded, n_epochs=1).run())
    # Against the base model (the adapter switched off) the margin would not start at zero.
    assert hooks.metrics[0]["train_loss"] == pytest.approx(math.log(2), abs=1e-4)


def test_a_paused_dpo_run_resumes_where_it_stopped(tmp_path):
    whole = RecordingHooks()
    asyncio.run(trainer(tmp_path / "whole", whole, n_epochs=1).run())
    first = RecordingHooks(["continue", "pause"])
    paused = asyncio.run(trainer(tmp_path / "split", first, n_epochs=1).run())
    assert paused.status == "paused" and paused.completed_steps == 1
    second = RecordingHooks()
    resumed = asyncio.run(trainer(tmp_path / "split", second, n_epochs=1,
                                  resume_state=tmp_path / "split" / "state").run())
    assert resumed.status == "succeeded"
    split = [m["train_loss"] for m in first.metrics + second.metrics]
    assert split == pytest.approx([m["train_loss"] for m in whole.metrics], rel=1e-4)
