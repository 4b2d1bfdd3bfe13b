"""Turning chat messages into prompt tokens with the model's own chat template
(engine/encoding/chat_prompt.py), reading the think markers mlx-lm's tokenizer found."""

from typing import Any

from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo.engine.encoding import chat_prompt
from exo.engine.parsing.output import think_markers_for
from exo.shared.types.text_generation import TextGenerationTaskParams

__all__ = ["detected_think_markers", "encode_prompt", "render_prompt"]


def detected_think_markers(tokenizer: TokenizerWrapper, model_type: str) -> tuple[str, str] | None:
    """The model's think markers, from the family table or else the tokenizer's vocabulary."""
    start, end = tokenizer.think_start, tokenizer.think_end
    return think_markers_for(model_type, (start, end) if start is not None and end is not None else None)


def template_renderer(tokenizer: TokenizerWrapper, enable_thinking: bool | None) -> Any:
    """What applies the chat template to this request. mlx-lm's wrapper sets
    enable_thinking to whether the vocabulary has think tokens when the caller leaves it
    out; transformers, and so the model's processor and every other engine, leaves the
    template its own default (thinking off for Gemma 4, on for Qwen3 and GLM). A request
    that does not say renders as transformers does: with the wrapped tokenizer. mlx-lm's
    own Python templates (a tokenizer_config's chat_template_type) have no transformers
    rendering to match and keep the wrapper."""
    if enable_thinking is None and tokenizer._chat_template is None:  # pyright: ignore[reportPrivateUsage]
        return tokenizer._tokenizer  # pyright: ignore[reportPrivateUsage]
    return tokenizer


def render_prompt(
    tokenizer: TokenizerWrapper, params: TextGenerationTaskParams, model_type: str, dialect: str = "none"
) -> str:
    """The prompt text of a chat request, as the engine renders it."""
    return chat_prompt.render_prompt(template_renderer(tokenizer, params.enable_thinking), params, model_type, dialect)


def encode_prompt(
    tokenizer: TokenizerWrapper,
    params: TextGenerationTaskParams,
    model_type: str = "",
    dialect: str = "none",
    as_processor: bool = False,
) -> tuple[list[int], str]:
    """Prompt token ids and text. A raw prompt (text or ids) is used as it is;
    `as_processor`: tokenized as a VLM's processor does (a prompt with images)."""
    markers = detected_think_markers(tokenizer, model_type)
    renderer = template_renderer(tokenizer, params.enable_thinking)
    return chat_prompt.encode_prompt(renderer, params, model_type, dialect, markers, as_processor)
