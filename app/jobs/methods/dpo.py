"""`method.type = "dpo"` in the control plane: the block stored with every default filled in (the
worker reads it as stored), a row of its files (a conversation and two answers to it, one
preferred; docs/dpo.md), and how its checkpoints rank (validation loss, lower is better)."""

from __future__ import annotations

from typing import Any

from app.core.config import Settings
from app.dashboard.charts import Chart, Series
from app.jobs.schemas import DpoMethod, Method
from app.jobs.validation import RowRule, check_preference_row

TYPE = "dpo"
SCORE_KEYS = (("valid_loss", -1.0),)


def row_rule(declared_tools: set[str]) -> RowRule:
    return check_preference_row  # a conversation brings its own tools


def stored_block(method: Method, settings: Settings) -> dict[str, Any]:
    return {"type": TYPE, TYPE: (method.dpo or DpoMethod()).model_dump(mode="json")}

CHARTS: tuple[Chart, ...] = (
    # DPO jobs: OpenAI's losses and the preference scores at the top level, then `train` and `timing`.
    Chart("dpo-loss", "DPO loss", "loss per pair", (
        Series("training", key="train_loss"),
        Series("validation", key="valid_loss", markers=True),
        Series("full validation", key="full_valid_loss", markers=True),
    ), help="-log sigmoid of beta times how much more the policy prefers the preferred answer than "
             "the reference model does; log 2 (0.69) at the start."),
    Chart("dpo-accuracy", "Preference accuracy", "share of pairs", (
        Series("training", key="train_preference_accuracy"),
        Series("validation", key="valid_preference_accuracy", markers=True),
        Series("full validation", key="full_valid_preference_accuracy", markers=True),
    ), percent=True, help="Share of pairs whose implicit reward, beta × (log π − log π_ref), is "
                          "higher for the preferred answer."),
    Chart("dpo-margin", "Reward margin", "beta × log-ratio", (
        Series("training", key="train_reward_margin"),
        Series("validation", key="valid_reward_margin", markers=True),
    ), help="Mean implicit reward of the preferred answer minus the non-preferred one's."),
    Chart("dpo-logprob-margin", "Log-prob margin", "log π(preferred) − log π(non-preferred)", (
        Series("training", key="train_logprob_margin"),
        Series("validation", key="valid_logprob_margin", markers=True),
    ), help="The policy's own preference, in summed log-probs of the two answers."),
    Chart("dpo-grad-norm", "Gradient norm", "norm before clipping", (
        Series("grad norm", key="train.grad_norm"),
    )),
    Chart("dpo-step-time", "Time per step", "seconds", (
        Series("step", key="timing.step_s"),
    )),
)
