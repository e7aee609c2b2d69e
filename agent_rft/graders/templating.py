"""`{{item.field}}`, `{{sample.output_json.key}}`, `{{sample.output_tools[0].function.name}}`.

A template is text with `{{ path }}` holes. A path starts at `item` or `sample` and walks
object keys (`.name`) and list indexes (`[0]`). A hole that names nothing is an
`invalid_variable_error`, never a crash.
"""

from __future__ import annotations

import json
import re
from typing import Any

from agent_rft.graders.core import GraderError, Sample

_HOLE = re.compile(r"\{\{\s*(.*?)\s*\}\}")
_STEP = re.compile(r"\.?([A-Za-z_][A-Za-z0-9_\-]*)|\[(-?\d+)\]|\[\s*[\"']([^\"']*)[\"']\s*\]")
ROOTS = ("item", "sample")


def _steps(path: str) -> list[str | int]:
    steps: list[str | int] = []
    pos = 0
    while pos < len(path):
        match = _STEP.match(path, pos)
        if not match or match.end() == pos:
            raise GraderError("invalid_variable_error", f"cannot read template variable '{{{{{path}}}}}'")
        name, index, quoted = match.groups()
        steps.append(int(index) if index is not None else (name if name is not None else quoted))
        pos = match.end()
    return steps


def resolve(path: str, sample: Sample, item: dict[str, Any]) -> Any:
    steps = _steps(path)
    if not steps or steps[0] not in ROOTS:
        raise GraderError("invalid_variable_error", f"template variable '{{{{{path}}}}}' must start with item or sample")
    if steps[:2] == ["sample", "output_json"] and sample.output_json is None:
        raise GraderError("sample_parse_error", f"'{{{{{path}}}}}' needs the sample's output to be JSON, and it is not")
    value: Any = item if steps[0] == "item" else sample.as_dict()
    for depth, step in enumerate(steps[1:], start=1):
        try:
            if isinstance(step, int):
                if not isinstance(value, list):
                    raise TypeError
                value = value[step]
            else:
                if not isinstance(value, dict):
                    raise TypeError
                value = value[step]
        except (KeyError, IndexError, TypeError):
            walked = steps[0] + "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in steps[1 : depth + 1])
            raise GraderError("invalid_variable_error", f"template variable '{walked}' does not exist") from None
    return value


def to_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return json.dumps(value, ensure_ascii=False)


def content_text(content: Any) -> str:
    """A chat message's content as text: a string as it is, the text of a list of content parts
    joined (other parts dropped), anything else empty."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def render(template: str, sample: Sample, item: dict[str, Any]) -> str:
    """Fill every `{{ path }}` hole with the text of the value it names."""
    return _HOLE.sub(lambda m: to_text(resolve(m.group(1), sample, item)), template)


def check_template(template: str) -> None:
    """Creation-time check: every hole parses and starts at item or sample."""
    for hole in _HOLE.findall(template):
        steps = _steps(hole)
        if not steps or steps[0] not in ROOTS:
            raise ValueError(f"template variable '{{{{{hole}}}}}' must start with item or sample")
