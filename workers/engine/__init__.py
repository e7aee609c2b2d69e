"""The generation engine: rollouts of an agent against the customer's tools (prompting, tool-call
formats, the tools client, grading of what a rollout produced) and the sampler backends behind
them (the in-process engine, a vLLM fleet). Used by training, the variance diagnostic, the
`rollout` and `eval` commands and the inference server. Importing it imports no torch."""
