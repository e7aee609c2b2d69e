"""Data-parallel steps (workers/training/distributed): one update on 2 training processes (gloo, on the CPU)
equals the update on 1 process over the same sequences (loss and weights after the step), for
LoRA and for full fine-tuning; a follower that dies is named, with how it ended."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from workers.training.distributed.group import OneProcess, RankLost, Rendezvous, shares
from workers.training.distributed.launch import TrainingProcesses, free_port, serve_commands
from workers.models.loading import load_model
from workers.models.lora import training_mode
from workers.methods.reinforcement.update import LossSettings, UpdateStats, policy_update
from workers.training.sequences import TrainSequence

SETTINGS = LossSettings("grpo", clip_epsilon=0.2, kl_coef=0.0, temperature=1.0, token_budget=64)


def sequences() -> list[TrainSequence]:
    """Ten rollouts of different lengths: prompts, sampled tokens, sampler log-probs, advantages."""
    rng = random.Random(7)
    out = []
    for i in range(10):
        prompt, sampled = rng.randint(4, 12), rng.randint(3, 20)
        ids = [rng.randrange(10, 400) for _ in range(prompt + sampled)]
        out.append(TrainSequence(ids, [0] * prompt + [1] * sampled, [0.0] * prompt + [-rng.uniform(1, 6)] * sampled,
                                 advantage=(-1) ** i * (0.5 + i / 10)))
    return out


class Stepper:
    """One policy update of the tiny model, the same on every rank (seeded LoRA initialisation)."""

    def __init__(self, mode: str, group, device: str = "cpu") -> None:  # noqa: ANN001
        torch.manual_seed(0)
        torch.set_num_threads(1)
        self.group, self.mode = group, mode
        self.model = training_mode(load_model("tiny-smollm2", dtype="float32", device=device), mode, rank=8, alpha=16)
        self.model.eval()
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-2)

    def step(self, parts: list[list[TrainSequence]], n: int) -> UpdateStats:
        stats = policy_update(self.model, self.optimizer, parts[self.group.rank], settings=SETTINGS, pad_token_id=0,
                              micro_batch_tokens=64, max_grad_norm=1.0, reference=lambda _batch: None,
                              n_sequences=n, sync_gradients=self.group.all_reduce_gradients)
        gathered = self.group.gather(stats)
        return UpdateStats.merged(gathered) if gathered else stats

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().cpu().clone() for name, p in self.model.named_parameters() if p.requires_grad}


def follow_steps(group, mode: str, device: str = "cpu") -> None:  # noqa: ANN001
    import asyncio

    asyncio.run(serve_commands(group, Stepper(mode, group, device)))


def follow_steps_on_gpu(group, mode: str) -> None:  # noqa: ANN001
    follow_steps(group, mode, "cuda")


def follow_then_die(group, mode: str) -> None:  # noqa: ANN001, ARG001
    group.next_command()
    os.kill(os.getpid(), signal.SIGKILL)


def follow_then_hang(group, mode: str) -> None:  # noqa: ANN001, ARG001
    group.next_command()
    time.sleep(3600)  # alive, never answering


def two_processes(tmp_path: Path, follow, mode: str, timeout_s: float = 60,  # noqa: ANN001
                  backend: str = "gloo") -> TrainingProcesses:
    processes = TrainingProcesses(Rendezvous(free_port(), 2, timeout_s, backend), follow, mode, tmp_path)
    processes.join_group()
    return processes


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_a_step_on_two_processes_is_the_step_on_one(tmp_path: Path, mode: str):
    assert_two_processes_step_as_one(tmp_path, mode, "cpu")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_a_step_on_two_gpus_is_the_step_on_one(tmp_path: Path, mode: str):
    assert_two_processes_step_as_one(tmp_path, mode, "cuda")


def assert_two_processes_step_as_one(tmp_path: Path, mode: str, device: str) -> None:
    batch = sequences()
    alone = Stepper(mode, OneProcess(), device)
    expected = alone.step([batch], len(batch))
    on_gpu = device == "cuda"
    processes = two_processes(tmp_path, follow_steps_on_gpu if on_gpu else follow_steps, mode,
                              backend="nccl" if on_gpu else "gloo")
    try:
        rank0 = Stepper(mode, processes.group, device)
        parts = shares(batch, 2, weight=lambda s: len(s.token_ids))
        assert all(parts) and sum(map(len, parts)) == len(batch)
        processes.group.command("step", parts, len(batch))
        got = rank0.step(parts, len(batch))
    finally:
        processes.stop()
    assert [p.exitcode for p in processes.processes] == [0]
    assert got.sampled_tokens == expected.sampled_tokens
    assert got.loss == pytest.approx(expected.loss, rel=1e-4, abs=1e-6)
    assert got.grad_norm == pytest.approx(expected.grad_norm, rel=1e-4)
    before = Stepper(mode, OneProcess(), device).weights()
    after_one, after_two = alone.weights(), rank0.weights()
    moved = max(float((after_one[k] - before[k]).abs().max()) for k in before)
    assert moved > 1e-3  # the step changed the weights...
    for name in after_one:  # ...and the two-process step changed them the same way
        torch.testing.assert_close(after_two[name], after_one[name], rtol=1e-4, atol=1e-5)


def test_a_rank_with_nothing_to_train_this_step_still_takes_the_step(tmp_path: Path):
    batch = sequences()[:1]
    alone = Stepper("lora", OneProcess())
    alone.step([batch], 1)
    processes = two_processes(tmp_path, follow_steps, "lora")
    try:
        rank0 = Stepper("lora", processes.group)
        parts = [[], batch]  # rank 0 has none: its zero gradients are summed with rank 1's
        processes.group.command("step", parts, 1)
        rank0.step(parts, 1)
    finally:
        processes.stop()
    for name, weight in alone.weights().items():
        torch.testing.assert_close(rank0.weights()[name], weight, rtol=1e-4, atol=1e-5)


def step_with_a_failing_follower(tmp_path: Path, follow, timeout_s: float  # noqa: ANN001
                                 ) -> tuple[RankLost, float, TrainingProcesses]:
    """Rank 0's step while rank 1 `follow`s badly: the RankLost it raised, the seconds it took to
    raise it, and the (stopped) processes."""
    processes = two_processes(tmp_path, follow, "lora", timeout_s=timeout_s)
    try:
        rank0 = Stepper("lora", processes.group)
        processes.group.command("step", [sequences(), []], 10)
        started = time.monotonic()
        with pytest.raises(RankLost) as lost:
            rank0.step([sequences(), []], 10)
        waited = time.monotonic() - started
    finally:
        processes.stop(timeout_s=1)
    return lost.value, waited, processes


def test_a_follower_killed_mid_step_is_named_with_its_signal(tmp_path: Path):
    lost, waited, _ = step_with_a_failing_follower(tmp_path, follow_then_die, timeout_s=60)
    assert waited < 30  # noticed from the closed connection, not the 60 s timeout
    assert lost.rank == 1 and "SIGKILL" in lost.reason


def test_a_follower_that_hangs_is_noticed_within_the_timeout(tmp_path: Path):
    lost, waited, processes = step_with_a_failing_follower(tmp_path, follow_then_hang, timeout_s=5)
    assert 4 < waited < 30  # the group's timeout (5 s), plus the look at the processes
    assert lost.rank is None and "no answer within 5 s" in lost.reason
    assert not any(p.is_alive() for p in processes.processes)  # stop() ended the hung process


# --- whole runs of the other methods, through the generic follower -------------------------------

def method_trainer(method: str, work_dir: Path, group=None, loaded=None):  # noqa: ANN001, ANN201
    """A 2-step run of `method` on the tiny model, and its FollowerJob (what a follower builds it from)."""
    from tests.dpo.test_dpo_trainer import pair_row
    from tests.sft.test_supervised_trainer import rows as chat_rows
    from workers.training.distributed.follower import FollowerJob
    from workers.methods.dpo.hyperparameters import DpoConfig
    from workers.methods.dpo.trainer import DpoTrainer
    from workers.methods.supervised.hyperparameters import SupervisedConfig
    from workers.methods.supervised.trainer import SupervisedTrainer

    options = {"batch_size": 4, "n_epochs": 2, "learning_rate": 1e-2, "eval_interval": 2, "training_mode": "lora",
               "lora_rank": 8, "lora_alpha": 16, "micro_batch_tokens": 256}
    if method == "dpo":
        trainer_class, config, rows = DpoTrainer, DpoConfig(**options, beta=0.5), [pair_row(i) for i in range(4)]
    else:
        trainer_class, config, rows = SupervisedTrainer, SupervisedConfig(**options), chat_rows()[:4]
    args = {"config": config, "train_rows": rows, "valid_rows": rows[:2], "work_dir": work_dir, "resume_state": None}
    follower = FollowerJob(f"workers.methods.{method}", "tiny-smollm2", None, "float32", "lora", 1, args)
    return (lambda hooks: trainer_class(loaded=loaded or load_model("tiny-smollm2", dtype="float32"), hooks=hooks,
                                        group=group, **args)), follower


@pytest.mark.parametrize("method", ["supervised", "dpo"])
def test_a_supervised_or_dpo_run_on_two_processes_is_the_run_on_one(tmp_path: Path, method: str):
    import asyncio

    from tests.rl.test_trainer import RecordingHooks
    from workers.training.distributed.follower import follow

    torch.set_num_threads(1)
    alone, hooks_one = method_trainer(method, tmp_path / "one")[0], RecordingHooks()
    one = asyncio.run(alone(hooks_one).run())
    _, follower = method_trainer(method, tmp_path / "two")
    processes = TrainingProcesses(Rendezvous(free_port(), 2, 60, "gloo"), follow, follower, tmp_path / "two")
    try:
        group = processes.join_group()
        hooks_two = RecordingHooks()
        two = asyncio.run(method_trainer(method, tmp_path / "two", group)[0](hooks_two).run())
    finally:
        processes.stop()
    assert one.status == two.status == "succeeded", hooks_two.events
    assert len(hooks_one.metrics) == len(hooks_two.metrics) == 2
    for a, b in zip(hooks_one.metrics, hooks_two.metrics):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
        assert b["train"]["grad_norm"] == pytest.approx(a["train"]["grad_norm"], rel=1e-3)
    assert hooks_one.metrics[1]["train_loss"] != hooks_one.metrics[0]["train_loss"]  # the first step moved them
    from safetensors.torch import load_file

    weights = [load_file(str(outcome.final_checkpoint / "adapter_model.safetensors")) for outcome in (one, two)]
    for name in weights[0]:
        torch.testing.assert_close(weights[1][name], weights[0][name], rtol=1e-4, atol=1e-5)
