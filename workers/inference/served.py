"""What a served model is to the inference server, whichever backend generates: its name, tokenizer,
chat formatter and context window, and the checks of a checkpoint's files. No torch here: the front
of a vLLM fleet holds tokenizers only."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.engine.prompting import ChatFormatter


class ModelUnavailable(Exception):
    """A request names a model that cannot be served; `status` and `code` go to the client."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass
class ServedModel:
    """One servable model: its tokenizer and formatter, and the most tokens a request may span."""

    key: str
    tokenizer: Any
    formatter: ChatFormatter
    max_context: int


def checked_checkpoint_directory(checkpoint_path: str, root: Path | None) -> Path:
    """The checkpoint's directory, resolved; 404 checkpoint_files_missing when it is outside `root`
    (the server's checkpoint directory) or gone."""
    directory = Path(checkpoint_path).resolve()
    if root is not None and root not in directory.parents:
        raise ModelUnavailable(404, "checkpoint_files_missing",
                               "The checkpoint's files are not under this inference server's checkpoint "
                               "directory (AGENT_RFT_CHECKPOINT_DIR).")
    if not directory.is_dir():
        raise ModelUnavailable(404, "checkpoint_files_missing",
                               "The checkpoint's files are gone (deleted from the checkpoint storage), so it "
                               "cannot be served; use another checkpoint of the job.")
    return directory


def checkpoint_kind(directory: Path) -> str:
    """"lora" (a PEFT adapter) or "full" (a whole model); 404 when the directory holds neither."""
    if (directory / "adapter_config.json").is_file():
        return "lora"
    if (directory / "config.json").is_file():
        return "full"
    raise ModelUnavailable(404, "checkpoint_files_missing",
                           "The checkpoint's directory holds neither a LoRA adapter nor a model.")
