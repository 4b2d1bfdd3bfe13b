"""Checks on a generation request that no adapter can make alone: they need the model's
card or, where its files are on this node, its tokenizer (the API process never loads
the model itself)."""

import asyncio
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from exo.api.errors import ApiError
from exo.api.port import ClusterPort
from exo.engine.encoding.chat_prompt import render_prompt
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


# The think-token pairs mlx-lm's TokenizerWrapper looks for; where the vocabulary has one,
# it renders the template with enable_thinking on unless the request says otherwise.
_THINK_TOKENS = (("<think>", "</think>"), ("<longcat_think>", "</longcat_think>"), ("<|think:start|>", "<|think:end|>"))


@dataclass(frozen=True)
class ChatTokenizer:
    """What the engine renders a prompt with: the chat template (by transformers, as
    mlx-lm does), the model type and whether the vocabulary has think tokens."""

    template: PreTrainedTokenizerFast
    model_type: str
    has_thinking: bool


@lru_cache(maxsize=8)
def chat_tokenizer_at(path: Path) -> ChatTokenizer | None:
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type", "")
        template = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    except Exception:  # missing, unreadable or a custom tokenizer class: the estimate serves
        return None
    vocab = template.get_vocab()
    has_thinking = any(start in vocab and end in vocab for start, end in _THINK_TOKENS) or (
        "<|channel>" in vocab and "<channel|>" in vocab
    )
    return ChatTokenizer(template, model_type, has_thinking)


def local_tokenizer(cluster: ClusterPort, model: str) -> Tokenizer | None:
    """The model's fast tokenizer when its files are on this node, else None."""
    model_dir = cluster.local_model_dir(model)
    return _tokenizer_at(model_dir) if model_dir is not None else None


def chat_prompt_token_count(chat: ChatTokenizer, params: TextGenerationTaskParams, dialect: str) -> int | None:
    """The prompt's tokens exactly as the engine will build them: the chat template with
    the tools, the reasoning dialect and the thinking switch. None where the template
    cannot render the request here (the engine then answers for itself)."""
    if params.enable_thinking is None:
        params = params.model_copy(update={"enable_thinking": chat.has_thinking})
    try:
        text = render_prompt(chat.template, params, chat.model_type, dialect)
    except Exception:  # a template that raises on this conversation
        return None
    return len(chat.template.encode(text, add_special_tokens=False))


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
    return exact if exact is not None else prompt_token_count(tokenizer, params)


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
