"""The variance diagnostic's engine side: every chosen sample run `runs_per_sample` times with
the training engine, parser, tool client and grading (the trainer's own modules: data.py, grading.py), in
chunks, each chunk's graded records handed to the hooks (which push them to the control plane).
The control plane computes the per-sample results, summary and verdict (app/diagnostics/summary.py).

Seeds: run k of row i uses rollout_seed(seed, "diagnostic", i, k), so a worker that takes over
a diagnostic re-runs a missing sample exactly as the first worker would have.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from workers.engine.rollout import RolloutEngine

if TYPE_CHECKING:
    from app.jobs.schemas import TrainingOptions
from workers.training.data import Prompt, rollout_seed, spec_for
from workers.engine.grading import grade_rollouts
from workers.methods.reinforcement.hyperparameters import REFILL_LIMIT, resolve_hyperparameters

# compute_multipliers the tool-load projection covers (the job's own value is added).
PROJECTED_COMPUTE_MULTIPLIERS = (0.5, 1.0, 2.0, 4.0, 10.0)
CHUNK_ROLLOUTS = 32  # rollouts per engine run: generation is batched across them; progress after each


def select_samples(n_rows: int, max_samples: int | None, seed: int) -> list[int]:
    """Every row, or a seeded random subset of `max_samples` rows (in row order)."""
    if max_samples is None or max_samples >= n_rows:
        return list(range(n_rows))
    return sorted(random.Random(f"agent-rft/{seed}/diagnostic").sample(range(n_rows), max_samples))


def load_basis(training: TrainingOptions, *, n_train: int, seed: int, tool_max_concurrency: int | None,
               tools: Sequence[Any] = ()) -> dict[str, Any]:
    """Batch and group size per compute_multiplier, exactly as the trainer resolves them for this
    job's method and training-file size: the control plane turns them into the tool-load projection."""
    hyper = training.hyperparameters
    configured = 1.0 if hyper.compute_multiplier == "auto" else float(hyper.compute_multiplier)
    settings = []
    for multiplier in sorted(set(PROJECTED_COMPUTE_MULTIPLIERS) | {configured}):
        at = training.model_copy(update={"hyperparameters": hyper.model_copy(update={"compute_multiplier": multiplier})})
        config, _ = resolve_hyperparameters(at, n_train=n_train, n_valid=0, seed=seed)
        settings.append({"compute_multiplier": multiplier, "batch_size": config.batch_size,
                         "group_size": config.group_size, "eval_samples": config.eval_samples,
                         "configured": multiplier == configured})
    limits = {t.name: {"rate_limit": t.rate_limit, "max_concurrency": t.max_concurrency} for t in tools
              if t.rate_limit or t.max_concurrency}
    options = training.x_open_model
    return {"n_train": n_train, "tool_max_concurrency": tool_max_concurrency, "settings": settings,
            "tool_limits": limits, "max_staleness": options.max_staleness,
            "prompts_per_step_factor": REFILL_LIMIT if options.refill_zero_spread else 1}


class DiagnosticHooks(Protocol):
    async def on_rollouts(self, records: list[dict[str, Any]]) -> None: ...
    async def control(self) -> str: ...  # "continue" | "cancel"


@dataclass
class DiagnosticOutcome:
    status: str  # "succeeded" | "cancelled"
    samples_run: int = 0


async def run_diagnostic(*, engine: RolloutEngine, grader: Any, grader_ctx: Any, prompts: Sequence[Prompt],
                         sample_indexes: Sequence[int], runs_per_sample: int, seed: int, hooks: DiagnosticHooks,
                         done: frozenset[int] = frozenset(), chunk_rollouts: int = CHUNK_ROLLOUTS
                         ) -> DiagnosticOutcome:
    """Run the samples not in `done`, chunk by chunk; stop at the first chunk boundary after the
    hooks say cancel. Tool and grader failures are recorded on the rollouts (`excluded`), never
    raised: the diagnostic reports them."""
    todo = [i for i in sample_indexes if i not in done]
    per_chunk = max(1, chunk_rollouts // runs_per_sample)
    outcome = DiagnosticOutcome("succeeded")
    for start in range(0, len(todo), per_chunk):
        if await hooks.control() != "continue":
            outcome.status = "cancelled"
            return outcome
        runs = [(row, k) for row in todo[start:start + per_chunk] for k in range(runs_per_sample)]
        specs = [spec_for(prompts[row], rollout_seed(seed, "diagnostic", row, k)) for row, k in runs]
        records = await engine.run(specs)
        graded = await grade_rollouts(grader, grader_ctx, records, [s.item for s in specs])
        reports = [{**g.report(), "run_index": k} for g, (_, k) in zip(graded, runs)]
        await hooks.on_rollouts(reports)
        outcome.samples_run += len(runs) // runs_per_sample
    return outcome
