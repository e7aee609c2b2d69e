"""One training run's lifecycle, whatever the method: the step loop with its pause and cancel
decisions, outcomes and failures, checkpoints, the final checkpoint and the resumable state.
A method (reinforcement: workers/methods/reinforcement/trainer.py; supervised: workers/methods/supervised/trainer.py; preference:
workers/methods/dpo/trainer.py) subclasses `TrainingRun` and supplies its setup (model, optimizer, data; the
progress, restored on resume) and its step (`_train_step`), which returns a `StepResult`: the
lifecycle reports it, checkpoints an evaluated step, advances the progress and saves the state."""

from __future__ import annotations

import asyncio
import logging
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from workers import spans
from workers.training.distributed.group import OneProcess, RankLost, TrainingGroup, shares
from workers.models.lora import training_mode
from workers.models.registry import LoadedModel, save_model_dir
from workers.engine.sampler import SamplerUnavailable
from workers.training.training_state import TrainingProgress, load_training_state, save_training_state

log = logging.getLogger(__name__)

STATE_DIR = "state"
CHECKPOINT_DIR = "checkpoints"


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


@dataclass
class StepResult:
    """What one step of a method did, for the lifecycle to report and count."""

    metrics: dict[str, Any]  # the step's metrics event (OpenAI's names where it has them)
    trained_tokens: int
    next_position: int  # where the seeded data stream continues
    evaluated: bool  # an eval step: its metrics hold the validation scores, and it is checkpointed
    train_records: list[dict] = field(default_factory=list)  # rollouts of a reinforcement step
    valid_records: list[dict] | None = None  # the eval's rollouts, where it sampled any
    valid_reward_mean: float | None = None


class RunInterrupted(Exception):
    """Raised by a hook when this worker can no longer carry the run for a reason outside training
    (its control plane is out of reach, or took the run away): the trainer stops at once and
    reports nothing, so the run resumes elsewhere from its last saved state. Never a failure."""


class StepFailure(Exception):
    """A step that must fail the job with an OpenAI-style error code."""

    def __init__(self, code: str, message: str, data: dict | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.data = code, message, data or {}


class TrainingRun:
    """The lifecycle; subclasses set `model`, `optimizer` and `progress` in `_setup` and train in
    `_train_step` (with `_shared_update`, a method defines `update_share`; with `_validation`, `_score`). `config` needs `training_mode` (how checkpoints are written)."""

    def __init__(self, *, loaded: LoadedModel, config: Any, work_dir: Path, hooks: TrainingHooks,
                 resume_state: Path | None, total_steps: int, group: TrainingGroup | None = None) -> None:
        self.loaded, self.config, self.hooks, self.resume_state = loaded, config, hooks, resume_state
        self.group = group or OneProcess()  # the job's training processes; this one is rank 0
        self.work_dir = Path(work_dir)
        self.total_steps = total_steps
        self.progress = TrainingProgress()
        self.model: torch.nn.Module | None = None  # the module being trained (peft model for LoRA)
        self.optimizer: torch.optim.Optimizer | None = None

    @property
    def state_path(self) -> Path:
        return self.work_dir / STATE_DIR

    # -- what a method supplies ------------------------------------------------------------------

    def _setup(self) -> None:
        """Build the trainable model, optimizer and data; restore a saved state (blocking)."""
        raise NotImplementedError

    async def _announce_start(self) -> None:
        raise NotImplementedError

    async def _train_step(self, step: int) -> StepResult:
        raise NotImplementedError

    def _shared_update(self, items: list, weight: Callable[[Any], int], total: int) -> Any:
        """One optimizer step over `items` (blocking), shared out over the training processes: each
        takes a share of about equal `weight` and runs the method's `update_share(parts, total)`,
        `total` being what the step's loss is divided by (the gradients are summed over the shares)."""
        parts = shares(items, self.group.world_size, weight=weight)
        self.group.command("update_share", parts, total)
        return self.update_share(parts, total)

    def _step_statistics(self, mine: Any, merged: Callable[[list], Any]) -> Any:
        """The step's statistics on rank 0, `merged` from every process's (only this process's alone)."""
        gathered = self.group.gather(mine)
        return merged(gathered) if gathered and len(gathered) > 1 else mine

    async def _validation(self, step: int, evaluated: bool, subset: list, everything: list) -> tuple[Any, Any]:
        """The method's `_score` of the validation subset at an eval step, and of every validation
        item at the last step (the subset's when that was all of them); None where not scored."""
        valid = await self._score(subset) if evaluated and subset else None
        if step != self.total_steps or not everything:
            return valid, None
        whole = valid is not None and len(subset) == len(everything)
        return valid, valid if whole else await self._score(everything)

    def _evaluates_at(self, step: int) -> bool:
        """Every `eval_interval` steps and at the last: validation scores and a checkpoint."""
        return step % self.config.eval_interval == 0 or step == self.total_steps

    def _build_trainable(self) -> None:
        """The module to train (LoRA's initial weights drawn from the run's seed), its optimizer and
        the pad id; `config` needs seed, training_mode, lora_rank, lora_alpha and learning_rate."""
        c = self.config
        torch.manual_seed(c.seed)
        random.seed(c.seed)
        self.model = training_mode(self.loaded, c.training_mode, rank=c.lora_rank, alpha=c.lora_alpha)
        self.model.eval()  # no dropout: the update must see the policy that sampled
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=c.learning_rate, weight_decay=0.0)
        tokenizer = self.loaded.tokenizer
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def _restore_progress(self, fingerprint: dict[str, Any]) -> None:
        """On resume, the saved weights, optimizer, RNG and progress (refused when `fingerprint`, the
        options a resumed run must share, differs); else a new run's progress."""
        if self.resume_state is not None:
            self.progress = load_training_state(self.resume_state, model=self.model, optimizer=self.optimizer,
                                                fingerprint=fingerprint)
        else:
            self.progress = TrainingProgress(fingerprint=fingerprint)

    async def _before_steps(self) -> None:
        """Called once after setup (and a restored state), before the first step this run trains."""

    async def _after_steps(self) -> None:
        """Called once when this run stops training, whatever the outcome: work the method started
        ahead of the next step (and its cores, tools and memory) is given up."""

    def _extra_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Tensors besides the trained weights that a resumed run needs, saved with the state by name."""
        return {}

    # -- the run and its outcomes ----------------------------------------------------------------

    async def run(self) -> TrainingOutcome:
        """Train until done, paused, cancelled or failed. Never raises for a training problem:
        every failure is an outcome with an error code, announced by an error event. A hook's
        RunInterrupted passes through."""
        try:
            return await self._run_and_report()
        finally:
            await self._after_steps()

    async def _run_and_report(self) -> TrainingOutcome:
        try:
            return await self._train()
        except RunInterrupted:
            raise
        except RankLost as lost:
            await self._event("error", f"{lost} at step {self.progress.step + 1}; the job resumes from its last "
                                       f"saved step ({self.progress.step}) on a new set of processes.",
                              {"rank": lost.rank, "reason": lost.reason, "step": self.progress.step + 1})
            raise RunInterrupted(str(lost)) from lost
        except StepFailure as failure:
            return await self._failed(failure.code, failure.message, failure.data)
        except SamplerUnavailable as exc:
            return await self._failed("sampler_unavailable", f"at step {self.progress.step + 1}: {exc}", {})
        except Exception as exc:  # noqa: BLE001 - a job must end with a reason, never a crashed worker
            if _is_out_of_memory(exc):
                return await self._failed("out_of_memory", f"out of memory at step {self.progress.step + 1}: {exc}. "
                                          "Lower batch_size, compute_multiplier, the token caps or micro_batch_tokens, "
                                          "or use LoRA.", {})
            log.exception("training failed")
            return await self._failed("training_error", f"{type(exc).__name__}: {exc}", {})

    async def _train(self) -> TrainingOutcome:
        await asyncio.to_thread(self._setup)
        await asyncio.to_thread(self.group.broadcast_parameters, self.model)  # the same start on every rank
        await self._announce_start()
        await self._before_steps()
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
            step = self.progress.step + 1
            with spans.step_span(step, self.total_steps):
                await self._count(step, await self._train_step(step))
        final = await self._final_checkpoint()
        await self._event("info", f"Training finished: {self.total_steps} steps, {self.progress.trained_tokens} "
                          f"trained tokens; final checkpoint {final.name}.")
        return self._outcome("succeeded", final_checkpoint=final)

    async def _count(self, step: int, result: StepResult) -> None:
        """Report the step, checkpoint it when it evaluated, then count it: a step counts once it is
        reported, and the saved state makes it survive a crash."""
        await self.hooks.on_step(step, result.metrics, result.train_records)
        if result.evaluated:
            if result.valid_records is not None:
                await self.hooks.on_eval(step, result.valid_reward_mean, result.valid_records)
            await self._checkpoint(step, result.metrics)
        self.progress.step = step
        self.progress.trained_tokens += result.trained_tokens
        self.progress.position = result.next_position
        if step % self.config.state_interval == 0 or step == self.total_steps:
            await self._save_state()

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


    # -- checkpoints and state ---------------------------------------------------------------------

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
                                       optimizer=self.optimizer, progress=self.progress, extra=self._extra_state())
        await self.hooks.on_state_saved(self.progress.step, path, self.progress.trained_tokens)


def _is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
