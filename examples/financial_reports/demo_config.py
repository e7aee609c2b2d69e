"""Every value the `agent-rft demo` run uses, in one place: model, task, system prompt, grader,
training hyperparameters and the time budget. Change them here; demo.py and
benchmarks/demo_learning only read them. `DEMO` is the real run (SmolLM2-135M-Instruct; 5.6
minutes on 2 CPU cores with native bf16, 6.8 with the install on a fresh clone; the target is 15); `QUICK` is the `--quick` run the tests use (a tiny random model, two steps).

Why these values: benchmarks/demo_learning/README.md (the base model's learning signal and the
before/after numbers over 3 seeds).
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


# The demo's grader (`grader = "multi"`): 0.3 for a tool call that names the question's company,
# 0.7 for the right number. SmolLM2-135M rarely gets the number on its own, so the partial credit
# is what gives most groups of rollouts a reward spread to learn from; the number is what it learns next.
MULTI_GRADER: dict[str, Any] = {
    "type": "multi", "name": "searched and correct", "calculate_output": "0.3 * searched + 0.7 * correct",
    "graders": {
        "searched": {"type": "string_check", "name": "searched for the company", "input": "{{sample.output_tools}}",
                     "reference": "{{item.company}}", "operation": "ilike"},
        "correct": {"type": "numeric_match", "name": "correct number", "input": "{{sample.output_text}}",
                    "reference": "{{item.answer}}", "scale": "{{item.scale}}", "pick": "first",
                    "ignore_years": True}}}
NUMERIC_GRADER: dict[str, Any] = MULTI_GRADER["graders"]["correct"]
GRADERS = ("multi", "numeric_match", "endpoint")


def grader_spec(name: str, grader_url: str | None = None) -> dict[str, Any]:
    """The job's grader: `multi` (above), `numeric_match` (the right number only), or `endpoint`
    (the example grader server: the right number × tool-call efficiency, read from the tool server's log)."""
    if name == "multi":
        return MULTI_GRADER
    if name == "numeric_match":
        return {**NUMERIC_GRADER, "name": "answer"}
    if name == "endpoint":
        if not grader_url:
            raise ValueError("the endpoint grader needs the grader server's URL")
        return {"type": "endpoint", "name": "answer", "url": f"{grader_url}/grade"}
    raise ValueError(f"grader must be one of {', '.join(GRADERS)}, got {name!r}")


@dataclass(frozen=True)
class DemoConfig:
    # --- model and task (examples/financial_reports/demo_task.py) ---
    model: str = "SmolLM2-135M-Instruct"
    seed: int = 0  # corpus and training seed
    companies: int = 16  # synthetic companies; one question per report about its revenue and its net income
    years: tuple[int, ...] = (2022, 2023)
    held_out_companies: int = 6  # their questions are never trained on: evaluated before and after
    held_out_rows: int = 24  # how many held-out questions the before/after evaluation asks
    system_prompt: str = SYSTEM_PROMPT

    # --- grading: see grader_spec ---
    grader: str = "multi"

    # --- training (method.reinforcement) ---
    # Training steps; the training rows are sized so that the job runs this many. A step of 16
    # rollouts of at most 96 tokens takes 20-47 s on 2 CPU cores in bfloat16 (benchmarks/demo_learning).
    steps: int = 6
    max_episode_steps: int = 1  # one search, then the answer (the budget notice repeats the question)
    hyperparameters: dict[str, Any] = field(default_factory=lambda: {
        "batch_size": 4, "compute_multiplier": 1,  # 4 questions x 4 rollouts per step
        "eval_interval": 100, "eval_samples": 4})  # eval_interval > steps: validated at the last step only
    x_open_model: dict[str, Any] = field(default_factory=lambda: {
        "training_mode": "lora", "lora_rank": 16, "lora_alpha": 32, "loss": "grpo", "kl_coef": 0.0,
        "learning_rate": 1e-3, "max_tokens_per_turn": 48, "max_tokens_per_rollout": 96, "temperature": 0.7})

    # --- precision: bfloat16 where the CPU computes it natively (AVX512-BF16 / AMX; about 1.5x
    # faster for sampling and training), float32 elsewhere. `dtype()` resolves it; the job's
    # x_open_model.dtype and `agent-rft eval --dtype` get the resolved value.
    bf16_where_native: bool = True

    # --- the variance diagnostic before training (docs/diagnostics.md) ---
    diagnostic_samples: int = 6  # training questions, each run diagnostic_runs times
    diagnostic_runs: int = 2

    # --- evaluation before and after (same engine as training) ---
    eval_rollouts_per_row: int = 1
    eval_temperature: float = 0.7

    # --- limits ---
    # Measured: 336 s on 2 CPU cores in bfloat16 (training 219 s of it); the target is 15 minutes
    # (README). These limits only stop a run that hangs, or a much slower machine.
    time_budget_s: float = 30 * 60  # the whole demo; past it, everything stops and the demo fails
    startup_timeout_s: float = 180  # per service (the tool server embeds the corpus at start)
    job_timeout_s: float = 25 * 60  # training alone


def dtype(cfg: DemoConfig) -> str:
    """The precision the demo runs in here: bfloat16 on a GPU or on a CPU with native bf16
    (when `bf16_where_native`), else float32."""
    if not cfg.bf16_where_native:
        return "float32"
    import torch

    from workers.rl.models import native_bf16_cpu

    return "bfloat16" if torch.cuda.is_available() or native_bf16_cpu() else "float32"


DEMO = DemoConfig()

QUICK = replace(
    DEMO, model="tiny-smollm2", companies=3, years=(2022, 2023), held_out_companies=1, held_out_rows=2, steps=2,
    hyperparameters={"batch_size": 2, "compute_multiplier": 0.5, "eval_interval": 100, "eval_samples": 2},
    x_open_model={"lora_rank": 4, "max_tokens_per_turn": 12, "max_tokens_per_rollout": 24, "temperature": 1.0},
    diagnostic_samples=2, diagnostic_runs=2, time_budget_s=5 * 60, startup_timeout_s=120, job_timeout_s=4 * 60)
