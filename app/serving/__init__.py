"""Serving: `/v1/chat/completions` and `/v1/models` (the API side; inference runs in workers/inference/)."""
