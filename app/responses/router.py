"""`/v1/responses`: create (streamed or not), retrieve and delete, as the `openai` SDK's
`client.responses` calls them. A response is a chat completion of the same conversation, answered
by the inference server; no database connection is held while it is generated."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from app.core.deps import CurrentKey, SessionDep, SettingsDep, done_with_database, in_own_transaction
from agent_rft.ids import new_id
from app.core.openai_body import parse_body
from app.responses import convert, service
from app.responses.schemas import ResponseCreate
from app.responses.streaming import response_events
from app.serving import service as serving
from app.serving.router import check_request, inference_client

router = APIRouter(prefix="/v1", tags=["responses"])


@router.post("/responses", response_model=None)
async def create_response(
    request: Request, principal: CurrentKey, session: SessionDep, settings: SettingsDep,
    body: Any = Body(..., openapi_examples={"text": {"value": {"model": "SmolLM2-135M-Instruct", "input": "Hello"}}}),
) -> dict[str, Any] | StreamingResponse:
    """OpenAI's Responses API for base models, fine-tuned models and their checkpoints."""
    checked = parse_body(ResponseCreate, body)
    project_id = principal.project_id
    items = await run_in_threadpool(service.conversation, session=session, project_id=project_id, body=checked)
    chat = check_request(convert.chat_request(checked, items))
    model = await run_in_threadpool(serving.resolve, session=session, settings=settings, project_id=project_id,
                                    name=checked.model)
    await done_with_database(request)  # the model's answer may take minutes
    response_id = new_id("resp_")
    payload = chat.model_dump(exclude_none=True)

    async def keep(response: dict[str, Any]) -> None:
        if checked.store is not False:
            await in_own_transaction(request, service.store, project_id=project_id, items=items, response=response)

    inference = inference_client(request)
    if checked.stream:
        payload["stream_options"] = {"include_usage": True}
        chunks = await inference.chunks(payload, model.to_wire())
        return StreamingResponse(response_events(checked, response_id, chunks, keep), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    completion = await inference.completion(payload, model.to_wire())
    choice = completion["choices"][0]
    response = convert.response_object(checked, response_id=response_id, output=convert.output_items(choice),
                                       finish_reason=choice.get("finish_reason"), usage=completion.get("usage"))
    await keep(response)
    return response


@router.get("/responses/{response_id}")
def retrieve_response(response_id: str, principal: CurrentKey, session: SessionDep) -> dict[str, Any]:
    return service.get(session=session, project_id=principal.project_id, response_id=response_id)


@router.delete("/responses/{response_id}")
def delete_response(response_id: str, principal: CurrentKey, session: SessionDep) -> dict[str, Any]:
    return service.delete(session=session, project_id=principal.project_id, response_id=response_id)
