"""`method.type = "supervised"` in the control plane: the block stored with every default filled in
(the worker reads it as stored), a row of its files (a whole conversation to imitate, OpenAI's chat
format), and how its checkpoints rank (validation loss, lower is better)."""

from __future__ import annotations

from typing import Any

from app.core.config import Settings
from app.dashboard.charts import Chart, Series
from app.jobs.schemas import Method, SupervisedMethod
from app.jobs.validation import RowRule, check_supervised_row

TYPE = "supervised"
SCORE_KEYS = (("valid_loss", -1.0),)


def row_rule(declared_tools: set[str]) -> RowRule:
    return check_supervised_row  # a conversation brings its own tools


def stored_block(method: Method, settings: Settings) -> dict[str, Any]:
    return {"type": TYPE, TYPE: (method.supervised or SupervisedMethod()).model_dump(mode="json")}

CHARTS: tuple[Chart, ...] = (
    # Supervised jobs: OpenAI's metrics at the top level, then the trainer's `train` and `timing` blocks.
    Chart("sft-loss", "Loss", "loss per trained token", (
        Series("training", key="train_loss"),
        Series("validation", key="valid_loss", markers=True),
        Series("full validation", key="full_valid_loss", markers=True),
    ), help="Cross-entropy on the tokens the job trains on: the step's batch, a fixed "
             "subset of validation rows at eval steps, every validation row at the last step."),
    Chart("sft-accuracy", "Mean token accuracy", "share of trained tokens", (
        Series("training", key="train_mean_token_accuracy"),
        Series("validation", key="valid_mean_token_accuracy", markers=True),
        Series("full validation", key="full_valid_mean_token_accuracy", markers=True),
    ), percent=True, help="Share of trained tokens that are the model's most likely next token."),
    Chart("sft-tokens", "Tokens learned per step", "tokens", (
        Series("learned tokens", key="train.learned_tokens"),
    )),
    Chart("sft-grad-norm", "Gradient norm", "norm before clipping", (
        Series("grad norm", key="train.grad_norm"),
    )),
    Chart("sft-step-time", "Time per step", "seconds", (
        Series("step", key="timing.step_s"),
    )),
)
