"""`agent-rft checkpoints download` as a user runs it: the installed executable against a live
server, a checkpoint pushed by a worker through the internal API; and against a server whose
archive tries to write outside the folder."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import Response

from tests.conftest import Api, live_server, serve_app
from tests.test_cli_client import AGENT_RFT, cli_env
from tests.test_internal import Worker, queued_job


def agent_rft(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([AGENT_RFT, *args], check=False, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def lora_checkpoint(tmp_path) -> Path:
    """The files of a LoRA checkpoint (contents need not be a real adapter here; the API tests load real ones)."""
    path = tmp_path / "storage" / "step-3"
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text('{"r": 4, "base_model_name_or_path": "/root/.cache/x"}')
    (path / "adapter_model.safetensors").write_bytes(os.urandom(3 * 1024 * 1024 + 17))  # several chunks
    (path / "tokenizer.json").write_text("{}")
    return path


@pytest.fixture
def served_checkpoint(settings, project, tmp_path, lora_checkpoint):
    """(CLI env, job id, checkpoint id) with the checkpoint pushed to a live server."""
    with live_server(settings) as base_url, httpx.Client(base_url=base_url) as http:
        api = Api(http, project["key"])
        worker = Worker(http, settings.worker_token.get_secret_value())
        job_id = queued_job(api)
        assert worker.claim(job_id).status_code == 200
        pushed = worker.leased("PUT", f"/jobs/{job_id}/checkpoints/3", path=str(lora_checkpoint), metrics={})
        env = cli_env(tmp_path, AGENT_RFT_BASE_URL=f"{base_url}/v1", AGENT_RFT_API_KEY=project["key"])
        yield env, job_id, pushed.json()["id"]


def test_download_extracts_the_checkpoint_and_prints_how_to_load_it(served_checkpoint, lora_checkpoint, tmp_path):
    env, job_id, checkpoint_id = served_checkpoint
    work = tmp_path / "work"
    work.mkdir()
    result = agent_rft("checkpoints", "download", job_id, checkpoint_id, env=env, cwd=work)
    assert result.returncode == 0, result.stderr
    folder = work / f"{job_id}-step-3"
    assert sorted(p.name for p in folder.iterdir()) == [
        "README.md", "adapter_config.json", "adapter_model.safetensors", "tokenizer.json"]
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json"):
        assert (folder / name).read_bytes() == (lora_checkpoint / name).read_bytes()
    assert os.listdir(work) == [folder.name]  # no temporary files left
    assert f"saved LoRA adapter to {folder}" in result.stdout
    assert 'from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")' in result.stdout
    assert f'PeftModel.from_pretrained(base, "{folder}")' in result.stdout and "README.md" in result.stdout

    again = agent_rft("checkpoints", "download", job_id, checkpoint_id, env=env, cwd=work)
    assert again.returncode == 1 and "already exists" in again.stderr

    chosen = tmp_path / "elsewhere" / "adapter"
    elsewhere = agent_rft("checkpoints", "download", job_id, checkpoint_id, "--output", str(chosen), env=env, cwd=work)
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert (chosen / "adapter_model.safetensors").read_bytes() == (lora_checkpoint / "adapter_model.safetensors").read_bytes()


def test_download_errors_print_the_api_message(served_checkpoint, lora_checkpoint, tmp_path):
    env, job_id, checkpoint_id = served_checkpoint
    unknown = agent_rft("checkpoints", "download", job_id, "ftckpt_nope", env=env, cwd=tmp_path)
    assert unknown.returncode == 1
    assert "checkpoint_not_found: No such checkpoint: 'ftckpt_nope' (param: checkpoint_id)" in unknown.stderr
    for path in lora_checkpoint.iterdir():
        path.unlink()
    gone = agent_rft("checkpoints", "download", job_id, checkpoint_id, env=env, cwd=tmp_path)
    assert gone.returncode == 1 and "checkpoint_files_missing" in gone.stderr and "Traceback" not in gone.stderr
    assert not list(tmp_path.glob(".agent-rft-download-*")) and not (tmp_path / f"{job_id}-step-3").exists()


def _tar(*names: str) -> bytes:
    """Files named `names`; `name -> target` is a symbolic link."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name in names:
            info = tarfile.TarInfo(name.split(" -> ")[0])
            if " -> " in name:
                info.type, info.linkname = tarfile.SYMTYPE, name.split(" -> ")[1]
                tar.addfile(info)
            else:
                info.size = 2
                tar.addfile(info, io.BytesIO(b"hi"))
    return out.getvalue()


@pytest.mark.parametrize("names", [("ftjob-x-step-1/ok.txt", "ftjob-x-step-1/../../escaped.txt"),
                                   ("/tmp/absolute-escape.txt",),
                                   ("ftjob-x-step-1/ok.txt", "ftjob-x-step-1/passwd -> /etc/passwd"),
                                   ("ftjob-x-step-1/ok.txt", "ftjob-x-step-1/up -> ../../..")])
def test_members_that_escape_the_folder_are_refused(tmp_path, names):
    hostile = FastAPI()

    @hostile.get("/v1/fine_tuning/jobs/{job_id}/checkpoints/{checkpoint_id}/content")
    def content(job_id: str, checkpoint_id: str) -> Response:
        return Response(_tar(*names), media_type="application/x-tar")

    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    with serve_app(hostile) as port:
        result = agent_rft("checkpoints", "download", "ftjob-x", "ftckpt_x", "--base-url", f"http://127.0.0.1:{port}/v1",
                           "--api-key", "sk-x", env=cli_env(tmp_path), cwd=work)
    assert result.returncode == 1 and "refused the checkpoint archive" in result.stderr, result.stderr
    assert not (tmp_path / "escaped.txt").exists() and not (tmp_path / "a" / "escaped.txt").exists()
    assert os.listdir(work) == []
