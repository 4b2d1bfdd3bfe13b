"""Checks on a generation request that no adapter can make alone: they need the model's
card or, where its files are on this node, its tokenizer (the API process never loads
the model itself)."""

import asyncio
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from exo.api.errors import ApiError
from exo.api.images import resolve_images
from exo.api.port import ClusterPort
from exo.engine.encoding.chat_prompt import processor_adds_special_tokens, render_prompt
from exo.engine.parsing.output import think_markers_for, vocabulary_think_markers
from exo.shared.models.model_cards import ModelCard
from exo.shared.models.vision import image_processor_fields, image_prompt_tokens, processor_chat_template, vision_runs
from exo.shared.types.text_generation import TextGenerationTaskParams, image_hashes_in_order

# MLX seeds its generator with an unsigned 64-bit integer.
MAX_SEED = 2**64 - 1


@lru_cache(maxsize=8)
def _tokenizer_at(path: Path) -> Tokenizer | None:
    try:
        return Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception:  # missing or unreadable: callers fall back to an estimate
        return None


@dataclass(frozen=True)
class ChatTokenizer:
    """What the engine renders a prompt with: the chat template (by transformers, as
    mlx-lm does) and the model type."""

    template: PreTrainedTokenizerFast
    model_type: str


def _config_at(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):  # no readable config: no family facts
        return {}
    return config if isinstance(config, dict) else {}


def _model_type_at(path: Path) -> str:
    return str(_config_at(path).get("model_type", ""))


@lru_cache(maxsize=8)
def chat_tokenizer_at(path: Path) -> ChatTokenizer | None:
    model_type = _model_type_at(path)
    try:
        template = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    except Exception:  # missing, unreadable or a custom tokenizer class: the estimate serves
        return None
    # A VLM renders with its processor's template, as the engine does (engine/mlx/loading.py).
    if vision_runs(_config_at(path)) and (processor_template := processor_chat_template(path)) is not None:
        template.chat_template = processor_template
    return ChatTokenizer(template, model_type)


def local_tokenizer(cluster: ClusterPort, model: str) -> Tokenizer | None:
    """The model's fast tokenizer when its files are on this node, else None."""
    model_dir = cluster.local_model_dir(model)
    return _tokenizer_at(model_dir) if model_dir is not None else None


def model_think_markers(cluster: ClusterPort, model: str) -> tuple[str, str] | None:
    """Where the engine will split the model's reasoning off, when its files are on this
    node: the family table's markers for its model_type, else those in its vocabulary."""
    model_dir = cluster.local_model_dir(model)
    if model_dir is None:
        return None
    tokenizer = _tokenizer_at(model_dir)
    detected = vocabulary_think_markers(tokenizer.get_vocab(with_added_tokens=True)) if tokenizer else None
    return think_markers_for(_model_type_at(model_dir), detected)


def chat_prompt_token_count(chat: ChatTokenizer, params: TextGenerationTaskParams, dialect: str) -> int | None:
    """The prompt's tokens exactly as the engine will build them: the chat template with
    the tools, the reasoning dialect and the thinking switch (the template's own default
    where the request does not say). None where the template cannot render the request
    here (the engine then answers for itself)."""
    try:
        text = render_prompt(chat.template, params, chat.model_type, dialect)
    except Exception:  # a template that raises on this conversation
        return None
    # With images the engine tokenizes as the model's processor does.
    special = bool(params.images) and processor_adds_special_tokens(chat.template, text)
    return len(chat.template.encode(text, add_special_tokens=special))


def prompt_token_count(tokenizer: Tokenizer, params: TextGenerationTaskParams) -> int:
    """An estimate where the template is not at hand: the tokens of the prompt's text and
    tools, without the few a chat template adds."""
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
        parts += [json.dumps(tool) for tool in params.tools or []]
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


async def checked_params(
    cluster: ClusterPort, card: ModelCard, params: TextGenerationTaskParams
) -> TextGenerationTaskParams:
    """Images resolved (api/images.py); a 400 for a request with nothing to answer, media
    the model cannot read, a bad seed, token ids out of the vocabulary or a prompt longer
    than the model's context; no top_k at or over the vocabulary size (it keeps every
    token anyway, and the sampler refuses it)."""
    if params.prompt is None and not params.messages:
        raise ApiError(400, "the request has no messages to answer", code="invalid_request", param="messages")
    params = await resolve_images(card, params, cluster.settings.images_dir, cluster.node_id)
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
    tokens = await asyncio.to_thread(_prompt_tokens, cluster, card, tokenizer, params)
    if tokens > card.context_length:
        raise context_length_error(tokens, card.context_length, params.model)
    return params


def _prompt_tokens(
    cluster: ClusterPort, card: ModelCard, tokenizer: Tokenizer, params: TextGenerationTaskParams
) -> int:
    model_dir = cluster.local_model_dir(params.model)
    chat = chat_tokenizer_at(model_dir) if model_dir is not None and params.prompt is None else None
    exact = chat_prompt_token_count(chat, params, card.reasoning_dialect.value) if chat is not None else None
    counted = exact if exact is not None else prompt_token_count(tokenizer, params)
    return counted + _image_tokens(model_dir, params)


@lru_cache(maxsize=8)
def _vision_configs(path: Path) -> tuple[dict, dict] | None:
    config, processor = _config_at(path), image_processor_fields(path)
    # No processor config: only the placeholders count.
    return (config, processor) if config and processor is not None else None


def _image_tokens(model_dir: Path | None, params: TextGenerationTaskParams) -> int:
    """The tokens the images add beyond the one placeholder each the template writes."""
    configs = _vision_configs(model_dir) if model_dir is not None and params.images else None
    if configs is None:
        return 0
    by_hash = {image.sha256: image for image in params.images}
    shown = [by_hash[sha] for sha in image_hashes_in_order(params) if sha in by_hash]
    return sum(image_prompt_tokens(*configs, image.width, image.height) - 1 for image in shown if image.width)


def context_length_error(tokens: int, context: int, model: str) -> ApiError:
    """One message every API's clients recognise: Anthropic's "prompt is too long: N
    tokens > M maximum" (Claude Code compacts on it) and OpenAI's "maximum context
    length" wording, with OpenAI's context_length_exceeded code."""
    return ApiError(
        400,
        f"prompt is too long: {tokens} tokens > {context} maximum. {model}'s maximum context length is "
        f"{context} tokens; the prompt (messages, tools and chat template) is {tokens} tokens",
        code="context_length_exceeded",
        param="messages",
    )
