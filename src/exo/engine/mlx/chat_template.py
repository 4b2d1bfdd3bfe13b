"""Turning chat messages into prompt tokens with the model's own chat template."""

from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo.engine.encoding.chat_prompt import render_prompt
from exo.engine.parsing.output import think_markers_for
from exo.engine.parsing.reasoning import repair_unmatched_end
from exo.shared.types.text_generation import TextGenerationTaskParams

__all__ = ["detected_think_markers", "encode_prompt", "render_prompt"]


def detected_think_markers(tokenizer: TokenizerWrapper, model_type: str) -> tuple[str, str] | None:
    """The model's think markers, from the family table or else the tokenizer's vocabulary."""
    start, end = tokenizer.think_start, tokenizer.think_end
    return think_markers_for(model_type, (start, end) if start is not None and end is not None else None)


def encode_prompt(
    tokenizer: TokenizerWrapper, params: TextGenerationTaskParams, model_type: str = "", dialect: str = "none"
) -> tuple[list[int], str]:
    """Prompt token ids and text. A raw prompt (text or ids) is used as it is."""
    if isinstance(params.prompt, list):
        return list(params.prompt), tokenizer.decode(params.prompt)
    if params.prompt is not None:
        return tokenizer.encode(params.prompt, add_special_tokens=False), params.prompt
    text = render_prompt(tokenizer, params, model_type, dialect)
    # The template already wrote any BOS it wants.
    tokens = tokenizer.encode(text, add_special_tokens=False)
    markers = detected_think_markers(tokenizer, model_type)
    if markers is not None:
        # An answer sent back as "thought</think>answer" (its start was in the earlier
        # generation prompt) would leave an end marker the model never saw opened.
        start_ids, end_ids = (tokenizer.encode(marker, add_special_tokens=False) for marker in markers)
        tokens = repair_unmatched_end(tokens, start_ids, end_ids)
    return tokens, text
