"""Importing this package registers every grader type with `agent_rft.graders.core.grade`."""

from agent_rft.graders.implementations import (  # noqa: F401
    endpoint,
    model_graders,
    multi,
    numeric_match,
    python_grader,
    string_check,
    text_similarity,
)
