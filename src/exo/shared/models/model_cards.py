"""Model cards: what exo knows about a model before loading it.

The types only; where cards come from (built-in TOML files, models dirs, the hub) is the
catalog's business (exo.catalog).
"""

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ReasoningDialect(StrEnum):
    """What happens to an assistant message's reasoning when a later request sends it back.

    - none: the model has no reasoning channel.
    - post_last_user: reasoning only matters for the turn after the last user message;
      reasoning on older assistant turns is dropped.
    - suffix: reasoning is carried inside the assistant content itself, so sending the
      content back is enough; no separate reasoning round-trip.
    - channel: reasoning lives on its own channel (e.g. Harmony) and is sent back
      verbatim on every turn.
    - tool_conditional: reasoning is always kept when the conversation has tools, because
      the model chains tool calls on its earlier reasoning (DeepSeek V3.2 / V4).
    """

    none = "none"
    post_last_user = "post_last_user"
    suffix = "suffix"
    channel = "channel"
    tool_conditional = "tool_conditional"


class ModelTask(StrEnum):
    TextGeneration = "TextGeneration"
    ImageGeneration = "ImageGeneration"
    ImageEdits = "ImageEdits"


class FrozenModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StorageSize(FrozenModel):
    in_bytes: int


class SamplingDefaults(FrozenModel):
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # Upstream cards of hybrid-thinking models recommend other values with thinking off.
    non_thinking: "SamplingDefaults | None" = None


class Speculative(FrozenModel):
    """Speculative decoding: proposals verified several at a time, the answer unchanged.
    "prompt_lookup": the tokens that followed the last few tokens' earlier occurrence in
    the prompt or the answer; "draft": a smaller model's greedy continuation (the
    instance's draft model, which `draft_model` may name to be sure of it)."""

    method: Literal["prompt_lookup", "draft"] = "prompt_lookup"
    num_draft: int = Field(default=8, ge=1, le=32)  # tokens proposed per verify, at most
    draft_model: str | None = None


class VisionCard(BaseModel):
    # Upstream vision sections differ per model family, so unknown keys are kept.
    model_config = ConfigDict(frozen=True, extra="allow")

    image_token_id: int | None = None
    model_type: str = ""
    weights_repo: str = ""
    processor_repo: str = ""


class ModelCard(FrozenModel):
    model_id: str
    n_layers: int = Field(gt=0)
    hidden_size: int
    num_key_value_heads: int | None = None
    supports_tensor: bool = False
    tasks: list[ModelTask]
    family: str = ""
    quantization: str = ""
    base_model: str = ""
    capabilities: list[str] = ["text"]
    reasoning_dialect: ReasoningDialect = ReasoningDialect.none
    context_length: int | None = None
    storage_size: StorageSize
    # Of storage_size, the vision tower's and projector's bytes: rank 0 alone holds them
    # (engine/mlx/vision.py), so placement adds them to its share, not every rank's.
    vision_bytes: int = Field(0, ge=0)
    sampling_defaults: SamplingDefaults = SamplingDefaults()
    # Speculative decoding for requests that do not say (the Claude and Ollama APIs never
    # do); None: plain decoding.
    speculative: Speculative | None = None
    # A smaller model with this one's tokenizer, placed with it on rank 0's node, that
    # proposes tokens for speculative decoding by "draft".
    draft_model: str | None = None
    vision: VisionCard | None = None
    # Layers from this index to the last must sit on one pipeline rank. Gemma 4 E2B/E4B
    # end in layers that read the keys and values of the last layers before them rather
    # than make their own, so a pipeline cut anywhere in that tail would cross ranks.
    pipeline_tail_start: int | None = Field(None, ge=0)
