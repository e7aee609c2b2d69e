"""OpenAI's Responses API (`/v1/responses`), served through chat completions (docs/responses.md)."""
