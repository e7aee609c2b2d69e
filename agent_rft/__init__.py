"""agent-rft's library: what the API (`app/`) and the workers (`workers/`) both run. The graders,
outbound HTTP to user URLs (the SSRF guard, the one retry policy, per-URL backpressure), trace
ids, ids and optional extras. It imports nothing of `app` or `workers` (pyproject.toml's
import-linter contracts)."""
