"""`POST /v1/fine_tuning/alpha/tool/run`: one function call sent to a tool server as a rollout sends it."""
