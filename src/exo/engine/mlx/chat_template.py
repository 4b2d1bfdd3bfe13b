"""Turning chat messages into prompt tokens with the model's own chat template
(engine/encoding/chat_prompt.py), reading the think markers mlx-lm's tokenizer found."""

from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo.engine.encoding import chat_prompt
from exo.engine.encoding.chat_prompt import render_prompt
from exo.engine.parsing.output import think_markers_for
from exo.shared.types.text_generation import TextGenerationTaskParams

__all__ = ["detected_think_markers", "encode_prompt", "render_prompt"]


def detected_think_markers(tokenizer: TokenizerWrapper, model_type: str) -> tuple[str, str] | None:
    """The model's think markers, from the family table or else the tokenizer's vocabulary."""
    start, end = tokenizer.think_start, tokenizer.think_end
    return think_markers_for(model_type, (start, end) if start is not None and end is not None else None)


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
    return chat_prompt.encode_prompt(tokenizer, params, model_type, dialect, markers, as_processor)
