"""The one internal request every API adapter converts to, and the chunks it yields."""

import base64
from typing import Any, Literal

from pydantic import Field

from exo.shared.models.model_cards import Speculative as Speculative  # the request field's type
from exo.shared.types.common import CommandId, FrozenModel, ModelId, NodeId

FinishReason = Literal["stop", "length", "tool_calls", "error", "cancelled"]


class ChatMessage(FrozenModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Plain text, or the parts of a multimodal message as the client sent them.
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ImageInput(FrozenModel):
    """An image a request carries, once however often its messages show it: message
    parts refer to it by content hash as {"type": "image", "sha256": ...}. In a task the
    bytes are not here: `holder` names the node whose image store has them
    (shared/image_store.py); the worker that runs the task fills `data_base64` in for its
    runner alone."""

    sha256: str
    media_type: str
    data_base64: str = ""
    # Pixels, for counting the prompt's tokens before the engine processes the image.
    width: int = 0
    height: int = 0
    size_bytes: int = 0
    holder: NodeId | None = None

    @property
    def data(self) -> bytes:
        return base64.b64decode(self.data_base64)


class TextGenerationTaskParams(FrozenModel):
    model: ModelId
    messages: list[ChatMessage]
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] = []
    tools: list[dict[str, Any]] | None = None
    enable_thinking: bool | None = None
    # "none", "minimal", "low", "medium", "high" or "xhigh"; each family's template or
    # encoder maps it to what the model understands.
    reasoning_effort: str | None = None
    # OpenAI's tool_choice ("auto", "none", "required" or {"type": "function", ...}).
    tool_choice: str | dict[str, Any] | None = None
    # A raw prompt (text or token ids) to continue as is, bypassing the chat template
    # and `messages` (legacy Completions, Ollama generate with raw=true).
    prompt: str | list[int] | None = None
    # Return the sampled tokens' log-probabilities, with this many alternatives each.
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # Penalties count the tokens generated so far, as OpenAI's do (not the prompt's).
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    # Token id -> bias added to its logit; ids outside the model's vocabulary are ignored.
    logit_bias: dict[int, float] | None = None
    # OpenAI's response_format: {"type": "text" | "json_object" | "json_schema", ...}.
    response_format: dict[str, Any] | None = None
    # The images the messages' image parts name, each once.
    images: list[ImageInput] = []
    # Speculative decoding (exo's own field): None, the model card's default; "off",
    # plain decoding whatever the card says.
    speculative: Speculative | Literal["off"] | None = None


def image_hashes_in_order(params: TextGenerationTaskParams) -> list[str]:
    """The hashes of the images the messages show, in order (repeats included)."""
    return [
        str(part["sha256"])
        for message in params.messages
        if isinstance(message.content, list)
        for part in message.content
        if part.get("type") == "image" and "sha256" in part
    ]


class Usage(FrozenModel):
    prompt_tokens: int
    completion_tokens: int
    # Of the completion tokens, those that went to reasoning rather than the answer.
    reasoning_tokens: int = 0
    # Of the prompt tokens, those whose work a cached earlier prompt already did.
    cached_tokens: int = 0
    # Speculative decoding: the tokens proposed, and of those the ones the model kept.
    proposed_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class KvHandoffStats(FrozenModel):
    """A request prefilled by another runner (disaggregated serving): the KV's bytes on
    the wire (sealed, both ways), the seconds from asking for it to having all of it, the
    prefill runner's own seconds of that, the prompt tokens whose KV moved to this runner,
    and those of this runner's cached prefix it offered the prefill runner, which lacked
    them."""

    bytes: int
    seconds: float
    prefill_seconds: float
    tokens: int
    offered_tokens: int = 0


class GenerationStats(FrozenModel):
    prompt_tps: float
    generation_tps: float
    prompt_tokens: int
    generation_tokens: int
    # The most memory MLX held at once in the runner that answered, since it started.
    peak_memory_bytes: int = 0
    # Speculative decoding: of the tokens proposed, the share the model kept (None: none
    # proposed).
    acceptance_rate: float | None = None
    # Prefilled by another runner: what moving its KV took (None: prefilled here).
    kv_handoff: KvHandoffStats | None = None


class ToolCall(FrozenModel):
    """A tool call the model made, already parsed out of its output."""

    id: str
    name: str
    # JSON text of the arguments object, as OpenAI carries it.
    arguments: str


class TopLogprob(FrozenModel):
    token: str
    token_id: int
    logprob: float


class TokenLogprob(FrozenModel):
    """The sampled token's log-probability under the model (before sampling filters),
    and the most likely alternatives."""

    token: str
    token_id: int
    logprob: float
    top_logprobs: list[TopLogprob] = []


class PrefillProgress(FrozenModel):
    processed_tokens: int
    total_tokens: int


class ChunkGenerated(FrozenModel):
    """One piece of a streamed answer. Chunks are not State: they travel on their own
    topic to the API that asked, never through the event log."""

    command_id: CommandId
    # Answer text; thinking goes in `reasoning`, never in `text`.
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = []
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] | None = None
    prefill: PrefillProgress | None = None
    finish_reason: FinishReason | None = None
    # Which of the request's stop sequences ended the answer (finish_reason "stop").
    stop_sequence: str | None = None
    error_message: str | None = None
    # The error was the cluster's, not the request's nor the model's: the instance went
    # away or none serves the model. A request that has no token yet may be sent again.
    retryable: bool = False
    # The request could not start because the model cannot take its input (an image its
    # processor refuses): the client's to fix, a 400.
    rejected: bool = False
    usage: Usage | None = None
    stats: GenerationStats | None = None
