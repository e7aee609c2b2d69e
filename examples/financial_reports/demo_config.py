"""Every value the `agent-rft demo` run uses, in one place: model, data sizes, system prompt,
grader, training hyperparameters and the time budget. Change them here; app/demo.py only reads
them. `DEMO` is the real run (SmolLM2-135M-Instruct, sized for 2 CPU cores in 15 minutes);
`QUICK` is the `--quick` run the tests use (a tiny random model, two steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

# One concrete, worked tool call: SmolLM2 copies an example far better than it follows generic
# instructions, and a system message holding `<tool_call>` is kept verbatim. This is the prompt
# measured in docs/rollouts.md (about one SmolLM2 rollout in five makes a valid call).
SYSTEM_PROMPT = """\
You have a tool named search. Example:
User: What was Foo Corp revenue in 2021?
Assistant: <tool_call>{"name": "search", "arguments": {"query": "Foo Corp revenue 2021"}}</tool_call>"""


@dataclass(frozen=True)
class DemoConfig:
    # --- model and data ---
    model: str = "SmolLM2-135M-Instruct"
    seed: int = 0
    companies: int = 8  # synthetic companies; 3 questions per company and year
    years: tuple[int, ...] = (2021, 2022, 2023)
    valid_fraction: float = 0.2  # share of the reports held out (split by report, never by question)
    held_out_rows: int = 6  # held-out questions evaluated before and after (and used as validation)
    system_prompt: str = SYSTEM_PROMPT

    # --- grading: "endpoint" (the example grader server: right number x efficiency) or "numeric_match" ---
    grader: str = "endpoint"

    # --- training (method.reinforcement) ---
    # Training steps; the training rows are sized so that the job runs this many. Sized from
    # benchmarks/demo_learning (2 CPU cores): 16 rollouts of at most 96 tokens take 53-107 s per
    # step, slower as the model learns to call tools; a held-out evaluation ~1 min.
    steps: int = 3
    max_episode_steps: int = 2  # tool-call budget per rollout
    hyperparameters: dict[str, Any] = field(default_factory=lambda: {
        "batch_size": 4, "compute_multiplier": 1, "learning_rate_multiplier": 2,
        "eval_interval": 100, "eval_samples": 4})  # eval_interval > steps: evaluated at the last step only
    x_open_model: dict[str, Any] = field(default_factory=lambda: {
        "training_mode": "lora", "lora_rank": 16, "loss": "grpo", "kl_coef": 0.0,
        "max_tokens_per_turn": 48, "max_tokens_per_rollout": 96, "temperature": 0.7})

    # --- evaluation before and after (same engine as training) ---
    eval_rollouts_per_row: int = 1
    eval_temperature: float = 0.7

    # --- limits ---
    time_budget_s: float = 15 * 60  # the whole demo; past it, everything stops and the demo fails
    startup_timeout_s: float = 180  # per service (the tool server embeds the corpus at start)
    job_timeout_s: float = 12 * 60  # training alone


DEMO = DemoConfig()

QUICK = replace(
    DEMO, model="tiny-smollm2", companies=2, years=(2022, 2023), valid_fraction=0.25, held_out_rows=2, steps=2,
    max_episode_steps=2, hyperparameters={"batch_size": 2, "compute_multiplier": 0.5, "eval_interval": 100,
                                          "eval_samples": 2},
    x_open_model={"lora_rank": 4, "max_tokens_per_turn": 12, "max_tokens_per_rollout": 24, "temperature": 1.0},
    time_budget_s=5 * 60, startup_timeout_s=120, job_timeout_s=4 * 60)
