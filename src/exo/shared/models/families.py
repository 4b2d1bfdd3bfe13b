"""What exo knows about each model family, keyed by config.json's `model_type`.

One table for every layer: the catalog derives cards from it, the engine's output parser,
loader and sharding look up their family here, placement its tensor rules. Plain data
without MLX, so a node reads it without loading an engine. A new family gets one entry;
a model type that is not listed has none of these facts.
"""

from dataclasses import dataclass
from enum import StrEnum

from exo.shared.models.model_cards import ReasoningDialect


class StrategyOwner(StrEnum):
    """Whose code splits a family's layers across tensor-parallel ranks."""

    mlx_lm = "mlx_lm"  # the `shard()` method of mlx-lm's model class
    exo_model = "exo_model"  # the `shard()` method of exo's own model class (engine/mlx/models)
    exo = "exo"  # exo's strategy for mlx-lm's model, engine/mlx/sharding/<model_type>.py


@dataclass(frozen=True)
class FamilyFacts:
    # Where the model's reasoning starts and ends in its output, where the tokenizer's
    # think tokens do not tell it (a model type without an entry gets the detected ones).
    think_markers: tuple[str, str] | None = None
    # The tool-call format when the chat template does not tell; harmony and dsml are
    # told by the model type alone, whatever the template says.
    tool_format: str | None = None
    # Turn ends the family's configs do not list as EOS; added only where the tokenizer
    # treats the id as special.
    eos_ids: tuple[int, ...] = ()
    tensor_strategy: StrategyOwner | None = None
    # False where the tensor strategy keeps the KV heads whole (so their count need not
    # divide by the ranks).
    tensor_splits_kv_heads: bool = True
    # engine/mlx/sharding/<model_type>.py has a `fix_pipeline(model, start, end)` for a
    # forward pass that assumes it holds every layer.
    pipeline_fix_up: bool = False
    # The reasoning dialect the family's published cards set.
    reasoning_dialect: ReasoningDialect = ReasoningDialect.none


NO_FACTS = FamilyFacts()

THINK = ("<think>", "</think>")
# Gemma 4's start marker includes the newline its template always writes after
# "thought", so reasoning does not begin with it.
GEMMA_4_THINK = ("<|channel>thought\n", "<channel|>")
# Gemma 3/4 checkpoints name only <eos> (1); the turn end (106) and the tool-response
# marker (50) end generation too.
GEMMA_EOS_IDS = (1, 106, 50)

MLX_LM = StrategyOwner.mlx_lm
POST_LAST_USER = ReasoningDialect.post_last_user

# mlx-lm's tensor strategies are the model modules with a `shard()` method, as in the
# installed mlx-lm (tests/unit/test_family_facts.py compares the two).
FAMILIES: dict[str, FamilyFacts] = {
    "llama": FamilyFacts(tensor_strategy=MLX_LM),
    "qwen2": FamilyFacts(tool_format="json", tensor_strategy=MLX_LM),
    "qwen2_moe": FamilyFacts(tool_format="json"),
    "qwen3": FamilyFacts(THINK, "json", tensor_strategy=MLX_LM, reasoning_dialect=POST_LAST_USER),
    "qwen3_moe": FamilyFacts(THINK, "json", tensor_strategy=MLX_LM, reasoning_dialect=POST_LAST_USER),
    "qwen3_next": FamilyFacts(THINK, "json", tensor_strategy=StrategyOwner.exo, reasoning_dialect=POST_LAST_USER),
    "qwen3_5": FamilyFacts(THINK, "qwen3_coder", tensor_strategy=MLX_LM),
    "qwen3_5_moe": FamilyFacts(THINK, "qwen3_coder"),
    "deepseek_v2": FamilyFacts(tensor_strategy=MLX_LM),
    "deepseek_v3": FamilyFacts(THINK, tensor_strategy=MLX_LM, reasoning_dialect=POST_LAST_USER),
    "deepseek_v32": FamilyFacts(
        THINK, "dsml", tensor_strategy=MLX_LM, reasoning_dialect=ReasoningDialect.tool_conditional
    ),
    # DeepSeek V4 is MQA (one KV head): its strategy splits the query and output
    # projections by head and shards the MoE experts instead.
    "deepseek_v4": FamilyFacts(
        THINK,
        "dsml",
        tensor_strategy=StrategyOwner.exo_model,
        tensor_splits_kv_heads=False,
        reasoning_dialect=ReasoningDialect.tool_conditional,
    ),
    "deepseek_v41": FamilyFacts(tensor_strategy=MLX_LM),
    "glm4_moe": FamilyFacts(THINK, "glm47", tensor_strategy=MLX_LM, reasoning_dialect=POST_LAST_USER),
    "glm4_moe_lite": FamilyFacts(THINK, "glm47", tensor_strategy=MLX_LM),
    "minimax": FamilyFacts(tensor_strategy=MLX_LM),
    "minimax_m2": FamilyFacts(THINK, "minimax_m2", reasoning_dialect=POST_LAST_USER),
    "minimax_m3_vl": FamilyFacts(tensor_strategy=MLX_LM),
    # Kimi K2 Thinking uses plain <think>; the ◁think▷ markers are Kimi-VL's.
    "kimi_k2": FamilyFacts(THINK, "kimi_k2", reasoning_dialect=ReasoningDialect.suffix),
    "kimi_k25": FamilyFacts(tensor_strategy=MLX_LM),
    "kimi_k3": FamilyFacts(tensor_strategy=MLX_LM),
    # exo's own module (engine/mlx/models/kimi_vl.py): DeepSeek V3's strategy on its language model.
    "kimi_vl": FamilyFacts(("◁think▷", "◁/think▷"), tensor_strategy=StrategyOwner.exo_model),
    "gpt_oss": FamilyFacts(tool_format="harmony", tensor_strategy=MLX_LM, reasoning_dialect=ReasoningDialect.channel),
    "gemma3": FamilyFacts(eos_ids=GEMMA_EOS_IDS),
    "gemma3_text": FamilyFacts(eos_ids=GEMMA_EOS_IDS),
    # Gemma 4's cards set no reasoning dialect: earlier thoughts never go back to the model.
    "gemma4": FamilyFacts(
        GEMMA_4_THINK, "gemma4", eos_ids=GEMMA_EOS_IDS, tensor_strategy=StrategyOwner.exo, pipeline_fix_up=True
    ),
    "gemma4_text": FamilyFacts(
        GEMMA_4_THINK, "gemma4", eos_ids=GEMMA_EOS_IDS, tensor_strategy=StrategyOwner.exo, pipeline_fix_up=True
    ),
    "mistral3": FamilyFacts(tool_format="mistral"),
    "ministral3": FamilyFacts(tool_format="mistral", tensor_strategy=MLX_LM),
    "mistral4": FamilyFacts(tensor_strategy=MLX_LM),
    "lfm2": FamilyFacts(tool_format="pythonic"),
    "lfm2_moe": FamilyFacts(tool_format="pythonic"),
    "nemotron_h": FamilyFacts(tensor_strategy=StrategyOwner.exo, pipeline_fix_up=True),
    "exaone_moe": FamilyFacts(tensor_strategy=MLX_LM),
    "iquestloopcoder": FamilyFacts(tensor_strategy=MLX_LM),
    "longcat_flash": FamilyFacts(tensor_strategy=MLX_LM),
    "longcat_flash_ngram": FamilyFacts(tensor_strategy=MLX_LM),
    "muse_spark": FamilyFacts(tensor_strategy=MLX_LM),
    "step3p5": FamilyFacts(tensor_strategy=MLX_LM),
}

THINK_MARKERS = {model_type: facts.think_markers for model_type, facts in FAMILIES.items() if facts.think_markers}


def family_facts(model_type: str) -> FamilyFacts:
    return FAMILIES.get(model_type, NO_FACTS)


def has_tensor_strategy(model_type: str) -> bool:
    """Whether some code can split this architecture across tensor-parallel ranks; whether
    a given node count divides the model is placement's question."""
    return family_facts(model_type).tensor_strategy is not None
