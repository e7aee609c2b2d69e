"""Sampling the next step while this one updates (x_open_model.max_staleness), and refilling a
batch whose groups have no reward spread (refill_zero_spread): the tiny model, the real tool
server over HTTP and real graders, with test_trainer.py's recording hooks."""

from __future__ import annotations

import asyncio

import pytest
import torch

from agent_rft.graders.core import GraderContext
from tests.rl.test_trainer import (  # noqa: F401 - tools_url: the module's tool server fixture
    GRADERS,
    SEARCH,
    RecordingHooks,
    answers_something,
    config,
    rows,
    tools_url,
    train,
    trainable,
)
from workers.engine.grading import grade_rollouts
from workers.engine.tools_client import ToolClient
from workers.methods.reinforcement.trainer import Trainer
from workers.models.loading import load_model
from workers.methods.reinforcement.update import policy_update, train_sequences
from workers.training.data import rollout_seed, spec_for, take_batch


def JOB_TOOLS(url: str) -> list[dict]:  # noqa: N802 - the tools test_trainer's runs give the job
    return [{"name": "search", "server_url": url, "description": "Search the web", "parameters": SEARCH}]


def test_at_staleness_0_the_trainer_is_the_synchronous_loop_exactly(tmp_path, tools_url):
    """Sample a step's batch, grade it, update, the next step's sampling after the update: the
    trainer's losses and weights equal, bit for bit, that loop written out here on its parts."""
    cfg = config(batch_size=2, group_size=8, n_epochs=3, eval_interval=10)
    hooks = RecordingHooks()
    outcome, trainer = train(tmp_path / "trainer", tools_url, cfg, rows(2, "x"), hooks)
    assert outcome.status == "succeeded" and any(m["train"]["rollouts_used"] for m in hooks.metrics[1:])

    async def loop() -> tuple[list[float], Trainer]:
        async with ToolClient(JOB_TOOLS(tools_url), allowlist=["127.0.0.1"]) as client:
            by_hand = Trainer(loaded=load_model("tiny-smollm2"), config=cfg, train_rows=rows(2, "x"), valid_rows=[],
                              grader=answers_something(), grader_ctx=GraderContext(), tool_client=client,
                              hooks=RecordingHooks(), work_dir=tmp_path / "by-hand", job_tools=JOB_TOOLS(tools_url))
            by_hand._setup()  # the policy, optimizer and data the trainer starts from
            losses, position = [], by_hand.progress.position
            for step in range(1, by_hand.total_steps + 1):
                picked, position = take_batch(position, len(by_hand.train_prompts), cfg.seed, cfg.batch_size)
                specs = [spec_for(by_hand.train_prompts[row], rollout_seed(cfg.seed, "train", step, slot, row, k))
                         for slot, row in enumerate(picked) for k in range(cfg.group_size)]
                records = await by_hand.engine.run(specs)
                graded = await grade_rollouts(by_hand.grader, GraderContext(), records, [s.item for s in specs])
                sequences, _ = train_sequences(graded, cfg.group_size, cfg.loss)
                stats = policy_update(by_hand.model, by_hand.optimizer, sequences, settings=by_hand.loss_settings,
                                      pad_token_id=by_hand.pad_token_id, micro_batch_tokens=cfg.micro_batch_tokens,
                                      max_grad_norm=cfg.max_grad_norm, reference=by_hand._reference_logprobs)
                losses.append(stats.loss)
            return losses, by_hand

    losses, by_hand = asyncio.run(loop())
    assert [m["train"]["loss"] for m in hooks.metrics] == losses
    expected, got = trainable(trainer), trainable(by_hand)
    assert expected and all(torch.equal(expected[name], got[name]) for name in expected)


def test_sampling_ahead_lags_exactly_one_version_and_says_so(tmp_path, tools_url):
    """max_staleness 1 on the in-process engine: step N+1 is sampled while step N updates, by the
    policy of step N-1: every turn records that version, the lag never exceeds 1, the update's
    importance-sampling correction reports its clipping, and the run is repeatable."""
    cfg = config(batch_size=2, group_size=8, n_epochs=4, eval_interval=2, max_staleness=1, importance_cap=2.0)
    hooks = RecordingHooks()
    outcome, trainer = train(tmp_path / "a", tools_url, cfg, rows(2, "x"), hooks)
    assert outcome.status == "succeeded" and hooks.steps() == [1, 2, 3, 4]
    per_step = [m["train"] for m in hooks.metrics]
    assert [t["policy_versions"] for t in per_step] == [[0], [0], [1], [2]]
    assert [t["staleness_max"] for t in per_step] == [0, 1, 1, 1] and all(t["staleness_max"] <= 1 for t in per_step)
    assert [t["sampled_ahead"] for t in per_step] == [False, True, True, True]
    for records, train_block in zip(hooks.train_records, per_step):  # per turn, in the stored rollouts
        turns = [v for r in records for v in r["policy_versions"]]
        assert len(turns) == sum(r["turns"] for r in records) and set(turns) == set(train_block["policy_versions"])
    updated = [t for t in per_step if t["rollouts_used"]]
    assert updated and all(0.0 <= t["importance_clip_fraction"] <= 1.0 for t in updated)
    ahead = hooks.metrics[1]["timing"]
    assert set(ahead["ahead"]) >= {"sampling", "grading"} and "waiting_for_batch_ahead" in ahead["breakdown"]
    # The evaluations and checkpoints are of the updated policy (step 2's and 4's), not the lagged one.
    assert [c[1] for c in hooks.calls if c[0] == "on_checkpoint"] == [2, 4]

    again = RecordingHooks()
    _, repeated = train(tmp_path / "b", tools_url, cfg, rows(2, "x"), again)
    assert [m["train"]["loss"] for m in again.metrics] == [t["loss"] for t in per_step]
    expected, got = trainable(trainer), trainable(repeated)
    assert all(torch.equal(expected[name], got[name]) for name in expected)


def test_a_cancel_while_a_step_is_sampled_ahead_stops_it(tmp_path, tools_url):
    hooks = RecordingHooks(["continue", "cancel"])
    outcome, trainer = train(tmp_path, tools_url, config(batch_size=2, group_size=4, n_epochs=3, max_staleness=1),
                             rows(2, "x"), hooks)
    assert (outcome.status, outcome.completed_steps, hooks.steps()) == ("cancelled", 1, [1])
    assert trainer.lookahead.task is None  # the batch of step 2 was given up, not left running


def test_refill_zero_spread_draws_prompts_until_the_batch_has_its_groups_with_a_spread(tmp_path, tools_url):
    """Half the rows can never have a spread (their reference is nothing the model writes, so
    every answer scores 1); the other half usually do (an empty answer scores 0). With
    refill_zero_spread the update still sees batch_size groups with a spread, and says how many
    prompts it drew."""
    grader = GRADERS.validate_python({"type": "string_check", "name": "differs", "input": "{{sample.output_text}}",
                                      "reference": "{{item.target}}", "operation": "ne"})
    data = [{**row, "target": "" if i % 2 else "never-written-by-the-model"} for i, row in enumerate(rows(8, ""))]
    for refill in (False, True):
        hooks = RecordingHooks()
        cfg = config(batch_size=2, group_size=8, n_epochs=1, eval_interval=10, refill_zero_spread=refill,
                     learning_rate=1e-6)  # the policy stays as it is: the rows keep their kind of groups
        outcome, _ = train(tmp_path / str(refill), tools_url, cfg, data, hooks, grader=grader)
        assert outcome.status == "succeeded"
        per_step = [m["train"] for m in hooks.metrics]
        spread = [t["rollouts_used"] // cfg.group_size for t in per_step]
        if not refill:
            assert [t["prompts_drawn"] for t in per_step] == [2] * len(per_step)
            assert min(spread) < 2  # some step had a group without a spread
        else:
            assert spread == [2] * len(per_step)
            assert max(t["prompts_drawn"] for t in per_step) > 2
            assert all(2 <= t["prompts_drawn"] <= 8 for t in per_step)
            for records, t in zip(hooks.train_records, per_step):
                assert len(records) == t["prompts_drawn"] * cfg.group_size
                assert t["frac_reward_zero_std"] == (t["prompts_drawn"] - 2) / t["prompts_drawn"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_lagged_policy_follows_the_trainer_on_a_gpu(tmp_path):
    """On CUDA (no CPU speed-up applies there): the copy the step ahead samples stays on the
    device, holds the trainer's weights after a refresh, and keeps them while the trainer moves on."""
    from workers.methods.reinforcement.lookahead import LaggedPolicy
    from workers.models.lora import training_mode

    model = training_mode(load_model("tiny-smollm2", device="cuda"), "lora", rank=4, alpha=8)
    lagged = LaggedPolicy(model)
    assert {p.device.type for p in lagged.model.parameters()} == {"cuda"}
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.01)
    lagged.refresh(model)
    trained = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    assert all(torch.equal(lagged.tensors()[name], trained[name]) for name in trained)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.01)
    assert all(torch.equal(lagged.tensors()[name], trained[name]) for name in trained)
