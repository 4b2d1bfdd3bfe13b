"""Anthropic Claude Messages: /v1/messages and /v1/messages/count_tokens."""

from fastapi import APIRouter, Request

from exo.api.adapters.claude_messages import (
    ClaudeCountTokensRequest,
    ClaudeMessagesRequest,
    MessageEncoder,
    approximate_token_count,
    prompt_text,
    to_task_params,
)
from exo.api.checks import local_tokenizer
from exo.api.generation import respond
from exo.api.placing import AutoPlacerDep, card_or_404
from exo.api.port import ClusterDep

router = APIRouter(prefix="/v1/messages")


@router.post("")
async def create_message(request: Request, cluster: ClusterDep, placer: AutoPlacerDep, body: ClaudeMessagesRequest):
    return await respond(
        request,
        cluster,
        placer,
        to_task_params(body),
        lambda command_id: MessageEncoder(f"msg_{command_id}", body.model),
        bool(body.stream),
    )


@router.post("/count_tokens")
def count_tokens(cluster: ClusterDep, body: ClaudeCountTokensRequest) -> dict[str, int]:
    card_or_404(cluster, body.model)
    text = prompt_text(body)
    # The model's own tokenizer when its files are on this node; it counts the messages'
    # text but not the few tokens the chat template adds around each message.
    tokenizer = local_tokenizer(cluster, body.model)
    if tokenizer is not None:
        return {"input_tokens": len(tokenizer.encode(text, add_special_tokens=False).ids)}
    return {"input_tokens": approximate_token_count(text)}
