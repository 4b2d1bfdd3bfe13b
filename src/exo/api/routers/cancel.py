"""POST /v1/cancel/{id}: stop a running generation, whichever API asked for it."""

from typing import Any

from fastapi import APIRouter

from exo.api.errors import ApiError
from exo.api.port import ClusterDep
from exo.shared.queries import has_task_for
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
def cancel(cluster: ClusterDep, request_id: str) -> dict[str, Any]:
    """Finishing the task is what the disconnect path does: the master drops it and every
    rank's runner stops it. The cancelled chunk, published to every node, ends the
    client's stream at once, also for a request still waiting for its model to load."""
    command_id = command_id_of(request_id)
    if not has_task_for(cluster.state, command_id) and not cluster.chunks_open(command_id):
        raise ApiError(404, f"no running request has id '{request_id}'", code="request_not_found")
    cluster.send_command(TaskFinished(finished_command_id=command_id))
    cluster.publish_chunk(ChunkGenerated(command_id=command_id, finish_reason="cancelled"))
    return {"cancelled": True, "id": request_id}
