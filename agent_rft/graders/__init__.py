"""Every grader type OpenAI's fine-tuning API defines, with no web code: the API runs them for
`/v1/fine_tuning/alpha/graders/run` and the workers for training, evaluation and the variance
diagnostic (docs/graders.md)."""
