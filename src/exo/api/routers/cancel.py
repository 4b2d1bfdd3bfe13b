"""POST /v1/cancel/{id}: stop a running generation, whichever API asked for it."""

from typing import Any

from fastapi import APIRouter, Request

from exo.api.errors import ApiError
from exo.api.routers.cluster import node_of
from exo.routing.router import Topic
from exo.shared.types.commands import TaskFinished
from exo.shared.types.common import CommandId
from exo.shared.types.text_generation import ChunkGenerated

router = APIRouter(prefix="/v1")

# The ids clients see are the command id behind these prefixes (chat.completion,
# text_completion, Claude message, Responses response).
ID_PREFIXES = ("chatcmpl-", "cmpl-", "msg_", "resp_")


def command_id_of(request_id: str) -> CommandId:
    for prefix in ID_PREFIXES:
        if request_id.startswith(prefix):
            return CommandId(request_id.removeprefix(prefix))
    return CommandId(request_id)


@router.post("/cancel/{request_id}")
def cancel(request: Request, request_id: str) -> dict[str, Any]:
    """Finishing the task is what the disconnect path does: the master drops it and every
    rank's runner stops it. The cancelled chunk, published to every node, ends the
    client's stream at once, also for a request still waiting for its model to load."""
    node = node_of(request)
    command_id = command_id_of(request_id)
    running = any(task.command_id == command_id for task in node.replica.state.tasks.values())
    if not running and not request.app.state.chunk_streams.is_open(command_id):
        raise ApiError(404, f"no running request has id '{request_id}'", code="request_not_found")
    node.send_command(TaskFinished(finished_command_id=command_id))
    node.router.publish(Topic.CHUNKS, ChunkGenerated(command_id=command_id, finish_reason="cancelled"))
    return {"cancelled": True, "id": request_id}
