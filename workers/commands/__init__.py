"""The worker-side command-line tools: `agent-rft rollout` and `agent-rft eval`."""
