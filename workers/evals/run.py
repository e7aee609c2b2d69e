"""An eval run on a worker, what the `run_eval` task runs: claim under a lease, heartbeat, the
items, the model (base, `ft:` model or checkpoint) with the training engine and the run's tools,
grading by every criterion, pushes chunk by chunk, finish. A cancelled run stops at the next chunk."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from app.evals.worker_schemas import RunClaimResponse
from workers.control_client import ControlPlaneClient, Heartbeat, run_under_lease
from workers.evals import items as evals

log = logging.getLogger(__name__)
CHUNK_ROLLOUTS = 32  # rollouts per engine run: generation is batched across them; progress after each


class EvalRunner:
    def __init__(self, client: ControlPlaneClient, claim: RunClaimResponse, settings: Any) -> None:
        self.client, self.settings = client, settings
        self.spec, self.lease_id = claim.run, claim.lease_id
        self.id = self.spec.id
        self.data_source = self.spec.data_source
        self.heartbeat = Heartbeat(client, self.id, self.lease_id, interval_s=max(1.0, settings.lease_seconds / 4),
                                   call=client.eval_run_heartbeat)

    async def run(self) -> str:
        """succeeded, failed, cancelled, lost or given_back; never raises."""
        return await run_under_lease(
            f"eval run {self.id}", self.heartbeat, self._run,
            lambda status, error: self.client.finish_eval_run(self.id, self.lease_id, status, error=error),
            failure=self._bad_source)

    @staticmethod
    def _bad_source(exc: Exception) -> dict[str, Any] | None:
        if not isinstance(exc, evals.BadSource):
            return None
        return {"code": "invalid_data_source", "message": f"The data source's file: {exc}.",
                "param": "data_source.source.id"}

    async def _run(self) -> str:
        from agent_rft.graders.core import GraderContext
        from workers.models.loading import load_model

        items = evals.items_of(await asyncio.to_thread(self._rows))
        samples = self.data_source.get("x_open_model", {}).get("samples_per_item", 1) if self.spec.model else 1
        done = {tuple(pair) for pair in self.spec.done}
        todo = [(item, k) for item in items for k in range(samples) if (item.index, k) not in done]
        await asyncio.to_thread(self.client.push_output_items, self.id, self.lease_id, [],
                                items_total=len(items) * samples)
        graders = evals.criteria_graders(self.spec.testing_criteria)
        todo = await self._set_aside_bad_items(todo, graders)
        ctx = GraderContext.from_settings(self.settings, load_judge_model=load_model)
        if not self.spec.model:
            return await self._grade_given(todo, graders, ctx)
        return await self._sample_and_grade(todo, graders, ctx)

    def _rows(self) -> list[dict[str, Any]]:
        source = self.data_source["source"]
        if source["type"] == "file_content":
            return source["content"]
        return evals.rows_of(self.client.file_content(source["id"]).decode("utf-8"))

    async def _set_aside_bad_items(self, todo: list[tuple[evals.Item, int]],
                                   graders: list[Any]) -> list[tuple[evals.Item, int]]:
        """Store the items that cannot be run as errored output items; the rest go on."""
        good, bad = [], []
        for item, k in todo:
            problem = evals.item_problem(item, self.spec.item_schema, needs_sample=not self.spec.model)
            if problem is None:
                good.append((item, k))
            else:
                bad.append(evals.input_error(item, k, problem))
        if bad:
            await self._push(bad, graders)
        return good

    async def _grade_given(self, todo: list[tuple[evals.Item, int]], graders: list[Any], ctx: Any) -> str:
        for start in range(0, len(todo), CHUNK_ROLLOUTS):
            if await self._cancelled():
                return "cancelled"
            graded = await evals.grade_samples(graders, ctx, [evals.given_sample(item)
                                                              for item, _ in todo[start:start + CHUNK_ROLLOUTS]])
            await self._push(graded, graders)
        return "succeeded"

    async def _sample_and_grade(self, todo: list[tuple[evals.Item, int]], graders: list[Any], ctx: Any) -> str:
        from workers.engine.prompting import ChatFormatter
        from workers.engine.rollout import RolloutEngine
        from workers.engine.tools_client import ToolClient

        loaded = await asyncio.to_thread(self._load)
        agent = self.data_source.get("x_open_model") or {}
        async with ToolClient(agent.get("tools") or [], allowlist=self.settings.outbound_allowlist) as tools:
            engine = RolloutEngine(loaded.model, loaded.tokenizer, ChatFormatter(loaded.tokenizer), tools,
                                   evals.engine_config(self.data_source))
            for start in range(0, len(todo), CHUNK_ROLLOUTS):
                if await self._cancelled():
                    return "cancelled"
                await self._push(await self._chunk(engine, todo[start:start + CHUNK_ROLLOUTS], graders, ctx), graders)
        return "succeeded"

    async def _chunk(self, engine: Any, chunk: list[tuple[evals.Item, int]], graders: list[Any],
                     ctx: Any) -> list[evals.Graded]:
        """Rollouts of the chunk's items (an item whose input cannot be built is an errored output item)."""
        from agent_rft.graders.core import GraderError, Sample

        specs, runnable, failed = [], [], []
        for item, k in chunk:
            try:
                specs.append(evals.spec_for_item(self.data_source, item, k))
                runnable.append((item, k))
            except (GraderError, ValueError, TypeError, KeyError) as exc:  # a field the input names is missing
                failed.append(evals.input_error(item, k, str(exc)))
        records = await engine.run(specs) if specs else []
        samples = [(item, k, record.trace_id, Sample.from_model_sample(record.grader_sample()), record)
                   for (item, k), record in zip(runnable, records)]
        return await evals.grade_samples(graders, ctx, samples) + failed

    def _load(self) -> Any:
        from workers.models.lora import load_start

        dtype = (self.data_source.get("x_open_model") or {}).get("dtype", "auto")
        loaded, _ = load_start(self.spec.model, self.spec.start_from, dtype=None if dtype == "auto" else dtype,
                               training_mode="lora")
        return loaded

    async def _push(self, graded: list[evals.Graded], graders: list[Any]) -> None:
        criteria, thresholds = self.spec.testing_criteria, [threshold for _, threshold in graders]
        items = [evals.output_item(g, criteria, thresholds, self.data_source, self.spec.model) for g in graded]
        await asyncio.to_thread(self.client.push_output_items, self.id, self.lease_id, items)

    async def _cancelled(self) -> bool:
        """Stop here: the user cancelled the run, or another worker has it (then no end is reported)."""
        return not await asyncio.to_thread(self.heartbeat.go_on)
