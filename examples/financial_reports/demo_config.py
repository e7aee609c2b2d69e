"""Every value the `agent-rft demo` run uses, in one place: model, task, the starting agent's
browsing traces and supervised job, the reinforcement job's grader and hyperparameters, and the
time budget. Change them here; demo.py and benchmarks/demo_learning only read them. `DEMO` is the
real run (SmolLM2-135M-Instruct); `QUICK` is the `--quick` run the tests use (a tiny random model,
one step of each job).

The story is Agent RFT's: a starting agent that over-browses (made here by supervised fine-tuning
on a scripted browsing policy's traces, examples/financial_reports/traces.py), then reinforcement
fine-tuning with a grader that rewards the right answer and charges for every tool call and token.
Why these values: benchmarks/demo_learning/README.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from examples.financial_reports.grader_server import Charges
from examples.financial_reports.traces import BROWSING_PROMPT, CAT_LIMIT

# What the comparison counts as correct: the first number of the answer that is not a
# bare year matches the report's figure (with its scale, within 1 %).
CORRECT_ANSWER: dict[str, Any] = {
    "type": "numeric_match", "name": "correct", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
    "scale": "{{item.scale}}", "pick": "first", "ignore_years": True}


def grader_spec(grader_url: str) -> dict[str, Any]:
    """The reinforcement job's grader: the example grader server (examples/financial_reports/
    grader_server.py), the right number x the efficiency of finding it, read from the tool server's
    call log and the rollout's token counts."""
    return {"type": "endpoint", "name": "correct and efficient", "url": f"{grader_url}/grade"}


@dataclass(frozen=True)
class DemoConfig:
    # --- model and task (examples/financial_reports/demo_task.py) ---
    model: str = "SmolLM2-135M-Instruct"
    seed: int = 0  # corpus, traces and training seed
    companies: int = 16  # synthetic companies; one question per report about its revenue and its net income
    years: tuple[int, ...] = (2022, 2023)
    held_out_companies: int = 6  # their questions are never trained on: evaluated at every stage
    held_out_rows: int = 24  # how many held-out questions the evaluations ask
    # The training companies are split: the starting agent's traces are about some, the
    # reinforcement job's questions about the others (the last `rft_companies`). On the same
    # questions, reinforcement rewarded answering from memory what the traces had taught (seed 0:
    # one call per rollout, 29 % -> 8 % correct on held-out companies).
    rft_companies: int = 5
    system_prompt: str = BROWSING_PROMPT
    tool_budget: int = 10  # tool calls per rollout (max_episode_steps), as in Agent RFT's demo

    # --- stage 1, the starting agent: a supervised job on browsing traces ---
    traces_per_question: int = 1
    cat_limit: int = CAT_LIMIT  # characters a trace's `cat` reads
    # Batches of 1: twenty optimizer steps over the 20 traces (five steps of 8 left the agent
    # writing half-formed calls; the cost is per token, not per step).
    sft_hyperparameters: dict[str, Any] = field(default_factory=lambda: {"batch_size": 1, "n_epochs": 1})
    sft_x_open_model: dict[str, Any] = field(default_factory=lambda: {
        "training_mode": "lora", "lora_rank": 16, "lora_alpha": 32, "learning_rate": 1e-3, "max_seq_tokens": 1024})

    # --- stage 2, reinforcement fine-tuning from the starting agent's ft: model ---
    # The grader server's charges: a right answer scores 1 - 0.1 per call after the first - 0.25 per
    # 1,000 tokens written and read, at least 0.2; a wrong one 0.
    charges: Charges = Charges(free_calls=1, call_penalty=0.1, token_penalty=0.25, floor=0.2)
    # The training rows are sized so that the job runs this many steps. Four left seed 2's agent at
    # 4.0 calls and seed 0 at +4 points (benchmarks/demo_learning); once the agent stops browsing a
    # step takes 10-20 s, so the last four add about a minute.
    steps: int = 8
    hyperparameters: dict[str, Any] = field(default_factory=lambda: {
        "batch_size": 4, "compute_multiplier": 1,  # 4 questions x 4 rollouts per step
        "eval_interval": 100, "eval_samples": 4})  # eval_interval > steps: validated at the last step only
    x_open_model: dict[str, Any] = field(default_factory=lambda: {
        # 3e-4 on the supervised adapter: at 1e-3 one step took the agent from 2.7 calls to 0.9 and
        # the third step's answers were mostly wrong (train reward 0.48 -> 0.35 -> 0.04, seed 0).
        "loss": "grpo", "kl_coef": 0.0, "learning_rate": 3e-4, "max_tokens_per_turn": 64,
        "max_tokens_per_rollout": 384, "temperature": 0.7})

    # --- precision: bfloat16 where the CPU computes it natively (AVX512-BF16 / AMX; about 1.5x
    # faster for sampling and training), float32 elsewhere. `dtype()` resolves it; both jobs'
    # x_open_model.dtype and `agent-rft eval --dtype` get the resolved value.
    bf16_where_native: bool = True

    # --- `agent-rft compare` on the held-out questions: eval runs sampling as the reinforcement job
    # did (its tools, budget, token caps, temperature), graded by its grader and by CORRECT_ANSWER ---
    evaluate_base: bool = True  # the untrained model too (it never calls a tool with this prompt)
    eval_rollouts_per_row: int = 1

    # --- limits: they only stop a run that hangs, or a much slower machine ---
    # On 2 AVX2 cores in float32 the reinforcement job alone took 9-19 minutes (benchmarks/demo_learning).
    time_budget_s: float = 60 * 60  # the whole demo; past it, everything stops and the demo fails
    startup_timeout_s: float = 180  # per service (the tool server embeds the corpus at start)
    job_timeout_s: float = 40 * 60  # one job or one evaluation


def dtype(cfg: DemoConfig) -> str:
    """The precision the demo runs in here: bfloat16 on a GPU or on a CPU with native bf16
    (when `bf16_where_native`), else float32."""
    if not cfg.bf16_where_native:
        return "float32"
    import torch

    from workers.models.loading import native_bf16_cpu

    return "bfloat16" if torch.cuda.is_available() or native_bf16_cpu() else "float32"


DEMO = DemoConfig()

QUICK = replace(
    DEMO, model="tiny-smollm2", companies=3, years=(2022, 2023), held_out_companies=1, held_out_rows=2,
    rft_companies=1, tool_budget=2,
    sft_hyperparameters={"batch_size": 4, "n_epochs": 1},
    sft_x_open_model={"lora_rank": 4, "learning_rate": 1e-3, "max_seq_tokens": 512}, steps=1,
    hyperparameters={"batch_size": 2, "compute_multiplier": 0.5, "eval_interval": 100, "eval_samples": 2},
    x_open_model={"max_tokens_per_turn": 12, "max_tokens_per_rollout": 24, "temperature": 1.0},
    time_budget_s=5 * 60, startup_timeout_s=120, job_timeout_s=4 * 60)
