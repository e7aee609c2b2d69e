"""A streamed chat completion as the Responses API's server-sent events, in the order the `openai`
SDK's `client.responses.stream` accumulates them: `response.created`, `response.in_progress`, then
per output item `response.output_item.added`, its deltas (`response.output_text.delta` inside a
content part; `response.function_call_arguments.delta`), their `.done` events and
`response.output_item.done`, and last `response.completed` (or `response.incomplete`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from app.responses.convert import function_call_item, message_item, response_object
from app.responses.schemas import ResponseCreate


class ResponseEvents:
    """Turns chat chunks into Responses events, keeping the output built so far."""

    def __init__(self, body: ResponseCreate, response_id: str) -> None:
        self.body, self.response_id = body, response_id
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.text: dict[str, Any] | None = None  # the message item being streamed
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its function_call item
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def event(self, kind: str, **data: Any) -> bytes:
        self.sequence += 1
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()

    def snapshot(self, status: str | None = None) -> dict[str, Any]:
        return response_object(self.body, response_id=self.response_id, output=self.output,
                               finish_reason=self.finish_reason, usage=self.usage, status=status)

    def start(self) -> list[bytes]:
        return [self.event("response.created", response=self.snapshot("in_progress")),
                self.event("response.in_progress", response=self.snapshot("in_progress"))]

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call_delta(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def _text_delta(self, text: str) -> list[bytes]:
        events = []
        if self.text is None:
            self.text = message_item("", status="in_progress")
            part = self.text["content"][0]
            self.output.append(self.text)
            events.append(self.event("response.output_item.added", output_index=len(self.output) - 1,
                                     item={**self.text, "content": []}))
            events.append(self.event("response.content_part.added", item_id=self.text["id"],
                                     output_index=len(self.output) - 1, content_index=0, part={**part}))
        self.text["content"][0]["text"] += text
        events.append(self.event("response.output_text.delta", item_id=self.text["id"],
                                 output_index=self.output.index(self.text), content_index=0, delta=text, logprobs=[]))
        return events

    def _call_delta(self, call: dict[str, Any]) -> list[bytes]:
        events = []
        index = call.get("index", len(self.calls))
        function = call.get("function") or {}
        item = self.calls.get(index)
        if item is None:
            item = self.calls[index] = function_call_item(call.get("id") or f"call_{index}", function.get("name", ""),
                                                          "", status="in_progress")
            self.output.append(item)
            events.append(self.event("response.output_item.added", output_index=len(self.output) - 1, item={**item}))
        arguments = function.get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self.output.index(item), delta=arguments))
        return events

    def finish(self) -> tuple[list[bytes], dict[str, Any]]:
        """The closing events of every item and of the response, and the response as completed."""
        events = []
        for index, item in enumerate(self.output):
            item["status"] = "completed"
            if item["type"] == "message":
                part = item["content"][0]
                events.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                         content_index=0, text=part["text"], logprobs=[]))
                events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                         content_index=0, part=part))
            else:
                events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                         output_index=index, name=item["name"], arguments=item["arguments"]))
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        final = self.snapshot()
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        events.append(self.event(kind, response=final))
        return events, final


async def response_events(body: ResponseCreate, response_id: str, chunks: AsyncIterator[dict[str, Any]],
                          on_done: Callable[[dict[str, Any]], Awaitable[None]]) -> AsyncIterator[bytes]:
    """The whole event stream; `on_done(response)` runs once the answer is complete (storing it)."""
    events = ResponseEvents(body, response_id)
    for event in events.start():
        yield event
    async for chunk in chunks:
        for event in events.chunk(chunk):
            yield event
    closing, final = events.finish()
    await on_done(final)
    for event in closing:
        yield event
