"""OpenAI Responses: /v1/responses."""

from fastapi import APIRouter, Request

from exo.api.adapters.responses import ResponseEncoder, ResponsesRequest, to_task_params
from exo.api.generation import respond
from exo.api.placing import AutoPlacerDep
from exo.api.port import ClusterDep

router = APIRouter(prefix="/v1")


@router.post("/responses")
async def create_response(request: Request, cluster: ClusterDep, placer: AutoPlacerDep, body: ResponsesRequest):
    return await respond(
        request,
        cluster,
        placer,
        to_task_params(body),
        lambda command_id: ResponseEncoder(body, f"resp_{command_id}"),
        bool(body.stream),
    )
