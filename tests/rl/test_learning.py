"""RL learns: on a toy task the tiny model's mean reward rises clearly within a few steps.

The task: every row asks for a one-word answer and carries a target word; the grader
(string_check `like`) gives 1 when the answer contains it. The target is a word the tiny
random model says first only rarely (a few percent of rollouts at temperature 0.06), so the
first step scores near 0 and only the policy gradient can raise it. Everything is real: the
rollout engine with the tool instructions in the prompt and a tool server over HTTP, the
grader, LoRA (rank 8) and the optimizer. Seeded, so the curve is the same on every run; it
takes a few seconds on 2 CPU cores (the budget asserted is two minutes)."""

from __future__ import annotations

import time

import pytest
from pydantic import TypeAdapter

from agent_rft.graders.schemas import Grader
from tests.rl.test_trainer import RecordingHooks, rows, target_word, tools_url, train  # noqa: F401 - fixtures
from workers.engine.rollout import EngineConfig
from workers.methods.reinforcement.hyperparameters import TrainingConfig

STEPS = 8


def test_mean_reward_rises_on_a_toy_task(tmp_path, tools_url, target_word):  # noqa: F811 - fixtures
    grader = TypeAdapter(Grader).validate_python({
        "type": "string_check", "name": "says the word", "input": "{{sample.output_text}}",
        "reference": "{{item.target}}", "operation": "like"})
    config = TrainingConfig(
        batch_size=8, n_epochs=STEPS, group_size=8, learning_rate=1e-3, eval_interval=STEPS // 2, eval_samples=8,
        loss="grpo", kl_coef=0.0, clip_epsilon=0.2, training_mode="lora", lora_rank=8, lora_alpha=16, seed=11,
        engine=EngineConfig(max_tokens_per_turn=4, max_tokens_per_rollout=4, temperature=0.06),
    )
    hooks = RecordingHooks()
    started = time.perf_counter()
    outcome, _ = train(tmp_path, tools_url, config, rows(8, target_word), hooks, grader=grader,
                       valid_rows=rows(8, target_word)[::-1])
    elapsed = time.perf_counter() - started

    assert outcome.status == "succeeded", outcome.error
    curve = [m["scores"]["train_reward_mean"] for m in hooks.metrics]
    valid = [call[2] for call in hooks.calls if call[0] == "on_eval"]
    print(f"\ntarget {target_word!r}; train reward per step {[round(r, 3) for r in curve]}; "
          f"valid reward {valid}; {elapsed:.1f} s")
    assert len(curve) == STEPS
    assert curve[0] <= 0.2, "the task must start hard"
    assert sum(curve[-2:]) / 2 >= curve[0] + 0.3
    assert valid[-1] >= 0.5
    assert elapsed < 120
    assert any(m["train"]["rollouts_used"] for m in hooks.metrics)
    assert hooks.metrics[-1]["tools"]["rollouts"] == 64


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q", "-s"])
