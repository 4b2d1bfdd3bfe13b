"""A request's settings as every engine reads them: its own value, else the model card's
recommendation, else the default; filtered to what the model's vocabulary allows."""

from dataclasses import dataclass, field
from typing import Any

from exo.engine.limits import DEFAULT_MAX_TOKENS
from exo.shared.types.text_generation import TextGenerationTaskParams


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float
    top_p: float
    top_k: int  # 0: no filter
    min_p: float
    repetition_penalty: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    bias: dict[int, float] = field(default_factory=dict)


def sampling_settings(
    params: TextGenerationTaskParams, card_defaults: dict[str, Any], vocab_size: int
) -> SamplingSettings:
    def pick(name: str, fallback: Any) -> Any:
        value = getattr(params, name)
        return value if value is not None else card_defaults.get(name, fallback)

    top_k = int(pick("top_k", 0))
    return SamplingSettings(
        temperature=float(pick("temperature", 0.7)),
        top_p=float(pick("top_p", 1.0)),
        # Keeping the whole vocabulary or more is no filter at all (and mlx-lm's would fail).
        top_k=0 if top_k >= vocab_size else top_k,
        min_p=float(pick("min_p", 0.0)),
        repetition_penalty=pick("repetition_penalty", None),
        presence_penalty=pick("presence_penalty", None),
        frequency_penalty=pick("frequency_penalty", None),
        # Out-of-range ids are dropped rather than refused: only the engine knows the
        # vocabulary, and MLX does not bounds-check the scatter that adds the bias.
        bias={token: value for token, value in (params.logit_bias or {}).items() if 0 <= token < vocab_size},
    )


def max_tokens_of(params: TextGenerationTaskParams) -> int:
    return params.max_tokens or DEFAULT_MAX_TOKENS


def logprobs_wanted(params: TextGenerationTaskParams) -> int | None:
    """None: no logprobs; else how many alternatives."""
    return (params.top_logprobs or 0) if params.logprobs else None
