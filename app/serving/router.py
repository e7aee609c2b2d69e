"""`/v1/chat/completions` (forwarded to the inference server) and `/v1/models`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from app.core.deps import CurrentKey, SessionDep, SettingsDep, done_with_database
from app.core.errors import bad_request
from app.core.openai_body import parse_body
from app.serving import service
from app.serving.client import InferenceClient
from app.serving.schemas import ChatCompletionRequest, ModelDeleted, ModelList, ModelObject, NamedToolChoice

router = APIRouter(prefix="/v1", tags=["serving"])


def inference_client(request: Request) -> InferenceClient:
    state = request.app.state
    if getattr(state, "inference", None) is None:
        state.inference = InferenceClient(state.settings)
    return state.inference


def check_request(body: Any) -> ChatCompletionRequest:
    """The request as OpenAI's SDK sends it; 400 naming the first field that is wrong or unsupported."""
    checked = parse_body(ChatCompletionRequest, body)
    _check_tool_choice(checked)
    if checked.stream_options is not None and not checked.stream:
        raise bad_request("stream_options is only allowed when stream is true.", param="stream_options")
    return checked


def _check_tool_choice(checked: ChatCompletionRequest) -> None:
    names = {t["function"]["name"] for t in checked.tools or []}
    if isinstance(checked.tool_choice, NamedToolChoice) and checked.tool_choice.function.name not in names:
        raise bad_request(f"tool_choice names the function '{checked.tool_choice.function.name}', which is not in "
                          "'tools'.", param="tool_choice")
    if checked.tool_choice == "required" and not names:
        raise bad_request("tool_choice 'required' needs at least one tool in 'tools'.", param="tool_choice")


@router.post("/chat/completions", response_model=None)
async def create_chat_completion(
    request: Request, principal: CurrentKey, session: SessionDep, settings: SettingsDep,
    body: Any = Body(..., openapi_examples={"chat": {"value": {"model": "SmolLM2-135M-Instruct", "messages": [
        {"role": "user", "content": "Hello"}]}}}),
) -> Response:
    """OpenAI's chat completions, for base models, fine-tuned models and their checkpoints."""
    checked = check_request(body)
    model = await run_in_threadpool(service.resolve, session=session, settings=settings,
                                    project_id=principal.project_id, name=checked.model)
    await done_with_database(request)  # the model's answer may take minutes
    payload = checked.model_dump(exclude_none=True)
    inference = inference_client(request)
    if checked.stream:
        return await inference.stream(payload, model.to_wire())
    return await inference.complete(payload, model.to_wire())


@router.get("/models", response_model=ModelList)
def list_models(principal: CurrentKey, session: SessionDep, settings: SettingsDep) -> ModelList:
    return service.list_models(session=session, settings=settings, project_id=principal.project_id)


@router.get("/models/{model:path}", response_model=ModelObject)
def retrieve_model(model: str, principal: CurrentKey, session: SessionDep, settings: SettingsDep) -> ModelObject:
    return service.get_model(session=session, settings=settings, project_id=principal.project_id, name=model)


@router.delete("/models/{model:path}", response_model=ModelDeleted)
def delete_model(model: str, principal: CurrentKey, session: SessionDep, settings: SettingsDep) -> ModelDeleted:
    return service.delete_model(session=session, settings=settings, project_id=principal.project_id, name=model)
