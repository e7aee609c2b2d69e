"""Importing this package registers every grader type with `app.graders.core.grade`."""

from app.graders.implementations import (  # noqa: F401
    endpoint,
    model_graders,
    multi,
    numeric_match,
    python_grader,
    string_check,
    text_similarity,
)
