"""Fine-tuning methods in the control plane: what is particular to each `method.type`, one module
per method, each with the same few names:

- `TYPE`: its `method.type`;
- `stored_block(method, settings)`: the checked `method` block as it is stored (400 naming the field
  for what it refuses);
- `row_rule(declared_tools)`: how a row of the job's files is checked (a `RowProblem` for a bad one);
- `SCORE_KEYS`: the metric keys a checkpoint is ranked by (the first present counts) and their sign
  (higher is better once multiplied).

The workers' side is `workers/methods/` (how a job of each method is trained). Adding a method is a
module on each side and a line in each registry.
"""

from __future__ import annotations

from types import ModuleType

from app.jobs.methods import dpo, reinforcement, supervised

METHODS: dict[str, ModuleType] = {module.TYPE: module for module in (reinforcement, supervised, dpo)}
