import pytest
from pydantic import ValidationError

from app.core.config import Settings
from workers.celery_app import make_celery


def test_embedded_defaults_need_no_server(tmp_path, monkeypatch):
    monkeypatch.delenv("AGENT_RFT_DATABASE_URL", raising=False)
    monkeypatch.delenv("AGENT_RFT_BROKER_URL", raising=False)
    settings = Settings(_env_file=None, data_dir=tmp_path)
    assert settings.resolved_database_url == f"sqlite:///{tmp_path.resolve()}/agent_rft.sqlite3"
    assert settings.resolved_broker_url == f"sqla+sqlite:///{tmp_path.resolve()}/broker.sqlite3"
    assert settings.resolved_storage_dir == (tmp_path / "files").resolve()
    assert settings.outbound_allowlist == []


def test_plain_postgres_and_redis_urls_from_environment(monkeypatch):
    monkeypatch.setenv("AGENT_RFT_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/agent_rft")
    monkeypatch.setenv("AGENT_RFT_BROKER_URL", "redis://127.0.0.1:6379/0")
    monkeypatch.setenv("AGENT_RFT_OUTBOUND_ALLOWLIST", "127.0.0.1, localhost,10.0.0.0/8")
    settings = Settings(_env_file=None)
    assert settings.resolved_database_url == "postgresql+psycopg://postgres@127.0.0.1:5432/agent_rft"
    assert settings.resolved_broker_url == "redis://127.0.0.1:6379/0"
    assert settings.outbound_allowlist == ["127.0.0.1", "localhost", "10.0.0.0/8"]
    assert make_celery(settings).conf.broker_url == "redis://127.0.0.1:6379/0"


def test_dotenv_file_is_read(tmp_path, monkeypatch):
    monkeypatch.delenv("AGENT_RFT_TRAINING_QUEUE", raising=False)
    env = tmp_path / ".env"
    env.write_text("AGENT_RFT_TRAINING_QUEUE=gpu-a100\n")
    assert Settings(_env_file=env).training_queue == "gpu-a100"


def test_bad_allowlist_cidr_is_refused():
    with pytest.raises(ValidationError, match="outbound_allowlist"):
        Settings(_env_file=None, outbound_allowlist="10.0.0.0/33")


def test_production_refuses_the_development_worker_token():
    with pytest.raises(ValidationError, match="AGENT_RFT_WORKER_TOKEN"):
        Settings(_env_file=None, environment="production")
    assert Settings(_env_file=None, environment="production", worker_token="s3cret-token").environment == "production"


def test_worker_token_is_never_printed():
    settings = Settings(_env_file=None, worker_token="very-secret-token")
    assert "very-secret-token" not in repr(settings)
