"""GET /v1/fine_tuning/jobs/{id}/checkpoints/{id}/content: real checkpoint directories (a PEFT
adapter and a full model of the tiny model, as the trainer writes them), pushed by a worker
through the internal API, downloaded as a tar, extracted and loaded back with peft/transformers:
same logits as the model that was saved. Also project scoping, the 404s, and path safety."""

from __future__ import annotations

import io
import os
import shutil
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy import update

from app.jobs.models import Checkpoint
from tests.conftest import Api, make_project
from tests.test_internal import Worker, queued_job

INPUT_IDS = torch.tensor([[1, 42, 7, 99, 3, 512, 11]])
RESOLVED = {"batch_size": 2, "n_epochs": 1, "learning_rate_multiplier": 1.0, "group_size": 4}


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=INPUT_IDS).logits


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Any]:
    """A LoRA adapter directory and a full model directory of tiny-smollm2, each with the logits
    of the model it was saved from; both differ from the base model."""
    from workers.models.loading import load_model
    from workers.models.lora import apply_lora
    from workers.models.registry import save_model_dir

    root = tmp_path_factory.mktemp("checkpoints")
    torch.manual_seed(0)
    loaded = load_model("tiny-smollm2")
    base_path, base_logits = loaded.path, _logits(loaded.model)
    adapted = apply_lora(loaded, rank=4, alpha=8)
    with torch.no_grad():  # LoRA's B starts at zero (no change); give the adapter an effect
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    lora_dir = root / "lora" / "step-3"
    lora_dir.mkdir(parents=True)
    adapted.save_pretrained(str(lora_dir))
    loaded.tokenizer.save_pretrained(str(lora_dir))

    full = load_model("tiny-smollm2")
    with torch.no_grad():
        for parameter in full.model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    full_dir = root / "full" / "step-2"
    full_dir.mkdir(parents=True)
    save_model_dir(full.model, full.tokenizer, full_dir)
    lora_logits, full_logits = _logits(adapted), _logits(full.model)
    assert not torch.allclose(lora_logits, base_logits) and not torch.allclose(full_logits, base_logits)
    return {"base_path": base_path, "lora": lora_dir, "lora_logits": lora_logits, "full": full_dir,
            "full_logits": full_logits}


@pytest.fixture
def worker(client, settings) -> Worker:  # noqa: ANN001
    return Worker(client, settings.worker_token.get_secret_value())


def checkpointed_job(api: Api, worker: Worker, path: Path, step: int, **job: Any) -> tuple[str, str]:
    """A running job whose worker resolved its hyperparameters and pushed a checkpoint at `path`."""
    job_id = queued_job(api, **job)
    assert worker.claim(job_id).status_code == 200
    worker.leased("POST", f"/jobs/{job_id}/state", completed_steps=step, resume_state=f"/state/{step}",
                  resolved_hyperparameters=RESOLVED)
    pushed = worker.leased("PUT", f"/jobs/{job_id}/checkpoints/{step}", path=str(path),
                           metrics={"valid_reward_mean": 0.625, "train_reward_mean": 0.5})
    assert pushed.status_code == 200, pushed.text
    return job_id, pushed.json()["id"]


def content_url(job_id: str, checkpoint_id: str) -> str:
    return f"/v1/fine_tuning/jobs/{job_id}/checkpoints/{checkpoint_id}/content"


def download(api: Api, job_id: str, checkpoint_id: str, into: Path) -> tuple[Path, list[str]]:
    """The archive, checked and extracted; (its folder, its member names)."""
    response = api.get(content_url(job_id, checkpoint_id))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/x-tar"
    top = response.headers["content-disposition"].split('filename="')[1].rstrip('"').removesuffix(".tar")
    assert int(response.headers["content-length"]) == len(response.content)
    with tarfile.open(fileobj=io.BytesIO(response.content), mode="r:") as tar:
        names = tar.getnames()
        assert all(name == top or name.startswith(f"{top}/") for name in names)
        assert all(m.isfile() or m.isdir() for m in tar.getmembers())
        tar.extractall(into, filter="data")
    return into / top, names


def test_a_lora_checkpoint_downloads_and_loads_with_peft(api, worker, project, saved, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    job_id, checkpoint_id = checkpointed_job(api, worker, saved["lora"], 3,
                                             reinforcement={"x_open_model": {"lora_rank": 4, "lora_alpha": 8}})
    folder, names = download(api, job_id, checkpoint_id, tmp_path)
    assert folder.name == f"{job_id}-step-3"
    files = {Path(n).relative_to(folder.name).as_posix() for n in names if n != folder.name}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "README.md"} <= files
    assert names.count(f"{folder.name}/README.md") == 1  # PEFT's own model card is replaced

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(saved["base_path"]), str(folder))
    assert torch.allclose(_logits(model), saved["lora_logits"], atol=1e-5)

    readme = (folder / "README.md").read_text()
    checkpoint_name = f"ft:SmolLM2-135M-Instruct:{project['name']}::{job_id}:ckpt-step-3"
    for expected in (job_id, checkpoint_id, checkpoint_name, "| Base model | `SmolLM2-135M-Instruct` |",
                     "| Step | 3 |", "LoRA adapter (rank 4, alpha 8)", '"group_size": 4', '"valid_reward_mean": 0.625',
                     "PeftModel.from_pretrained(base", 'from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")',
                     "base_model_name_or_path", "Q4_1 GGUF",
                     f"vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --enable-lora --lora-modules "
                     f"{folder.name}=./{folder.name}"):
        assert expected in readme, expected


def test_a_full_checkpoint_downloads_and_loads_with_transformers(api, worker, saved, tmp_path):
    from transformers import AutoModelForCausalLM

    job_id, checkpoint_id = checkpointed_job(api, worker, saved["full"], 2,
                                             reinforcement={"x_open_model": {"training_mode": "full"}})
    folder, names = download(api, job_id, checkpoint_id, tmp_path)
    assert folder.name == f"{job_id}-step-2"
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "README.md"} <= {
        p.name for p in folder.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    assert torch.allclose(_logits(model), saved["full_logits"], atol=1e-5)
    readme = (folder / "README.md").read_text()
    assert "full fine-tuning" in readme and f'AutoModelForCausalLM.from_pretrained("{folder.name}")' in readme
    assert "PeftModel" not in readme and f"vllm serve ./{folder.name}" in readme


def test_only_regular_files_inside_the_directory_are_archived(api, worker, tmp_path):
    checkpoint = tmp_path / "ckpt" / "step-1"
    (checkpoint / "nested").mkdir(parents=True)
    (checkpoint / "config.json").write_text("{}")
    (checkpoint / "nested" / "part.bin").write_bytes(os.urandom(70_000))  # over one chunk of padding math
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    os.symlink(secret, checkpoint / "leak.txt")
    os.symlink(tmp_path, checkpoint / "outside")
    os.mkfifo(checkpoint / "pipe")
    job_id, checkpoint_id = checkpointed_job(api, worker, checkpoint, 1)
    folder, names = download(api, job_id, checkpoint_id, tmp_path / "out")
    assert sorted(n.removeprefix(folder.name).lstrip("/") for n in names) == [
        "", "README.md", "config.json", "nested", "nested/part.bin"]
    assert (folder / "nested" / "part.bin").read_bytes() == (checkpoint / "nested" / "part.bin").read_bytes()


def test_other_projects_and_unknown_ids_are_404(api, client, settings, worker, saved):
    job_id, checkpoint_id = checkpointed_job(api, worker, saved["full"], 2)
    other_job = queued_job(api)

    stranger = Api(client, make_project(settings)["key"]).get(content_url(job_id, checkpoint_id))
    assert stranger.status_code == 404 and stranger.json()["error"]["code"] == "fine_tuning_job_not_found"
    unknown_job = api.get(content_url("ftjob-nope", checkpoint_id))
    assert unknown_job.status_code == 404 and unknown_job.json()["error"]["code"] == "fine_tuning_job_not_found"
    for job, checkpoint in ((job_id, "ftckpt_nope"), (other_job, checkpoint_id)):
        response = api.get(content_url(job, checkpoint))
        assert response.status_code == 404
        assert response.json()["error"] | {"message": None} == {
            "code": "checkpoint_not_found", "param": "checkpoint_id", "type": "invalid_request_error", "message": None}
    assert api.get(content_url(job_id, checkpoint_id)).status_code == 200
    assert client.get(content_url(job_id, checkpoint_id)).status_code == 401


def test_a_checkpoint_whose_files_are_gone_is_a_clear_404(api, app, worker, saved, tmp_path):
    copy = tmp_path / "copy" / "step-2"
    shutil.copytree(saved["full"], copy)
    job_id, checkpoint_id = checkpointed_job(api, worker, copy, 2)
    assert api.get(content_url(job_id, checkpoint_id)).status_code == 200

    shutil.rmtree(copy)
    gone = api.get(content_url(job_id, checkpoint_id))
    assert gone.status_code == 404
    error = gone.json()["error"]
    assert error["code"] == "checkpoint_files_missing" and error["param"] == "checkpoint_id"
    assert checkpoint_id in error["message"] and "deleted" in error["message"] and str(copy) not in error["message"]

    copy.mkdir(parents=True)  # an empty directory: a deletion caught half-way
    assert api.get(content_url(job_id, checkpoint_id)).json()["error"]["code"] == "checkpoint_files_missing"

    with app.state.session_factory.begin() as session:
        session.execute(update(Checkpoint).where(Checkpoint.id == checkpoint_id).values(path=None))
    unrecorded = api.get(content_url(job_id, checkpoint_id))
    assert unrecorded.status_code == 404 and unrecorded.json()["error"]["code"] == "checkpoint_files_missing"


def test_the_route_is_documented_with_the_checkpoints(client):
    paths = client.get("/openapi.json").json()["paths"]
    operation = paths["/v1/fine_tuning/jobs/{fine_tuning_job_id}/checkpoints/{checkpoint_id}/content"]["get"]
    assert operation["tags"] == ["fine-tuning"] and "application/x-tar" in operation["responses"]["200"]["content"]


def test_a_checkpoint_deleted_after_the_response_started_still_streams_whole(tmp_path):
    """The files are opened before the first byte goes out: pruning meanwhile cuts nothing."""
    from app.jobs.archive import open_directory

    checkpoint = tmp_path / "step-4"
    checkpoint.mkdir()
    weights = os.urandom(2 * 1024 * 1024 + 3)
    (checkpoint / "model.safetensors").write_bytes(weights)
    archive = open_directory(checkpoint, top="ftjob-x-step-4")
    chunks = iter(archive)
    first = next(chunks)
    shutil.rmtree(checkpoint)
    data = first + b"".join(chunks)
    assert len(data) == archive.size
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        assert tar.extractfile("ftjob-x-step-4/model.safetensors").read() == weights
