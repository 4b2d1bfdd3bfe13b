"""Checks on a generation request that no adapter can make alone: they need the model's
card or, where its files are on this node, its tokenizer (the API process never loads
the model itself)."""

import asyncio
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer

from exo.api.errors import ApiError
from exo.api.port import ClusterPort
from exo.shared.models.model_cards import ModelCard
from exo.shared.types.text_generation import TextGenerationTaskParams

# MLX seeds its generator with an unsigned 64-bit integer.
MAX_SEED = 2**64 - 1

# Content parts that carry media rather than text, as the adapters pass them on.
MEDIA_PARTS = {"image_url", "image", "input_image", "input_audio", "audio", "file", "input_file"}


@lru_cache(maxsize=8)
def _tokenizer_at(path: Path) -> Tokenizer | None:
    try:
        return Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception:  # missing or unreadable: callers fall back to an estimate
        return None


def local_tokenizer(cluster: ClusterPort, model: str) -> Tokenizer | None:
    """The model's fast tokenizer when its files are on this node, else None."""
    model_dir = cluster.local_model_dir(model)
    return _tokenizer_at(model_dir) if model_dir is not None else None


def prompt_token_count(tokenizer: Tokenizer, params: TextGenerationTaskParams) -> int:
    """The tokens of the prompt's text, without the few a chat template adds."""
    if isinstance(params.prompt, list):
        return len(params.prompt)
    if isinstance(params.prompt, str):
        text = params.prompt
    else:
        parts: list[str] = []
        for message in params.messages:
            if isinstance(message.content, str):
                parts.append(message.content)
            elif message.content:
                parts += [str(part.get("text", "")) for part in message.content if isinstance(part, dict)]
            parts.append(message.reasoning_content or "")
        text = "\n".join(parts)
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def check_token_ids(ids: list[int], tokenizer: Tokenizer | None) -> None:
    """A 400 for token ids no vocabulary has (or, with the tokenizer at hand, this one)."""
    vocab_size = tokenizer.get_vocab_size() if tokenizer is not None else None
    bad = [i for i in ids if i < 0 or (vocab_size is not None and i >= vocab_size)]
    if bad:
        limit = f" (the vocabulary has {vocab_size})" if vocab_size is not None else ""
        raise ApiError(
            400, f"prompt has token ids out of range{limit}: {bad[:5]}", code="invalid_prompt", param="prompt"
        )


def check_text_only(card: ModelCard, params: TextGenerationTaskParams) -> None:
    """A 400 for images, audio or files: the engine runs models' text path only, and a
    model answering as if the picture were not there would mislead the user."""
    media = {
        part.get("type")
        for message in params.messages
        if isinstance(message.content, list)
        for part in message.content
        if part.get("type") in MEDIA_PARTS
    }
    if not media:
        return
    reason = (
        "exo runs only its text path so far; vision input is not supported yet"
        if "vision" in card.capabilities
        else "the model takes text only"
    )
    raise ApiError(
        400,
        f"{params.model} cannot read {', '.join(sorted(str(m) for m in media))} content: {reason}",
        code="unsupported_content",
        param="messages",
    )


async def checked_params(
    cluster: ClusterPort, card: ModelCard, params: TextGenerationTaskParams
) -> TextGenerationTaskParams:
    """A 400 for a request with nothing to answer, media, a bad seed, token ids out of the
    vocabulary or a prompt longer than the model's context; no top_k at or over the
    vocabulary size (it keeps every token anyway, and the sampler refuses it)."""
    if params.prompt is None and not params.messages:
        raise ApiError(400, "the request has no messages to answer", code="invalid_request", param="messages")
    check_text_only(card, params)
    if params.seed is not None and not 0 <= params.seed <= MAX_SEED:
        raise ApiError(400, f"seed must be between 0 and {MAX_SEED}", code="invalid_request", param="seed")
    tokenizer = local_tokenizer(cluster, params.model)
    if isinstance(params.prompt, list):
        check_token_ids(params.prompt, tokenizer)
    if tokenizer is None:
        return params
    if params.top_k is not None and params.top_k >= tokenizer.get_vocab_size():
        params = params.model_copy(update={"top_k": None})
    if not card.context_length:
        return params
    tokens = await asyncio.to_thread(prompt_token_count, tokenizer, params)
    if tokens > card.context_length:
        raise ApiError(
            400,
            f"prompt too long: {tokens} tokens, but {params.model} has a context of {card.context_length} tokens",
            code="context_length_exceeded",
            param="messages",
        )
    return params
