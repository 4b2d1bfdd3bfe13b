"""OpenAI legacy Completions: /v1/completions."""

from fastapi import APIRouter, Request

from exo.api.adapters.completions import CompletionEncoder, CompletionRequest, to_task_params
from exo.api.checks import check_token_ids, local_tokenizer
from exo.api.generation import respond
from exo.api.placing import AutoPlacerDep
from exo.api.port import ClusterDep, ClusterPort

router = APIRouter(prefix="/v1")


def prompt_text(cluster: ClusterPort, body: CompletionRequest) -> str:
    prompt = body.one_prompt()
    if isinstance(prompt, str):
        return prompt
    tokenizer = local_tokenizer(cluster, body.model)
    check_token_ids(prompt, tokenizer)
    return tokenizer.decode(prompt) if tokenizer is not None else ""


@router.post("/completions")
async def create_completion(request: Request, cluster: ClusterDep, placer: AutoPlacerDep, body: CompletionRequest):
    text = prompt_text(cluster, body)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await respond(
        request,
        cluster,
        placer,
        to_task_params(body, text),
        lambda command_id: CompletionEncoder(
            f"cmpl-{command_id}", body.model, text if body.echo else "", include_usage
        ),
        bool(body.stream),
    )
