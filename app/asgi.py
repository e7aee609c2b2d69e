"""`uvicorn app.asgi:app` entry point; `agent-rft serve` is the usual way."""

from app.main import create_app

app = create_app()
