"""The GRPO-family trainer (DESIGN.md §1, §5): sample groups of multi-turn rollouts against the
customer's tools, grade them, and update the policy with group-relative advantages.

One training step:
1. the next `batch_size` rows of the data stream (a seeded permutation per epoch);
2. `group_size` rollouts per row, all in ONE run of the rollout engine (generation batched
   across every waiting rollout); each rollout's seed is derived from (seed, step, slot, row, k),
   never from global RNG state, so a resumed run samples exactly what an uninterrupted one does;
3. every rollout that did not end in a tool failure is graded (`grade_many`); tool failures and
   failed gradings are excluded and counted, and a step where either rate exceeds its threshold
   fails the job;
4. advantages per group (workers/rl/advantages.py); groups without reward spread are skipped;
5. one optimizer step: clipped policy-gradient loss on the sampled tokens only (the loss mask),
   optional k3 KL to the reference policy, micro-batches with accumulated gradients, gradient
   clipping, AdamW;
6. eval (every `eval_interval` steps and at the end) on a fixed set of validation rows, metrics
   to `hooks.on_step`, a checkpoint at eval steps, the full training state saved for resume.

docs/training.md describes every option, auto rule and failure mode.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
import math
import random
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean
from typing import Any, Protocol

import torch

from app.graders.batch import BatchGrade, grade_many
from app.graders.core import GraderContext, Sample
from workers.rl.advantages import (
    LOSS_VARIANTS,
    clipped_token_objective,
    clipped_tokens,
    group_advantages,
    k3_kl,
    sequence_normaliser,
)
from workers.rl.models import LoadedModel, adapters_in_model_dtype, release_freed_memory, save_model_dir, training_mode
from workers.rl.prompting import ChatFormatter
from workers.rl.rollout import EngineConfig, RolloutEngine, RolloutRecord, RolloutSpec
from workers.rl.summary import summarize
from workers.rl.toolcalls import ToolSchema
from workers.rl.training_state import (
    DataPosition,
    TrainingProgress,
    load_training_state,
    save_training_state,
)

log = logging.getLogger(__name__)

# --- auto rules (docs/training.md) ------------------------------------------------------------
# group_size = clamp(round(GROUP_SIZE_PER_COMPUTE × compute_multiplier), MIN_GROUP_SIZE, MAX_GROUP_SIZE)
GROUP_SIZE_PER_COMPUTE = 4
MIN_GROUP_SIZE, MAX_GROUP_SIZE = 2, 64
AUTO_BATCH_SIZE = 8  # prompts per step, at most the number of training rows
AUTO_TARGET_STEPS = 50  # auto n_epochs repeats a small dataset until about this many steps...
AUTO_MAX_EPOCHS = 10  # ...but never more than this many epochs
AUTO_EVALS_PER_RUN = 10  # auto eval_interval: about this many evals per run
AUTO_MAX_EVAL_SAMPLES = 16
# learning_rate = learning_rate_multiplier × base rate. LoRA wants ~10× the rate of full
# fine-tuning (Schulman et al., "LoRA Without Regret", 2025); 1e-6 is the usual full-RL rate.
BASE_LEARNING_RATE = {"lora": 1e-5, "full": 1e-6}

ROW_KEYS = ("messages", "tools")  # every other key of a JSONL row is the item
STATE_DIR = "state"
CHECKPOINT_DIR = "checkpoints"


@dataclass
class TrainingConfig:
    batch_size: int
    n_epochs: int
    group_size: int
    learning_rate: float
    eval_interval: int
    eval_samples: int
    loss: str  # "grpo" | "dr_grpo" | "rloo"
    kl_coef: float
    clip_epsilon: float
    max_grad_norm: float = 1.0
    training_mode: str = "lora"
    lora_rank: int = 16
    lora_alpha: int = 32
    engine: EngineConfig = field(default_factory=EngineConfig)  # temperature, top_p, token caps, max_episode_steps
    seed: int = 0
    max_tool_failure_rate: float = 0.5  # above this in a step the job fails
    max_grader_failure_rate: float = 0.5
    micro_batch_tokens: int = 2048  # padded tokens per forward/backward; gradients are accumulated
    state_interval: int = 1  # save the resumable state every this many steps (and always on pause)

    def validate(self) -> None:
        """Raise ValueError naming the first option out of range."""
        positive = ("batch_size", "n_epochs", "group_size", "eval_interval", "eval_samples", "micro_batch_tokens",
                    "state_interval", "lora_rank")
        for name in positive:
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be at least 2 (advantages compare the rollouts of a group), "
                             f"got {self.group_size}")
        if self.loss not in LOSS_VARIANTS:
            raise ValueError(f"loss must be one of {', '.join(LOSS_VARIANTS)}, got {self.loss!r}")
        if self.training_mode not in ("lora", "full"):
            raise ValueError(f"training_mode must be 'lora' or 'full', got {self.training_mode!r}")
        if not (self.learning_rate > 0 and self.max_grad_norm > 0 and self.clip_epsilon > 0 and self.kl_coef >= 0):
            raise ValueError("learning_rate, max_grad_norm and clip_epsilon must be positive and kl_coef non-negative")
        for name in ("max_tool_failure_rate", "max_grader_failure_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {getattr(self, name)!r}")


def resolve_hyperparameters(
    reinforcement: dict, *, n_train: int, n_valid: int, seed: int
) -> tuple[TrainingConfig, dict]:
    """`reinforcement` is the job's stored method.reinforcement dict (hyperparameters with "auto"
    values, max_episode_steps, x_open_model). Returns the config and the resolved values to record
    on the job: the hyperparameters with every "auto" replaced (same keys, so they still validate)."""
    from app.jobs.schemas import OpenModelOptions, ReinforcementHyperparameters

    if n_train < 1:
        raise ValueError("the training file has no rows")
    hyper = ReinforcementHyperparameters.model_validate(reinforcement.get("hyperparameters") or {})
    options = OpenModelOptions.model_validate(reinforcement.get("x_open_model") or {})
    compute = 1.0 if hyper.compute_multiplier == "auto" else float(hyper.compute_multiplier)
    lr_multiplier = 1.0 if hyper.learning_rate_multiplier == "auto" else float(hyper.learning_rate_multiplier)
    batch_size = min(n_train, AUTO_BATCH_SIZE) if hyper.batch_size == "auto" else hyper.batch_size
    n_epochs = auto_epochs(n_train, batch_size) if hyper.n_epochs == "auto" else hyper.n_epochs
    total = total_steps_for(n_train, batch_size, n_epochs)
    eval_interval = (max(1, math.ceil(total / AUTO_EVALS_PER_RUN)) if hyper.eval_interval == "auto"
                     else hyper.eval_interval)
    eval_samples = (min(n_valid or n_train, AUTO_MAX_EVAL_SAMPLES) if hyper.eval_samples == "auto"
                    else hyper.eval_samples)
    engine = EngineConfig(
        max_episode_steps=int(reinforcement.get("max_episode_steps") or 10),
        max_tokens_per_turn=options.max_tokens_per_turn, max_tokens_per_rollout=options.max_tokens_per_rollout,
        temperature=options.temperature, top_p=options.top_p,
    )
    config = TrainingConfig(
        batch_size=batch_size, n_epochs=n_epochs, group_size=group_size_for(compute),
        learning_rate=options.learning_rate or lr_multiplier * BASE_LEARNING_RATE[options.training_mode],
        eval_interval=eval_interval,
        eval_samples=eval_samples, loss=options.loss, kl_coef=options.kl_coef, clip_epsilon=options.clip_epsilon,
        training_mode=options.training_mode, lora_rank=options.lora_rank, lora_alpha=options.lora_alpha,
        engine=engine, seed=seed,
    )
    resolved = {"batch_size": batch_size, "n_epochs": n_epochs, "learning_rate_multiplier": lr_multiplier,
                "compute_multiplier": compute, "eval_interval": eval_interval, "eval_samples": eval_samples,
                "reasoning_effort": hyper.reasoning_effort}
    return config, resolved


def group_size_for(compute_multiplier: float) -> int:
    return max(MIN_GROUP_SIZE, min(MAX_GROUP_SIZE, round(GROUP_SIZE_PER_COMPUTE * compute_multiplier)))


def auto_epochs(n_train: int, batch_size: int) -> int:
    return max(1, min(AUTO_MAX_EPOCHS, math.ceil(AUTO_TARGET_STEPS * batch_size / n_train)))


def total_steps_for(n_train: int, batch_size: int, n_epochs: int) -> int:
    """Steps to see every row `n_epochs` times; a batch may run on into the next epoch."""
    return math.ceil(n_epochs * n_train / batch_size) if n_train else 0


class TrainingHooks(Protocol):
    """What the worker supplies: its reporting channel and its control signals. All async."""

    async def on_step(self, step: int, metrics: dict, train_records: list[dict]) -> None: ...
    async def on_eval(self, step: int, valid_reward_mean: float, valid_records: list[dict]) -> None: ...
    async def on_checkpoint(self, step: int, path: Path, metrics: dict) -> list[str]: ...
    async def on_state_saved(self, completed_steps: int, state_path: Path, trained_tokens: int) -> None: ...
    async def control(self) -> str: ...  # "continue" | "pause" | "cancel"
    async def on_event(self, level: str, message: str, data: dict | None) -> None: ...


@dataclass
class TrainingOutcome:
    status: str  # "succeeded" | "paused" | "cancelled" | "failed"
    completed_steps: int
    total_steps: int
    trained_tokens: int
    error: dict | None  # {"code", "message", "param"} when failed
    final_checkpoint: Path | None


class StepFailure(Exception):
    """A step that must fail the job with an OpenAI-style error code."""

    def __init__(self, code: str, message: str, data: dict | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.data = code, message, data or {}


# --- rows and the data stream -------------------------------------------------------------------


@dataclass
class Prompt:
    row_index: int
    messages: list[dict[str, Any]]
    tools: list[ToolSchema]
    item: dict[str, Any]


def job_tool_schemas(job_tools: Sequence[Any]) -> list[ToolSchema]:
    """Schemas of the job's tools that carry a description or parameters (the extension)."""
    schemas = []
    for tool in job_tools or []:
        get = tool.get if isinstance(tool, Mapping) else lambda key, t=tool: getattr(t, key, None)
        if get("parameters") or get("description"):
            parameters = get("parameters") or {"type": "object", "properties": {}}
            schemas.append(ToolSchema(get("name"), get("description") or "", parameters))
    return schemas


def prompts_from_rows(rows: Sequence[dict], job_schemas: list[ToolSchema], *, source: str) -> list[Prompt]:
    """JSONL rows → prompts; a row's own `tools` win over the job's schemas."""
    prompts = []
    for index, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or not row["messages"]:
            raise ValueError(f"{source} row {index + 1}: needs a non-empty 'messages' list")
        try:
            tools = [ToolSchema.from_openai(t) for t in row["tools"]] if "tools" in row else job_schemas
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source} row {index + 1}: invalid 'tools': {exc}") from exc
        item = {key: value for key, value in row.items() if key not in ROW_KEYS}
        prompts.append(Prompt(index, row["messages"], tools, item))
    return prompts


def epoch_permutation(n_rows: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n_rows))
    random.Random(f"agent-rft/{seed}/epoch/{epoch}").shuffle(order)  # str seeds hash the same in every process
    return order


def take_batch(position: DataPosition, n_rows: int, seed: int, size: int) -> tuple[list[int], DataPosition]:
    """The next `size` row indices from `position`, and the position after them."""
    epoch, index = position.epoch, position.index
    order = position.permutation or epoch_permutation(n_rows, seed, epoch)
    rows = []
    while len(rows) < size:
        if index == n_rows:
            epoch, index = epoch + 1, 0
            order = epoch_permutation(n_rows, seed, epoch)
        rows.append(order[index])
        index += 1
    return rows, DataPosition(epoch, index, list(order))


def spec_for(prompt: Prompt, seed: int) -> RolloutSpec:
    """The rollout engine's input for one run of `prompt` (training, eval and the diagnostic)."""
    return RolloutSpec(sample_index=prompt.row_index, messages=prompt.messages, tools=prompt.tools,
                       item=prompt.item, seed=seed)


def rollout_seed(*parts: Any) -> int:
    """A 48-bit seed from the parts (the engine multiplies it by 1000 for per-turn generators)."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:6], "big")


# --- grading ------------------------------------------------------------------------------------


@dataclass
class GradedRollout:
    record: RolloutRecord
    reward: float | None = None  # None when excluded
    excluded: str | None = None  # "tool_failure" | "grader_failure"
    grade: BatchGrade | None = None
    advantage: float | None = None

    def report(self) -> dict[str, Any]:
        """The record for the worker: RolloutRecord.summary() plus reward and advantage."""
        data = self.record.summary()
        data.update(reward=self.reward, advantage=self.advantage, excluded=self.excluded)
        if self.grade is not None:
            data["grader_errors"] = self.grade.errors
            data["grader_details"] = self.grade.details
            data["sub_rewards"] = self.grade.result.sub_rewards or None
        return data


async def grade_rollouts(grader: Any, ctx: GraderContext, records: list[RolloutRecord],
                         items: list[dict[str, Any]]) -> list[GradedRollout]:
    """Grade every rollout that did not end in a tool failure; mark the ones to exclude."""
    graded = [GradedRollout(r, excluded="tool_failure" if r.tool_failure else None) for r in records]
    todo = [(g, item) for g, item in zip(graded, items) if g.excluded is None]
    jobs = [(Sample.from_model_sample(g.record.grader_sample()), item, g.record.trace_id) for g, item in todo]
    for (rollout, _), result in zip(todo, await grade_many(grader, jobs, ctx) if jobs else []):
        rollout.grade = result
        if result.failed:
            rollout.excluded = "grader_failure"
        else:
            rollout.reward = float(result.reward)
    return graded


def mean_or_none(values: Sequence[float]) -> float | None:
    return mean(values) if values else None


def sub_reward_means(graded: Sequence[GradedRollout]) -> dict[str, float]:
    by_key: dict[str, list[float]] = {}
    for rollout in graded:
        if rollout.reward is not None and rollout.grade is not None:
            for key, value in (rollout.grade.result.sub_rewards or {}).items():
                if isinstance(value, (int, float)):
                    by_key.setdefault(key, []).append(float(value))
    return {key: mean(values) for key, values in sorted(by_key.items())}


# --- the policy-gradient update -------------------------------------------------------------------


@dataclass
class TrainSequence:
    """One rollout as the loss sees it: the exact sampled token ids and their sampling log-probs."""

    token_ids: list[int]
    loss_mask: list[int]
    sampling_logprobs: list[float]
    advantage: float

    @classmethod
    def from_record(cls, record: RolloutRecord, advantage: float) -> TrainSequence:
        return cls(list(record.token_ids), list(record.loss_mask), list(record.logprobs), advantage)


@dataclass
class LossSettings:
    loss: str
    clip_epsilon: float
    kl_coef: float
    temperature: float
    token_budget: int  # dr_grpo's constant normaliser: max_tokens_per_rollout


@dataclass
class UpdateStats:
    loss: float = 0.0
    kl: float | None = None
    grad_norm: float = 0.0
    sampled_tokens: int = 0
    # Sampler vs trainer: mean |log p_train - log p_sampled| over the sampled tokens (numerical
    # mismatch, larger in bfloat16), and the share of those tokens whose ratio the clip bounds.
    logprob_mismatch: float | None = None
    clip_fraction: float | None = None
    # Where the update's time went (the step-time breakdown): forward passes (policy and reference,
    # with the loss), backward passes; the rest of the update (optimizer, collation) is the difference.
    forward_s: float = 0.0
    backward_s: float = 0.0


def step_breakdown(timing: dict[str, float], generation: dict[str, float], update: UpdateStats) -> dict[str, float]:
    """A step's seconds split where they went; the parts add up to the step. Sampling: prefill (the
    first forward of each generation batch), decode (every later forward and its sampling), and the
    rest, the wall time the model sat idle (tool calls, batching waits, tokenizing). The update:
    forward, backward, and the rest (optimizer step, collation)."""
    prefill, decode = generation.get("prefill_s", 0.0), generation.get("decode_s", 0.0)
    return {
        "prefill": prefill, "decode": decode, "tool_wait_and_other": max(0.0, timing["sampling"] - prefill - decode),
        "grading": timing["grading"], "forward": update.forward_s, "backward": update.backward_s,
        "optimizer_and_other": max(0.0, timing["training"] - update.forward_s - update.backward_s),
        "eval": timing["eval"],
    }


def micro_batches(sequences: list[TrainSequence], max_tokens: int, *, by_length: bool = True,
                  by_prompt: bool = True) -> list[list[TrainSequence]]:
    """Groups whose cost stays within `max_tokens`; a sequence costing more than that is a
    micro-batch of its own. With `by_prompt`, the rollouts of one prompt (the same tokens before
    their first sampled one) whose prompt is most of their tokens (`feedable_prefix`) are grouped
    together and their shared prompt counts once (`collate` feeds it once): cost = prompt + rows x
    longest rest. Within a prompt, or over all other sequences, rows are sorted by length, so a
    group's rows have similar lengths and little padding (in arrival order, 5-33 % of a demo step's
    tokens were padding; `by_length=False` keeps that order, the baseline of benchmarks/engine).
    The loss is a mean over all the step's sequences, so the grouping changes only float rounding,
    not the update."""
    if not by_prompt:
        return _chunks(sequences, max_tokens, by_length=by_length, shared=False)
    buckets: dict[tuple[int, ...], list[TrainSequence]] = {}
    for sequence in sequences:
        buckets.setdefault(_prompt_of(sequence), []).append(sequence)
    prompts, alone = [], []
    for bucket in buckets.values():
        if feedable_prefix(bucket):
            prompts.append(bucket)
        else:
            alone.extend(bucket)
    return [batch for bucket in [*prompts, alone]
            for batch in _chunks(bucket, max_tokens, by_length=by_length, shared=True)]


def _chunks(sequences: list[TrainSequence], max_tokens: int, *, by_length: bool, shared: bool
            ) -> list[list[TrainSequence]]:
    batches: list[list[TrainSequence]] = []
    current: list[TrainSequence] = []
    for sequence in sorted(sequences, key=lambda s: len(s.token_ids)) if by_length else sequences:
        if current and _padded_cost([*current, sequence], shared=shared) > max_tokens:
            batches.append(current)
            current = []
        current.append(sequence)
    if current:
        batches.append(current)
    return batches


def _prompt_of(sequence: TrainSequence) -> tuple[int, ...]:
    return tuple(sequence.token_ids[:_first_sampled(sequence)])


def _first_sampled(sequence: TrainSequence) -> int:
    return next((i for i, flag in enumerate(sequence.loss_mask) if flag), len(sequence.loss_mask))


def shared_prefix_length(sequences: list[TrainSequence]) -> int:
    """Tokens every row starts with that can be fed once for all of them: the common prefix, short
    of each row's first sampled token and the position that predicts it (computed with the rest)."""
    if len(sequences) < 2:
        return 0
    limit = min(_first_sampled(s) for s in sequences) - 1
    first = sequences[0].token_ids
    length = 0
    while length < limit and all(len(s.token_ids) > length and s.token_ids[length] == first[length] for s in sequences):
        length += 1
    return length


def feedable_prefix(sequences: list[TrainSequence]) -> int:
    """The shared prefix `collate` feeds once, or 0. Its own forward, and a micro-batch per prompt,
    pay off when feeding it once spares at least SHARE_WHEN_SPARED of the rows' tokens: at 53 %
    spared (a 372-token prompt, 4 rollouts) the update took 0.75x the time, at 28 % (the demo's
    93-token prompt) 1.17x, in smaller micro-batches (benchmarks/engine)."""
    prefix = shared_prefix_length(sequences)
    spared = prefix * (len(sequences) - 1)
    return prefix if spared and spared >= SHARE_WHEN_SPARED * sum(len(s.token_ids) for s in sequences) else 0


SHARE_WHEN_SPARED = 0.4


def _padded_cost(group: list[TrainSequence], *, shared: bool) -> int:
    prefix = feedable_prefix(group) if shared else 0
    return prefix + len(group) * (max(len(s.token_ids) for s in group) - prefix)


@dataclass
class Collated:
    input_ids: torch.Tensor  # [B, L], right-padded: each row's tokens after the shared prefix
    attention_mask: torch.Tensor  # [B, prefix + L]
    positions: torch.Tensor  # [P]: positions of input_ids whose logits predict a sampled token of some row
    loss_mask: torch.Tensor  # [B, P]: 1 where position+1 is a sampled token of that row
    sampling_logprobs: torch.Tensor  # [B, P]
    advantages: torch.Tensor  # [B, 1]
    prefix_ids: torch.Tensor | None = None  # [1, prefix]: the tokens every row starts with, fed once


def collate(sequences: list[TrainSequence], pad_token_id: int, device: torch.device, *,
            share_prefix: bool = True) -> Collated:
    """The micro-batch as tensors. With `share_prefix`, the tokens all rows start with (a group's
    prompt, `feedable_prefix`) become `prefix_ids`, fed once; the rows hold the rest."""
    prefix = feedable_prefix(sequences) if share_prefix else 0
    width = max(len(s.token_ids) for s in sequences) - prefix
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), prefix + width), dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    sampled = torch.zeros((len(sequences), width), dtype=torch.float32)
    for row, sequence in enumerate(sequences):
        n = len(sequence.token_ids) - prefix
        ids[row, :n] = torch.tensor(sequence.token_ids[prefix:])
        attention[row, :prefix + n] = 1
        mask[row, :n] = torch.tensor(sequence.loss_mask[prefix:], dtype=torch.bool)
        sampled[row, :n] = torch.tensor(sequence.sampling_logprobs[prefix:], dtype=torch.float32)
    mask[:, 0] = False  # no context in the rows to predict it from (with a prefix it is never sampled)
    # Only the logits that predict a sampled token are computed: the vocabulary projection of
    # prompt and tool-output positions is skipped, which is most of the memory for long contexts.
    targets = torch.nonzero(mask.any(dim=0)).squeeze(-1)
    return Collated(
        input_ids=ids.to(device), attention_mask=attention.to(device), positions=(targets - 1).to(device),
        loss_mask=mask[:, targets].to(device), sampling_logprobs=sampled[:, targets].to(device),
        advantages=torch.tensor([[s.advantage] for s in sequences], dtype=torch.float32, device=device),
        prefix_ids=torch.tensor([sequences[0].token_ids[:prefix]], device=device) if prefix else None,
    )


def token_logprobs(model: torch.nn.Module, batch: Collated, temperature: float) -> torch.Tensor:
    """Log-probs [B, P] of the token at each position+1 where the loss mask is set (0 elsewhere),
    at the sampling temperature (as generation.sequence_logprobs computes them), over the full
    vocabulary. A shared prefix runs once, its keys and values repeated for every row (the
    gradient flows back through them). The vocabulary projection and its log-softmax, the largest
    tensors of the update, run only on the hidden states of the sampled tokens' positions: a row's
    prompt and tool-output positions, and the positions only other rows of the micro-batch sample
    at, are skipped."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # LoRA: the wrapped model
    rows, columns = batch.loss_mask.nonzero(as_tuple=True)
    positions = batch.positions[columns]
    decoder = causal_lm.get_decoder()
    with adapters_in_model_dtype(model):
        prefix = None
        if batch.prefix_ids is not None:  # fed once; every row attends to (and backpropagates into) it
            prefix = decoder(input_ids=batch.prefix_ids, use_cache=True).cache
            prefix.batch_repeat_interleave(batch.input_ids.shape[0])
        hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask, cache=prefix,
                         use_cache=prefix is not None).last_hidden_state
        logits = causal_lm.get_output_embeddings()(hidden[rows, positions]).float()
    if temperature > 0:
        logits = logits / temperature
    targets = batch.input_ids[rows, positions + 1]
    sampled = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return torch.zeros(batch.loss_mask.shape, dtype=sampled.dtype, device=sampled.device).index_put((rows, columns),
                                                                                                     sampled)


def micro_batch_loss(new_logprobs: torch.Tensor, batch: Collated, settings: LossSettings, n_sequences: int,
                     reference_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This micro-batch's share of the step's loss (the mean over all `n_sequences` used
    sequences of their per-sequence losses), and the per-token KL when a reference is given.
    Positions outside the loss mask contribute exactly nothing."""
    mask = batch.loss_mask
    # Outside the mask the ratio is pinned to 1 so padding can never make inf or NaN.
    sampled = torch.where(mask, batch.sampling_logprobs, new_logprobs.detach())
    per_token = -clipped_token_objective(new_logprobs, sampled, batch.advantages, settings.clip_epsilon)
    kl = None
    if reference_logprobs is not None:
        kl = k3_kl(new_logprobs, torch.where(mask, reference_logprobs, new_logprobs.detach()))
        per_token = per_token + settings.kl_coef * kl
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    normaliser = sequence_normaliser(settings.loss, mask.sum(dim=-1).float(), settings.token_budget)
    return (per_token.sum(dim=-1) / normaliser).sum() / n_sequences, kl


# --- the trainer -----------------------------------------------------------------------------------


class Trainer:
    def __init__(self, *, loaded: LoadedModel, config: TrainingConfig, train_rows: list[dict], valid_rows: list[dict],
                 grader: Any, grader_ctx: GraderContext, tool_client: Any, job_tools: list[dict], work_dir: Path,
                 hooks: TrainingHooks, resume_state: Path | None = None) -> None:
        self.loaded, self.config = loaded, config
        self.train_rows, self.valid_rows = train_rows, valid_rows
        self.grader, self.grader_ctx, self.tool_client = grader, grader_ctx, tool_client
        self.job_tools, self.hooks, self.resume_state = job_tools, hooks, resume_state
        self.work_dir = Path(work_dir)
        self.total_steps = total_steps_for(len(train_rows), config.batch_size, config.n_epochs)
        self.progress = TrainingProgress()
        self.model: torch.nn.Module | None = None  # the module being trained (peft model for LoRA)

    @property
    def state_path(self) -> Path:
        return self.work_dir / STATE_DIR

    # -- the run and its outcomes ----------------------------------------------------------------

    async def run(self) -> TrainingOutcome:
        """Train until done, paused, cancelled or failed. Never raises for a training problem:
        every failure is an outcome with an error code, announced by an error event."""
        try:
            return await self._run()
        except StepFailure as failure:
            return await self._failed(failure.code, failure.message, failure.data)
        except Exception as exc:  # noqa: BLE001 - a job must end with a reason, never a crashed worker
            if _is_out_of_memory(exc):
                return await self._failed("out_of_memory", f"out of memory at step {self.progress.step + 1}: {exc}. "
                                          "Lower batch_size, compute_multiplier, the token caps or micro_batch_tokens, "
                                          "or use LoRA.", {})
            log.exception("training failed")
            return await self._failed("training_error", f"{type(exc).__name__}: {exc}", {})

    async def _run(self) -> TrainingOutcome:
        await asyncio.to_thread(self._setup)
        await self._announce_start()
        while self.progress.step < self.total_steps:
            decision = await self.hooks.control()
            if decision == "cancel":
                await self._event("info", f"Training cancelled after step {self.progress.step} of {self.total_steps}.")
                return self._outcome("cancelled")
            if decision == "pause":
                await self._save_state()
                await self._event("info", f"Training paused after step {self.progress.step} of {self.total_steps}; "
                                  "its state is saved and it resumes from there.")
                return self._outcome("paused")
            if decision != "continue":
                raise ValueError(f"hooks.control() returned {decision!r}; expected 'continue', 'pause' or 'cancel'")
            await self._train_step(self.progress.step + 1)
        final = await self._final_checkpoint()
        await self._event("info", f"Training finished: {self.total_steps} steps, {self.progress.trained_tokens} "
                          f"trained tokens; final checkpoint {final.name}.")
        return self._outcome("succeeded", final_checkpoint=final)

    def _outcome(self, status: str, *, error: dict | None = None,
                 final_checkpoint: Path | None = None) -> TrainingOutcome:
        return TrainingOutcome(status, self.progress.step, self.total_steps, self.progress.trained_tokens,
                               error, final_checkpoint)

    async def _failed(self, code: str, message: str, data: dict) -> TrainingOutcome:
        error = {"code": code, "message": message, "param": None}
        try:
            await self.hooks.on_event("error", message, {"error": error, **data})
        except Exception:  # noqa: BLE001 - the outcome still says why
            log.exception("could not report the failure event")
        return self._outcome("failed", error=error)

    async def _event(self, level: str, message: str, data: dict | None = None) -> None:
        await self.hooks.on_event(level, message, data)

    async def _announce_start(self) -> None:
        c = self.config
        data = {"total_steps": self.total_steps, "batch_size": c.batch_size, "group_size": c.group_size,
                "n_epochs": c.n_epochs, "learning_rate": c.learning_rate, "loss": c.loss, "kl_coef": c.kl_coef,
                "training_mode": c.training_mode, "eval_interval": c.eval_interval, "eval_samples": c.eval_samples}
        if c.engine.temperature <= 0:
            await self._event("warn", "temperature is 0: every rollout of a group is the same, so no group has a "
                              "reward spread and nothing can be learned. Use a temperature around 0.7-1.0.")
        if self.progress.step:
            await self._event("info", f"Resumed training at step {self.progress.step} of {self.total_steps}.", data)
        else:
            await self._event("info", f"Training started: {self.total_steps} steps of {c.batch_size} prompts × "
                              f"{c.group_size} rollouts ({c.loss}, {c.training_mode}).", data)

    # -- setup -----------------------------------------------------------------------------------

    def _setup(self) -> None:
        """Build the trainable model, optimizer, reference and engine; restore a saved state."""
        c = self.config
        c.validate()
        if not self.train_rows:
            raise ValueError("the training file has no rows")
        if isinstance(self.grader, Mapping):  # the job's stored grader JSON
            from pydantic import TypeAdapter

            from app.graders.schemas import Grader

            self.grader = TypeAdapter(Grader).validate_python(self.grader)
        job_schemas = job_tool_schemas(self.job_tools)
        self.train_prompts = prompts_from_rows(self.train_rows, job_schemas, source="training")
        valid = prompts_from_rows(self.valid_rows, job_schemas, source="validation")
        self.eval_prompts = self._pick_eval_prompts(valid or self.train_prompts)
        torch.manual_seed(c.seed)  # LoRA's initial weights
        random.seed(c.seed)
        self.model = training_mode(self.loaded, c.training_mode, rank=c.lora_rank, alpha=c.lora_alpha)
        self.model.eval()  # no dropout: the update must see the policy that sampled
        self.reference = self._make_reference()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=c.learning_rate, weight_decay=0.0)
        tokenizer = self.loaded.tokenizer
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.engine = RolloutEngine(self.loaded.model, tokenizer, ChatFormatter(tokenizer), self.tool_client, c.engine)
        self.loss_settings = LossSettings(c.loss, c.clip_epsilon, c.kl_coef, c.engine.temperature,
                                          c.engine.max_tokens_per_rollout)
        if self.resume_state is not None:
            self.progress = load_training_state(self.resume_state, model=self.model, optimizer=self.optimizer,
                                                fingerprint=self._fingerprint())
        else:
            self.progress = TrainingProgress(fingerprint=self._fingerprint())

    def _make_reference(self) -> torch.nn.Module | None:
        """The frozen copy of the initial policy for the KL term, only for full training with
        kl_coef > 0 (LoRA's reference is the base model with the adapter disabled)."""
        if self.config.kl_coef <= 0 or self.config.training_mode == "lora":
            return None
        reference = copy.deepcopy(self.model).eval()
        for parameter in reference.parameters():
            parameter.requires_grad_(False)
        return reference

    def _pick_eval_prompts(self, prompts: list[Prompt]) -> list[Prompt]:
        """A fixed, seeded subset, the same at every eval so the curve compares like with like."""
        if len(prompts) <= self.config.eval_samples:
            return list(prompts)
        rng = random.Random(f"agent-rft/{self.config.seed}/eval")
        chosen = rng.sample(range(len(prompts)), self.config.eval_samples)
        return [prompts[i] for i in sorted(chosen)]

    def _fingerprint(self) -> dict[str, Any]:
        c = self.config
        return {"training_mode": c.training_mode, "lora_rank": c.lora_rank, "lora_alpha": c.lora_alpha,
                "loss": c.loss, "seed": c.seed, "batch_size": c.batch_size, "group_size": c.group_size,
                "n_train": len(self.train_rows), "total_steps": self.total_steps}

    # -- one step --------------------------------------------------------------------------------

    async def _train_step(self, step: int) -> None:
        c = self.config
        started = time.perf_counter()
        rows, next_position = take_batch(self.progress.position, len(self.train_prompts), c.seed, c.batch_size)
        specs = [spec_for(self.train_prompts[row], rollout_seed(c.seed, "train", step, slot, row, k))
                 for slot, row in enumerate(rows) for k in range(c.group_size)]
        records = await self.engine.run(specs)
        sampled_at, generation = time.perf_counter(), self.engine.generation_timings  # eval replaces it
        prefill_tokens = self.engine.prefill_tokens
        graded = await grade_rollouts(self.grader, self.grader_ctx, records, [s.item for s in specs])
        graded_at = time.perf_counter()
        self._check_failure_rates(step, graded)
        sequences, zero_spread_groups = self._assign_advantages(graded)
        stats = await asyncio.to_thread(self._update, sequences)
        trained_at = time.perf_counter()
        is_eval = step % c.eval_interval == 0 or step == self.total_steps
        valid = await self._evaluate() if is_eval else None
        timing = {"sampling": sampled_at - started, "grading": graded_at - sampled_at,
                  "training": trained_at - graded_at, "eval": time.perf_counter() - trained_at,
                  "full_iteration": time.perf_counter() - started}
        breakdown = step_breakdown(timing, generation, stats)
        metrics = self._step_metrics(step, graded, stats, len(sequences), zero_spread_groups, len(rows),
                                     {"step": timing, "breakdown": breakdown}, valid)
        metrics["usage"]["prefill_tokens"] = prefill_tokens
        await self._warn_about_exclusions(step, graded)
        await self.hooks.on_step(step, metrics, [g.report() for g in graded])
        if valid is not None:
            await self.hooks.on_eval(step, valid["reward_mean"], valid["records"])
            await self._checkpoint(step, metrics)
        # The step counts once it is reported; the saved state then makes it survive a crash.
        self.progress.step = step
        self.progress.trained_tokens += stats.sampled_tokens
        self.progress.position = next_position
        if step % c.state_interval == 0 or step == self.total_steps:
            await self._save_state()

    def _check_failure_rates(self, step: int, graded: list[GradedRollout]) -> None:
        """Raise StepFailure when the step's tool-failure or grader-failure rate is over its limit."""
        self._check_tool_failures(step, graded)
        self._check_grader_failures(step, [g for g in graded if g.excluded != "tool_failure"])

    def _check_tool_failures(self, step: int, graded: list[GradedRollout]) -> None:
        c = self.config
        tool_failures = [g for g in graded if g.excluded == "tool_failure"]
        tool_rate = len(tool_failures) / len(graded)
        if tool_rate > c.max_tool_failure_rate:
            example = next((call.error for g in tool_failures for call in reversed(g.record.tool_calls)
                            if call.status == "failed" and call.error), "unknown")
            raise StepFailure("tool_failure_rate", (
                f"Step {step}: {len(tool_failures)} of {len(graded)} rollouts ({tool_rate:.0%}) ended in a tool "
                f"failure (a tool call still failed after retries), above the limit of "
                f"{c.max_tool_failure_rate:.0%}. "
                f"Last tool error: {example}"),
                {"step": step, "tool_failure_rate": tool_rate, "threshold": c.max_tool_failure_rate,
                 "tool_failures": len(tool_failures), "rollouts": len(graded)})

    def _check_grader_failures(self, step: int, graded_ok: list[GradedRollout]) -> None:
        c = self.config
        grader_failures = [g for g in graded_ok if g.excluded == "grader_failure"]
        grader_rate = len(grader_failures) / len(graded_ok) if graded_ok else 0.0
        if grader_rate > c.max_grader_failure_rate:
            first = grader_failures[0].grade
            detail = f"{', '.join(first.errors)}: {first.details}" if first else "unknown"
            raise StepFailure("grader_failure_rate", (
                f"Step {step}: grading failed for {len(grader_failures)} of {len(graded_ok)} rollouts "
                f"({grader_rate:.0%}), above the limit of {c.max_grader_failure_rate:.0%}. First failure: {detail}"),
                {"step": step, "grader_failure_rate": grader_rate, "threshold": c.max_grader_failure_rate,
                 "grader_failures": len(grader_failures), "rollouts_graded": len(graded_ok)})

    def _assign_advantages(self, graded: list[GradedRollout]) -> tuple[list[TrainSequence], int]:
        """Group-relative advantages per prompt (slot); returns the sequences to train on and the
        number of groups skipped for lack of reward spread."""
        size = self.config.group_size
        sequences, zero_spread = [], 0
        for start in range(0, len(graded), size):
            usable = [g for g in graded[start:start + size] if g.reward is not None]
            advantages = group_advantages([g.reward for g in usable], self.config.loss)
            if advantages is None:
                zero_spread += 1
                for rollout in usable:
                    rollout.advantage = 0.0
                continue
            for rollout, advantage in zip(usable, advantages):
                rollout.advantage = advantage
                sequences.append(TrainSequence.from_record(rollout.record, advantage))
        return sequences, zero_spread

    def _update(self, sequences: list[TrainSequence]) -> UpdateStats:
        """One optimizer step over every sequence, micro-batch by micro-batch (blocking)."""
        if not sequences:
            return UpdateStats()
        self.optimizer.zero_grad(set_to_none=True)
        device = next(self.model.parameters()).device
        loss_total, kl_sum, kl_tokens, sampled, mismatch, clipped = 0.0, 0.0, 0, 0, 0.0, 0
        epsilon = self.loss_settings.clip_epsilon
        forward_s = backward_s = 0.0
        for group in micro_batches(sequences, self.config.micro_batch_tokens):
            batch = collate(group, self.pad_token_id, device)
            started = time.perf_counter()
            reference = self._reference_logprobs(batch)
            new = token_logprobs(self.model, batch, self.loss_settings.temperature)
            loss, kl = micro_batch_loss(new, batch, self.loss_settings, len(sequences), reference)
            forward_done = time.perf_counter()
            loss.backward()
            forward_s, backward_s = forward_s + forward_done - started, backward_s + time.perf_counter() - forward_done
            loss_total += loss.item()
            sampled += int(batch.loss_mask.sum())
            delta = (new.detach() - batch.sampling_logprobs)[batch.loss_mask]
            mismatch += float(delta.abs().sum())
            advantages = batch.advantages.expand_as(batch.loss_mask)[batch.loss_mask]
            clipped += clipped_tokens(delta.exp(), advantages, epsilon)
            if kl is not None:
                kl_sum += float(kl.detach()[batch.loss_mask].sum())
                kl_tokens += int(batch.loss_mask.sum())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        release_freed_memory()  # activations and gradients of this update's shapes
        return UpdateStats(loss_total, kl_sum / kl_tokens if kl_tokens else None, float(grad_norm), sampled,
                           mismatch / sampled if sampled else None, clipped / sampled if sampled else None,
                           forward_s, backward_s)

    def _reference_logprobs(self, batch: Collated) -> torch.Tensor | None:
        if self.config.kl_coef <= 0:
            return None
        with torch.no_grad():
            if self.reference is not None:
                return token_logprobs(self.reference, batch, self.loss_settings.temperature)
            with self.model.disable_adapter():  # LoRA: the base model is the reference
                return token_logprobs(self.model, batch, self.loss_settings.temperature)

    # -- eval, metrics, checkpoints, state ---------------------------------------------------------

    async def _evaluate(self) -> dict[str, Any]:
        """One rollout per eval prompt, with the same seeds at every eval."""
        specs = [spec_for(prompt, rollout_seed(self.config.seed, "eval", i))
                 for i, prompt in enumerate(self.eval_prompts)]
        records = await self.engine.run(specs)
        graded = await grade_rollouts(self.grader, self.grader_ctx, records, [s.item for s in specs])
        rewards = [g.reward for g in graded if g.reward is not None]
        return {"reward_mean": mean_or_none(rewards), "sub_rewards": sub_reward_means(graded),
                "records": [g.report() for g in graded]}

    def _step_metrics(self, step: int, graded: list[GradedRollout], stats: UpdateStats, n_used: int,
                      zero_spread_groups: int, n_groups: int, timing: dict[str, dict[str, float]],
                      valid: dict[str, Any] | None) -> dict[str, Any]:
        records = [g.record for g in graded]
        scores: dict[str, Any] = {"train_reward_mean": mean_or_none([g.reward for g in graded if g.reward is not None])}
        if sub := sub_reward_means(graded):
            scores["train_sub_rewards"] = sub
        if valid is not None:
            scores["valid_reward_mean"] = valid["reward_mean"]
            if valid["sub_rewards"]:
                scores["valid_sub_rewards"] = valid["sub_rewards"]
        return {
            "step": step,
            "total_steps": self.total_steps,
            "scores": scores,
            "usage": {"completion_tokens": sum(r.completion_tokens for r in records),
                      "tool_output_tokens": sum(r.tool_output_tokens for r in records),
                      "prompt_tokens": sum(r.prompt_tokens for r in records)},
            "errors": {"tool_failures": sum(1 for g in graded if g.excluded == "tool_failure"),
                       "grader_failures": sum(1 for g in graded if g.excluded == "grader_failure"),
                       "parse_errors": sum(r.parse_errors for r in records)},
            "timing": timing,
            "tools": summarize(records),
            "train": {"loss": stats.loss, "kl": stats.kl, "grad_norm": stats.grad_norm,
                      "logprob_mismatch": stats.logprob_mismatch, "clip_fraction": stats.clip_fraction,
                      "learning_rate": self.optimizer.param_groups[0]["lr"],
                      "frac_reward_zero_std": zero_spread_groups / n_groups,
                      "rollouts_used": n_used,
                      "rollouts_excluded": sum(1 for g in graded if g.excluded is not None)},
        }

    async def _warn_about_exclusions(self, step: int, graded: list[GradedRollout]) -> None:
        tool = sum(1 for g in graded if g.excluded == "tool_failure")
        grader = sum(1 for g in graded if g.excluded == "grader_failure")
        if tool or grader:
            await self._event("warn", f"Step {step}: {tool + grader} of {len(graded)} rollouts excluded from the "
                              f"update ({tool} tool failures, {grader} grader failures).",
                              {"step": step, "tool_failures": tool, "grader_failures": grader})

    async def _checkpoint(self, step: int, metrics: dict[str, Any]) -> Path:
        path = await asyncio.to_thread(self._save_checkpoint, step)
        for doomed in await self.hooks.on_checkpoint(step, path, metrics) or []:
            await self._delete_checkpoint(Path(doomed), keep=path)
        return path

    def _save_checkpoint(self, step: int) -> Path:
        """work_dir/checkpoints/step-N, loadable with plain transformers (full) or peft (LoRA)."""
        root = self.work_dir / CHECKPOINT_DIR
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"step-{step}"
        tmp = Path(tempfile.mkdtemp(prefix=f".step-{step}.tmp-", dir=root))
        try:
            if self.config.training_mode == "lora":
                self.model.save_pretrained(str(tmp))  # the adapter: PeftModel.from_pretrained(base, dir)
                self.loaded.tokenizer.save_pretrained(str(tmp))
            else:
                save_model_dir(self.model, self.loaded.tokenizer, tmp)  # also for GGUF-loaded models
            if final.exists():  # a step re-run after a crash: replace its checkpoint
                shutil.rmtree(final)
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    async def _delete_checkpoint(self, path: Path, *, keep: Path) -> None:
        root = (self.work_dir / CHECKPOINT_DIR).resolve()
        resolved = path.resolve()
        if resolved == keep.resolve() or resolved.parent != root:
            await self._event("warn", f"Not deleting checkpoint {path}: only older checkpoints under {root} "
                              "can be deleted.")
            return
        await asyncio.to_thread(shutil.rmtree, resolved, True)

    async def _final_checkpoint(self) -> Path:
        """The last step's checkpoint (written at that step's eval); written now when a run is
        resumed after its last step without it."""
        final = self.work_dir / CHECKPOINT_DIR / f"step-{self.total_steps}"
        if not final.is_dir():
            final = await self._checkpoint(self.total_steps, {"step": self.total_steps,
                                                              "total_steps": self.total_steps})
        return final

    async def _save_state(self) -> None:
        path = await asyncio.to_thread(save_training_state, self.state_path, model=self.model,
                                       optimizer=self.optimizer, progress=self.progress)
        await self.hooks.on_state_saved(self.progress.step, path, self.progress.trained_tokens)


def _is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
