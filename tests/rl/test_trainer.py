"""The GRPO-family trainer with the tiny model, a real tool server over HTTP and real graders.

The hooks are an in-memory recorder: they are the worker's reporting channel, not what is
under test. The toy task: rows ask for a one-word answer; at temperature 0.05 the tiny random
model mostly writes only newlines (an empty answer) and sometimes a word, so a grader that
rewards a non-empty answer (string_check `ne ""`) gives most groups a reward spread and a step
of RL moves the policy."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import TypeAdapter, ValidationError

from agent_rft.graders.core import GraderContext
from agent_rft.graders.schemas import Grader
from app.jobs.schemas import ReinforcementHyperparameters
from tests.conftest import serve_app
from tests.rl.policies import ScriptedPolicy
from tests.rl.tool_server import tool_server
from workers.methods.reinforcement.advantages import clipped_token_objective, clipped_tokens, group_advantages
from workers.engine.generation import sequence_logprobs
from workers.models.loading import load_model
from workers.models.registry import LoadedModel
from workers.engine.prompting import ChatFormatter
from workers.engine.rollout import EngineConfig, RolloutEngine, RolloutSpec
from workers.engine.toolcalls import ToolSchema
from workers.engine.tools_client import ToolClient, ToolClientOptions
from app.jobs.schemas import TrainingOptions
from workers.methods.reinforcement.hyperparameters import TrainingConfig, resolve_hyperparameters
from workers.methods.reinforcement.trainer import Trainer
from workers.methods.reinforcement.update import LossSettings, micro_batch_loss
from workers.training.sequences import TrainSequence, collate, token_logprobs
from workers.training.training_state import find_saved_state

GRADERS = TypeAdapter(Grader)
SEARCH = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
FAST_RETRIES = ToolClientOptions(backoff_base_s=0.01, backoff_max_s=0.02)
TEMPERATURE = 0.05  # about a third of the tiny model's answers are non-empty at this temperature


# --- fixtures and helpers -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tools_url():  # noqa: ANN201
    with tool_server() as (url, _):
        yield url


@pytest.fixture(scope="module")
def target_word() -> str:
    """A word the tiny model says first now and then: its most likely first token that is a word
    (the most likely overall is a newline). Derived from the model, not hard-coded."""
    loaded = load_model("tiny-smollm2")
    tools = [ToolSchema("search", "Search", SEARCH)]
    ids = ChatFormatter(loaded.tokenizer).prompt_ids(rows(1, "x")[0]["messages"], tools)
    with torch.no_grad():
        logits = loaded.model(input_ids=torch.tensor([ids])).logits[0, -1]
    for token in logits.topk(20).indices.tolist():
        text = loaded.tokenizer.decode([token]).strip()
        if text.isalpha() and len(text) >= 3:
            return text
    raise AssertionError("the tiny model has no likely word")


def rows(n: int, target: str, script: str | None = None) -> list[dict[str, Any]]:
    suffix = f" SCRIPT={script}" if script else ""
    return [{"messages": [{"role": "user", "content": f"Question {i}: answer in one word.{suffix}"}], "target": target,
             "id": i} for i in range(n)]


def answers_something() -> Any:
    return GRADERS.validate_python({"type": "string_check", "name": "answered", "input": "{{sample.output_text}}",
                                    "reference": "", "operation": "ne"})


def config(**overrides: Any) -> TrainingConfig:
    base = TrainingConfig(batch_size=4, n_epochs=1, group_size=8, learning_rate=3e-3, eval_interval=1, eval_samples=2,
                          loss="grpo", kl_coef=0.0, clip_epsilon=0.2, lora_rank=8, lora_alpha=16, seed=7,
                          engine=EngineConfig(max_tokens_per_turn=4, max_tokens_per_rollout=4, temperature=TEMPERATURE))
    return replace(base, **overrides)


class RecordingHooks:
    """Records every hook call; `decisions` are control()'s answers, then "continue"."""

    def __init__(self, decisions: list[str] | None = None, *, keep_checkpoints: int = 1) -> None:
        self.decisions = list(decisions or [])
        self.keep_checkpoints = keep_checkpoints
        self.calls: list[tuple] = []
        self.metrics: list[dict] = []
        self.train_records: list[list[dict]] = []
        self.events: list[tuple[str, str, dict | None]] = []
        self.checkpoints: list[Path] = []

    async def on_step(self, step: int, metrics: dict, train_records: list[dict]) -> None:
        json.dumps({"metrics": metrics, "records": train_records})  # the worker sends these as JSON
        self.calls.append(("on_step", step))
        self.metrics.append(metrics)
        self.train_records.append(train_records)

    async def on_eval(self, step: int, valid_reward_mean: float, valid_records: list[dict]) -> None:
        self.calls.append(("on_eval", step, valid_reward_mean, len(valid_records)))

    async def on_checkpoint(self, step: int, path: Path, metrics: dict) -> list[str]:
        self.calls.append(("on_checkpoint", step, path))
        self.checkpoints.append(path)
        doomed, self.checkpoints = self.checkpoints[:-self.keep_checkpoints], self.checkpoints[-self.keep_checkpoints:]
        return [str(p) for p in doomed]

    async def on_state_saved(self, completed_steps: int, state_path: Path, trained_tokens: int) -> None:
        self.calls.append(("on_state_saved", completed_steps, state_path, trained_tokens))

    async def control(self) -> str:
        decision = self.decisions.pop(0) if self.decisions else "continue"
        self.calls.append(("control", decision))
        return decision

    async def on_event(self, level: str, message: str, data: dict | None) -> None:
        self.calls.append(("on_event", level))
        self.events.append((level, message, data))

    def names(self) -> list[str]:
        return [call[0] for call in self.calls]

    def steps(self) -> list[int]:
        return [call[1] for call in self.calls if call[0] == "on_step"]


def train(work_dir: Path, tools_url: str, cfg: TrainingConfig, train_rows: list[dict], hooks: RecordingHooks, *,
          grader: Any = None, valid_rows: list[dict] | None = None, loaded: LoadedModel | None = None,
          resume: bool = False) -> tuple[Any, Trainer]:
    async def go() -> tuple[Any, Trainer]:
        async with ToolClient([{"name": "search", "server_url": tools_url}], allowlist=["127.0.0.1"],
                              options=FAST_RETRIES) as client:
            trainer = Trainer(
                loaded=loaded or load_model("tiny-smollm2"), config=cfg, train_rows=train_rows,
                valid_rows=valid_rows or [], grader=grader or answers_something(), grader_ctx=GraderContext(),
                tool_client=client, hooks=hooks, work_dir=work_dir,
                job_tools=[{"name": "search", "server_url": tools_url, "description": "Search the web",
                            "parameters": SEARCH}],
                resume_state=work_dir / "state" if resume else None,
            )
            return await trainer.run(), trainer

    return asyncio.run(go())


def trainable(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}


# --- advantages -----------------------------------------------------------------------------------


def test_advantages_of_each_loss_variant_by_hand():
    # grpo: mean 0.5, sample std sqrt(4 × 0.25 / 3) = 0.57735
    a = 0.5 / (0.57735027 + 1e-4)
    assert group_advantages([1.0, 0.0, 0.0, 1.0], "grpo") == pytest.approx([a, -a, -a, a])
    assert a == pytest.approx(0.86588, abs=1e-5)
    # dr_grpo: r - mean, no std
    assert group_advantages([1.0, 0.0, 0.0, 0.0], "dr_grpo") == pytest.approx([0.75, -0.25, -0.25, -0.25])
    # rloo: r - mean of the others
    assert group_advantages([1.0, 0.0, 0.0, 0.0], "rloo") == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    assert group_advantages([0.2, 0.8], "rloo") == pytest.approx([-0.6, 0.6])
    # no spread, or a single usable rollout: skipped
    for loss in ("grpo", "dr_grpo", "rloo"):
        assert group_advantages([1.0, 1.0, 1.0], loss) is None
        assert group_advantages([0.3], loss) is None
    with pytest.raises(ValueError, match="loss must be one of"):
        group_advantages([0.0, 1.0], "ppo")


# --- the loss touches sampled tokens only -----------------------------------------------------------


def test_loss_gradient_reaches_only_positions_that_predict_sampled_tokens(tools_url):
    """A real multi-turn rollout (prompt, a tool call, the tool's output, an answer) from the
    engine; the gradient of the loss w.r.t. the tiny model's final hidden states is non-zero
    exactly at the positions whose logits predict a sampled token, and zero at every prompt and
    tool-output position (the final norm's output at position p feeds only the logits at p)."""
    loaded = load_model("tiny-smollm2")
    turns = ['<tool_call>{"name": "search", "arguments": {"query": "acme revenue"}}</tool_call>', "It is 42."]
    policy = ScriptedPolicy(loaded.tokenizer, {"m": turns})

    async def rollout():  # noqa: ANN202
        async with ToolClient([{"name": "search", "server_url": tools_url}], allowlist=["127.0.0.1"]) as client:
            engine = RolloutEngine(policy, loaded.tokenizer, ChatFormatter(loaded.tokenizer), client, EngineConfig())
            messages = [{"role": "user", "content": "Revenue? SCRIPT=m"}]
            tools = [ToolSchema("search", "Search", SEARCH)]
            return (await engine.run([RolloutSpec(0, messages, tools, {}, seed=1)]))[0]

    record = asyncio.run(rollout())
    assert record.tool_output_tokens > 0 and record.turns == 2
    mask = record.loss_mask
    own = sequence_logprobs(loaded.model, record.token_ids)  # ratio 1: the policy sampled these
    sequence = TrainSequence(record.token_ids, mask, own, advantage=1.0)
    batch = collate([sequence], loaded.tokenizer.pad_token_id, torch.device("cpu"))
    hidden: list[torch.Tensor] = []

    def keep_final_hidden_states(_module, _inputs, output) -> None:  # noqa: ANN001
        output.retain_grad()
        hidden.append(output)

    handle = loaded.model.model.norm.register_forward_hook(keep_final_hidden_states)
    try:
        new = token_logprobs(loaded.model, batch, temperature=1.0)
        loss, _ = micro_batch_loss(new, batch, LossSettings("grpo", 0.2, 0.0, 1.0, 2048), n_sequences=1)
        loss.backward()
    finally:
        handle.remove()
    grad_per_position = hidden[0].grad[0].abs().sum(dim=-1)
    touched = {p for p in range(len(mask)) if grad_per_position[p] > 0}
    assert touched == {p - 1 for p in range(1, len(mask)) if mask[p]}
    # The same loss whatever the stored log-probs say outside the sampled tokens.
    scrambled = TrainSequence(record.token_ids, mask, [lp if m else -5.0 for lp, m in zip(own, mask)], 1.0)
    batch2 = collate([scrambled], loaded.tokenizer.pad_token_id, torch.device("cpu"))
    # Both without autograd: with it, oneDNN may pick other kernels (AMX CPUs), which changes the last bits.
    with torch.no_grad():
        settings = LossSettings("grpo", 0.2, 0.0, 1.0, 2048)
        first, _ = micro_batch_loss(token_logprobs(loaded.model, batch, 1.0), batch, settings, n_sequences=1)
        again, _ = micro_batch_loss(token_logprobs(loaded.model, batch2, 1.0), batch2, settings, n_sequences=1)
    assert torch.equal(first, again)
    assert torch.allclose(loss.detach(), again, rtol=1e-5, atol=1e-6)


# --- hyperparameters ------------------------------------------------------------------------------


def test_auto_hyperparameters_follow_the_documented_rules():
    options = TrainingOptions.model_validate({"hyperparameters": {}, "max_episode_steps": 6})
    cfg, resolved = resolve_hyperparameters(options, n_train=100, n_valid=0, seed=3)
    assert (cfg.batch_size, cfg.n_epochs, cfg.group_size) == (8, 4, 4)  # n_epochs: ceil(50 × 8 / 100)
    assert cfg.learning_rate == pytest.approx(1e-5) and cfg.training_mode == "lora" and cfg.loss == "grpo"
    assert cfg.eval_interval == 5 and cfg.eval_samples == 16  # 50 steps / 10 evals; min(100, 16)
    assert cfg.seed == 3 and cfg.engine.max_episode_steps == 6 and cfg.engine.temperature == 1.0
    assert resolved == {"batch_size": 8, "n_epochs": 4, "learning_rate_multiplier": 1.0, "compute_multiplier": 1.0,
                        "eval_interval": 5, "eval_samples": 16, "reasoning_effort": "default"}
    ReinforcementHyperparameters.model_validate(resolved)  # recordable on the job as it is

    small, resolved_small = resolve_hyperparameters(TrainingOptions.model_validate({}), n_train=3, n_valid=5, seed=0)
    assert (small.batch_size, small.n_epochs, small.eval_samples) == (3, 10, 5)  # epochs capped at 10
    assert resolved_small["eval_interval"] == 1  # 10 steps

    for compute, group in ((0.1, 2), (1.0, 4), (2.5, 10), (10, 40)):
        reinforcement = {"hyperparameters": {"compute_multiplier": compute}}
        cfg, _ = resolve_hyperparameters(TrainingOptions.model_validate(reinforcement), n_train=10, n_valid=0, seed=0)
        assert cfg.group_size == group


def test_explicit_hyperparameters_and_open_model_options_are_used():
    reinforcement = {
        "hyperparameters": {"batch_size": 3, "n_epochs": 2, "learning_rate_multiplier": 4, "compute_multiplier": 2,
                            "eval_interval": 7, "eval_samples": 5},
        "max_episode_steps": 2,
        "x_open_model": {"training_mode": "full", "loss": "dr_grpo", "kl_coef": 0.05, "clip_epsilon": 0.3,
                         "max_tokens_per_turn": 64, "max_tokens_per_rollout": 128, "temperature": 0.7, "top_p": 0.9,
                         "lora_rank": 4, "lora_alpha": 8},
    }
    cfg, resolved = resolve_hyperparameters(TrainingOptions.model_validate(reinforcement), n_train=40, n_valid=10, seed=1)
    assert (cfg.batch_size, cfg.n_epochs, cfg.group_size, cfg.eval_interval, cfg.eval_samples) == (3, 2, 8, 7, 5)
    assert cfg.learning_rate == pytest.approx(4e-6)  # 4 × the full-training base rate
    assert (cfg.training_mode, cfg.loss, cfg.kl_coef, cfg.clip_epsilon, cfg.lora_rank, cfg.lora_alpha) == (
        "full", "dr_grpo", 0.05, 0.3, 4, 8)
    assert cfg.engine == EngineConfig(max_episode_steps=2, max_tokens_per_turn=64, max_tokens_per_rollout=128,
                                      temperature=0.7, top_p=0.9)
    assert resolved["learning_rate_multiplier"] == 4.0 and resolved["compute_multiplier"] == 2.0
    absolute = {**reinforcement, "x_open_model": {"learning_rate": 1e-3}}
    absolute_options = TrainingOptions.model_validate(absolute)
    assert resolve_hyperparameters(absolute_options, n_train=40, n_valid=10, seed=1)[0].learning_rate == 1e-3  # overrides
    with pytest.raises(ValidationError, match="batch_size"):  # the job's schema refuses it first...
        TrainingOptions.model_validate({"hyperparameters": {"batch_size": 0}})
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):  # ...and so does the config
        config(batch_size=0).validate()
    with pytest.raises(ValueError, match="no rows"):
        resolve_hyperparameters(TrainingOptions.model_validate({}), n_train=0, n_valid=0, seed=0)


# --- a run ------------------------------------------------------------------------------------------


def test_two_step_run_reports_through_the_hooks_in_order(tmp_path, tools_url, target_word):
    grader = GRADERS.validate_python({
        "type": "multi", "name": "both", "calculate_output": "said + 0.5 * answered",
        "graders": {"said": {"type": "string_check", "name": "said", "input": "{{sample.output_text}}",
                             "reference": "{{item.target}}", "operation": "like"},
                    "answered": {"type": "string_check", "name": "answered", "input": "{{sample.output_text}}",
                                 "reference": "", "operation": "ne"}}})
    hooks = RecordingHooks()
    cfg = config(batch_size=2, group_size=4, n_epochs=2, eval_interval=1, kl_coef=0.1)
    outcome, trainer = train(tmp_path, tools_url, cfg, rows(2, target_word), hooks, grader=grader,
                             valid_rows=rows(3, target_word))
    assert outcome.status == "succeeded" and outcome.error is None
    assert (outcome.completed_steps, outcome.total_steps, trainer.total_steps) == (2, 2, 2)
    per_step = ["control", "on_step", "on_eval", "on_checkpoint", "on_state_saved"]
    assert hooks.names() == ["on_event"] + per_step * 2 + ["on_event"]
    assert [c[1] for c in hooks.calls if c[0] == "on_state_saved"] == [1, 2]
    assert outcome.final_checkpoint == tmp_path / "checkpoints" / "step-2"
    assert not (tmp_path / "checkpoints" / "step-1").exists()  # the hook asked for its deletion

    metrics = hooks.metrics[0]
    assert set(metrics) == {"step", "total_steps", "scores", "usage", "errors", "timing", "tools", "graders", "train"}
    assert metrics["graders"] == {"throttled": 0, "throttle_wait_s": 0.0, "concurrency": None}  # no grader URL
    assert (metrics["step"], metrics["total_steps"]) == (1, 2)
    assert set(metrics["scores"]) >= {"train_reward_mean", "valid_reward_mean", "train_sub_rewards"}
    assert set(metrics["scores"]["train_sub_rewards"]) == {"said", "answered"}
    assert metrics["usage"]["completion_tokens"] > 0 and metrics["usage"]["prompt_tokens"] > 0
    assert metrics["errors"] == {"tool_failures": 0, "grader_failures": 0, "parse_errors": 0}
    assert set(metrics["timing"]["step"]) >= {"sampling", "training", "eval", "full_iteration"}
    # Where the step's time went: the parts are all measured and add up to the step.
    breakdown, step_time = metrics["timing"]["breakdown"], metrics["timing"]["step"]
    assert set(breakdown) == {"prefill", "decode", "tool_wait_and_other", "grading", "forward", "backward",
                              "optimizer_and_other", "eval"}
    assert breakdown["prefill"] > 0 and breakdown["decode"] > 0 and breakdown["forward"] > 0 and breakdown["backward"] > 0
    assert abs(sum(breakdown.values()) - step_time["full_iteration"]) < 0.05 * step_time["full_iteration"] + 0.05
    assert metrics["tools"]["rollouts"] == 8 and "finish_reasons" in metrics["tools"]
    train_block = metrics["train"]
    assert set(train_block) == {"loss", "kl", "grad_norm", "logprob_mismatch", "clip_fraction", "learning_rate",
                                "frac_reward_zero_std", "rollouts_used", "rollouts_excluded", "policy_version",
                                "policy_versions", "staleness_mean", "staleness_max", "importance_clip_fraction",
                                "prompts_drawn", "sampled_ahead"}
    assert train_block["policy_version"] == 0  # step 1 was sampled before any update
    # Synchronous steps: every turn sampled by the policy the update starts from; no correction.
    assert [(m["train"]["policy_versions"], m["train"]["staleness_max"]) for m in hooks.metrics] == [([0], 0), ([1], 0)]
    assert train_block["importance_clip_fraction"] is None and train_block["prompts_drawn"] == 2
    assert not train_block["sampled_ahead"]
    assert train_block["learning_rate"] == cfg.learning_rate and train_block["rollouts_excluded"] == 0
    for step_metrics, step_records in zip(hooks.metrics, hooks.train_records):  # groups = consecutive records
        groups = [[r["reward"] for r in step_records[i:i + 4]] for i in range(0, 8, 4)]
        spread = [g for g in groups if max(g) > min(g)]
        assert step_metrics["train"]["frac_reward_zero_std"] == (2 - len(spread)) / 2
        assert step_metrics["train"]["rollouts_used"] == 4 * len(spread)
    updated = [m["train"] for m in hooks.metrics if m["train"]["rollouts_used"]]
    assert updated, "no step had a group with a reward spread"
    assert all(t["kl"] is not None and t["kl"] >= 0.0 and t["grad_norm"] > 0 for t in updated)
    # float32: the trainer recomputes exactly what the sampler computed, so nothing is clipped
    assert all(t["logprob_mismatch"] < 2e-3 and t["clip_fraction"] == 0.0 for t in updated)
    records = hooks.train_records[0]
    assert len(records) == 8 and all("token_ids" not in r for r in records)
    for record in records:
        assert record["trace_id"].startswith("trace_") and record["reward"] is not None
        assert record["advantage"] is not None and record["messages"][0]["role"] == "user"
    mean_reward = sum(r["reward"] for r in records) / len(records)
    assert metrics["scores"]["train_reward_mean"] == pytest.approx(mean_reward)
    evals = [c for c in hooks.calls if c[0] == "on_eval"]
    assert all(c[3] == 2 for c in evals)  # eval_samples rows of the validation set
    used = sum(m["train"]["rollouts_used"] for m in hooks.metrics)
    assert (outcome.trained_tokens > 0) == (used > 0)
    assert outcome.trained_tokens <= sum(m["usage"]["completion_tokens"] for m in hooks.metrics)


def test_checkpoints_load_with_transformers_and_peft_and_match_the_trained_model(tmp_path, tools_url):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    probe = torch.tensor([[1, 42, 7, 99, 512, 3]])
    for mode in ("lora", "full"):
        work_dir = tmp_path / mode
        hooks = RecordingHooks(keep_checkpoints=5)
        outcome, trainer = train(work_dir, tools_url, config(training_mode=mode, batch_size=2, group_size=8,
                                                              learning_rate=3e-3 if mode == "lora" else 1e-3),
                                 rows(2, "x"), hooks)
        assert outcome.status == "succeeded" and hooks.metrics[0]["train"]["rollouts_used"] > 0
        with torch.no_grad():
            trained = trainer.model(input_ids=probe).logits
        if mode == "lora":
            base = load_model("tiny-smollm2").model
            untouched = base(input_ids=probe).logits.detach()
            reloaded = PeftModel.from_pretrained(base, str(outcome.final_checkpoint))
        else:
            untouched = load_model("tiny-smollm2").model(input_ids=probe).logits.detach()
            reloaded = AutoModelForCausalLM.from_pretrained(str(outcome.final_checkpoint))
        with torch.no_grad():
            logits = reloaded(input_ids=probe).logits
        assert not torch.allclose(trained, untouched)  # training changed the model...
        assert torch.allclose(logits, trained, atol=1e-5)  # ...and the checkpoint is that model


def test_bfloat16_lora_keeps_float32_adapters_and_measures_the_sampler_trainer_mismatch(tmp_path, tools_url):
    """x_open_model.dtype=bfloat16: bf16 base weights, float32 adapters and optimizer; the step
    reports how far the trainer's log-probs are from the sampler's (larger than in float32, far
    below the clip); the checkpoint replayed through `agent-rft eval`'s loader is the trained policy."""
    from workers.commands.rollout_command import load_policy

    probe = torch.tensor([[1, 42, 7, 99, 512, 3]])
    mismatch = {}
    for dtype in ("float32", "bfloat16"):
        hooks = RecordingHooks()
        outcome, trainer = train(tmp_path / dtype, tools_url, config(batch_size=2, group_size=8), rows(2, "x"), hooks,
                                 loaded=load_model("tiny-smollm2", dtype=dtype))
        step = hooks.metrics[0]["train"]
        assert outcome.status == "succeeded" and step["rollouts_used"] > 0
        mismatch[dtype] = step["logprob_mismatch"]
        assert 0 <= step["clip_fraction"] <= 1
        if dtype == "bfloat16":
            assert {p.dtype for p in trainer.model.parameters() if p.requires_grad} == {torch.float32}
            assert {p.dtype for p in trainer.model.parameters() if not p.requires_grad} == {torch.bfloat16}
            policy = load_policy(str(outcome.final_checkpoint), dtype="bfloat16")
            base = load_model("tiny-smollm2", dtype="bfloat16").model
            with torch.no_grad():
                trained, replayed, untouched = (m(input_ids=probe).logits.float()
                                                for m in (trainer.model, policy.model, base))
            assert not torch.allclose(trained, untouched)  # training changed the policy...
            assert torch.allclose(replayed, trained, atol=1e-3)  # ...and eval loads exactly that policy
    assert mismatch["float32"] < 2e-3
    assert mismatch["float32"] < mismatch["bfloat16"] < 0.1


# --- pause, resume, cancel --------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "max_staleness"), [("lora", 0), ("full", 0), ("lora", 1), ("full", 1)])
def test_pause_then_resume_ends_with_exactly_the_weights_of_an_uninterrupted_run(tmp_path, tools_url, mode,
                                                                                  max_staleness):
    """Also while the next step is sampled ahead (max_staleness 1): the pause gives up the batch
    being sampled, and the resumed run samples it again on the same lagged policy."""
    cfg = config(training_mode=mode, n_epochs=3, batch_size=2, group_size=8, eval_interval=2,
                 kl_coef=0.05, learning_rate=3e-3 if mode == "lora" else 1e-4, max_staleness=max_staleness)
    data = rows(2, "x")
    straight = RecordingHooks()
    outcome, uninterrupted = train(tmp_path / "straight", tools_url, cfg, data, straight)
    assert outcome.status == "succeeded" and outcome.completed_steps == 3
    assert any(m["train"]["rollouts_used"] for m in straight.metrics[1:]), "steps 2-3 must update the model"

    first = RecordingHooks(["continue", "pause"])
    paused, _ = train(tmp_path / "resumed", tools_url, cfg, data, first)
    assert (paused.status, paused.completed_steps, paused.total_steps) == ("paused", 1, 3)
    assert first.calls[-1][0] == "on_event" and first.calls[-2][:2] == ("on_state_saved", 1)
    second = RecordingHooks()
    resumed, trainer = train(tmp_path / "resumed", tools_url, cfg, data, second, resume=True)
    assert resumed.status == "succeeded" and resumed.completed_steps == 3
    assert first.steps() + second.steps() == [1, 2, 3]  # no step lost, none counted twice
    assert resumed.trained_tokens == outcome.trained_tokens
    expected, got = trainable(uninterrupted), trainable(trainer)
    assert expected.keys() == got.keys() and expected
    assert all(torch.equal(expected[name], got[name]) for name in expected)
    assert [m["scores"] for m in second.metrics] == [m["scores"] for m in straight.metrics[1:]]
    assert [m["train"]["policy_versions"] for m in second.metrics] == \
           [m["train"]["policy_versions"] for m in straight.metrics[1:]]


def test_resume_refuses_a_state_from_a_different_configuration(tmp_path, tools_url):
    cfg = config(batch_size=2, group_size=4, n_epochs=1)
    train(tmp_path, tools_url, cfg, rows(2, "x"), RecordingHooks())
    hooks = RecordingHooks()
    outcome, _ = train(tmp_path, tools_url, replace(cfg, lora_rank=4), rows(2, "x"), hooks, resume=True)
    assert outcome.status == "failed" and outcome.error["code"] == "training_error"
    assert "lora_rank: saved 8, now 4" in outcome.error["message"]
    assert hooks.events[-1][0] == "error"


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_a_worker_that_dies_mid_step_resumes_from_the_last_saved_state(tmp_path, tools_url, max_staleness):
    """The state is saved after every step: a worker killed during step 2 (here: its reporting
    channel dies in on_step, while step 3 is sampled ahead at max_staleness 1) loses only that
    unfinished step, and the resumed run ends with the weights of an uninterrupted one."""

    class DiesInStepTwo(RecordingHooks):
        async def on_step(self, step: int, metrics: dict, train_records: list[dict]) -> None:
            if step == 2:
                raise ConnectionError("worker lost its connection")
            await super().on_step(step, metrics, train_records)

    cfg = config(n_epochs=3, batch_size=2, group_size=8, eval_interval=10, max_staleness=max_staleness)
    _, uninterrupted = train(tmp_path / "straight", tools_url, cfg, rows(2, "x"), RecordingHooks())
    crashed, _ = train(tmp_path / "crash", tools_url, cfg, rows(2, "x"), DiesInStepTwo())
    assert crashed.status == "failed" and crashed.completed_steps == 1
    assert "worker lost its connection" in crashed.error["message"]
    hooks = RecordingHooks()
    resumed, trainer = train(tmp_path / "crash", tools_url, cfg, rows(2, "x"), hooks, resume=True)
    assert resumed.status == "succeeded" and hooks.steps() == [2, 3]
    expected, got = trainable(uninterrupted), trainable(trainer)
    assert all(torch.equal(expected[name], got[name]) for name in expected)


def test_an_interrupted_state_replacement_falls_back_to_the_previous_state(tmp_path, tools_url):
    cfg = config(batch_size=2, group_size=4, n_epochs=1)
    first, _ = train(tmp_path, tools_url, cfg, rows(2, "x"), RecordingHooks())
    (tmp_path / "state").rename(tmp_path / "state.old")  # killed between the two renames of a save
    assert find_saved_state(tmp_path / "state") == tmp_path / "state.old"
    hooks = RecordingHooks()
    again, _ = train(tmp_path, tools_url, cfg, rows(2, "x"), hooks, resume=True)
    assert (again.status, again.completed_steps, hooks.steps()) == ("succeeded", 1, [])  # nothing left to do
    assert again.final_checkpoint == first.final_checkpoint and again.trained_tokens == first.trained_tokens
    missing, _ = train(tmp_path / "elsewhere", tools_url, cfg, rows(2, "x"), RecordingHooks(), resume=True)
    assert missing.error["code"] == "training_error" and "no saved training state" in missing.error["message"]


def test_cancel_stops_at_the_next_step_boundary(tmp_path, tools_url):
    hooks = RecordingHooks(["continue", "cancel"])
    outcome, _ = train(tmp_path, tools_url, config(batch_size=2, group_size=4, n_epochs=3), rows(2, "x"), hooks)
    assert (outcome.status, outcome.completed_steps, outcome.total_steps) == ("cancelled", 1, 3)
    assert hooks.steps() == [1] and outcome.error is None and outcome.final_checkpoint is None
    assert "cancelled" in hooks.events[-1][1]


# --- failures ----------------------------------------------------------------------------------------


def broken_tool_server_app() -> FastAPI:
    app = FastAPI()

    @app.post("/tools")
    async def tools() -> PlainTextResponse:
        return PlainTextResponse("upstream exploded", status_code=500)

    return app


def test_a_tool_server_answering_500_fails_the_job_with_tool_failure_rate(tmp_path):
    tokenizer = load_model("tiny-smollm2").tokenizer
    call = '<tool_call>{"name": "search", "arguments": {"query": "acme revenue"}}</tool_call>'
    policy = ScriptedPolicy(tokenizer, {"caller": [call, "done"]})
    loaded = LoadedModel(policy, tokenizer, "scripted", torch.device("cpu"), torch.float32, None, "")
    hooks = RecordingHooks()
    with serve_app(broken_tool_server_app()) as port:
        cfg = config(training_mode="full", batch_size=2, group_size=2,
                     engine=EngineConfig(max_tokens_per_turn=64, max_tokens_per_rollout=128))
        outcome, _ = train(tmp_path, f"http://127.0.0.1:{port}/tools", cfg, rows(2, "x", script="caller"), hooks,
                           loaded=loaded)
    assert outcome.status == "failed" and outcome.completed_steps == 0
    error = outcome.error
    assert error["code"] == "tool_failure_rate" and error["param"] is None
    assert "4 of 4 rollouts (100%)" in error["message"] and "limit of 50%" in error["message"]
    assert "HTTP 500" in error["message"]
    level, message, data = hooks.events[-1]
    assert level == "error" and message == error["message"]
    assert data["tool_failure_rate"] == 1.0 and data["threshold"] == 0.5
    assert hooks.steps() == []


def test_grading_that_fails_for_most_rollouts_fails_the_job_with_grader_failure_rate(tmp_path, tools_url):
    grader = GRADERS.validate_python({"type": "string_check", "name": "typo", "input": "{{item.no_such_key}}",
                                      "reference": "x", "operation": "eq"})
    hooks = RecordingHooks()
    outcome, _ = train(tmp_path, tools_url, config(batch_size=2, group_size=2), rows(2, "x"), hooks, grader=grader)
    assert outcome.status == "failed" and outcome.error["code"] == "grader_failure_rate"
    assert "4 of 4 rollouts (100%)" in outcome.error["message"]
    assert "invalid_variable_error" in outcome.error["message"]


class ExplodingGrader:
    """Not a grader configuration at all: reading it raises, so grading itself raises."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError("grader configuration store unreachable")


def test_an_exception_inside_grading_fails_the_job_with_training_error(tmp_path, tools_url):
    hooks = RecordingHooks()
    outcome, _ = train(tmp_path, tools_url, config(batch_size=2, group_size=2), rows(2, "x"), hooks,
                       grader=ExplodingGrader())
    assert outcome.status == "failed" and outcome.error["code"] == "training_error"
    assert "grader configuration store unreachable" in outcome.error["message"]
    assert hooks.events[-1][0] == "error" and hooks.events[-1][2]["error"] == outcome.error


def test_out_of_memory_is_reported_as_such(tmp_path, tools_url):
    class OutOfMemoryHooks(RecordingHooks):
        async def control(self) -> str:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    outcome, _ = train(tmp_path, tools_url, config(), rows(2, "x"), OutOfMemoryHooks())
    assert outcome.status == "failed" and outcome.error["code"] == "out_of_memory"
    assert "Tried to allocate" in outcome.error["message"]


def test_bad_rows_fail_with_a_clear_message(tmp_path, tools_url):
    hooks = RecordingHooks()
    outcome, _ = train(tmp_path, tools_url, config(), [{"messages": []}], hooks)
    assert outcome.error["code"] == "training_error"
    assert "training row 1: needs a non-empty 'messages' list" in outcome.error["message"]


def test_clip_fraction_counts_the_tokens_the_clip_takes_the_gradient_from():
    """A token counts as clipped exactly where the PPO objective gives it no gradient: a ratio past
    1 + eps with a positive advantage, below 1 - eps with a negative one; outside the band on the
    other side it still learns (the old count, |ratio - 1| > eps, took those too)."""
    generator = torch.Generator().manual_seed(0)
    sampled = torch.randn(4, 64, generator=generator) - 3
    new = (sampled + torch.randn(4, 64, generator=generator) * 0.4).requires_grad_()
    advantages = torch.tensor([[1.0], [-1.0], [0.5], [-2.0]])
    clipped_token_objective(new, sampled, advantages, 0.2).sum().backward()
    no_gradient = int((new.grad == 0).sum())
    ratio = (new.detach() - sampled).exp()
    outside_band = int(((ratio - 1).abs() > 0.2).sum())
    assert clipped_tokens(ratio, advantages.expand_as(ratio), 0.2) == no_gradient
    assert 0 < no_gradient < outside_band  # both sides of the band occur, and only one side binds
