"""An MLX runner's memory budget: what its device has (Metal's recommended working set on
Apple silicon, the CUDA device's memory, RAM on a CPU node, or EXO_MEMORY_BUDGET_MB),
less its weights and one step's activations, in tokens of KV for the scheduler. Of
what is left a quarter is for attention's scores (the scheduler keeps each step's
prompt chunks within that area: MLX's CPU backend computes them in full), a fifth of
the rest stays free for what MLX copies for a moment (a cache grown by concatenation,
the decode batch as requests join and leave), and the rest holds the KV of running
requests and of the prefix cache. Without that fifth, 16 prompts of 2,000 tokens under
a 96 MB budget peaked at 89 MB in a process of their own but at 106.5 MB in one holding
other engines' arrays (tests/unit/test_memory_budget.py).

MLX also keeps freed buffers in a cache of its own for reuse; unbounded, that cache
alone took an H200 from a 7 GB model to 106 GB. It is limited to one step's
temporaries: what a step frees, the next one reuses. MLX's peak memory leaves that cache
out; the device's own count (nvidia-smi) has it."""

from typing import Any

import mlx.core as mx

from exo.engine import limits


def mlx_device() -> str:
    """What MLX computes on here: "cuda", "metal" or "cpu"."""
    if mx.default_device() != mx.gpu:
        return "cpu"
    cuda = getattr(mx, "cuda", None)  # not in every build
    return "cuda" if cuda is not None and cuda.is_available() else "metal"


def device_memory() -> int:
    """Bytes this runner may use, weights included."""
    override = limits.memory_budget_override()
    if override is not None:
        return override
    info: dict[str, Any] = dict(mx.device_info())
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if mx.default_device() == mx.gpu and isinstance(info.get(key), int):
            return int(int(info[key]) * limits.MEMORY_FRACTION)
    return limits.ram_budget(mx.get_active_memory())


def kv_bytes_per_token(cache: list[Any]) -> int:
    """What one more token costs a request's cache (one that holds a token): a slot of
    each attention layer's keys and values (a sliding window's too, counted as if it
    grew: the budget errs high), nothing for a fixed-size state (SSM layers)."""
    total = 0.0
    for layer in cache:
        for name in ("keys", "values"):
            array = getattr(layer, name, None)
            if isinstance(array, mx.array) and array.ndim == 4:
                total += array.nbytes / array.shape[2]
    return max(1, int(total))


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config", config)


def activation_bytes(config: dict[str, Any], step_tokens: int, rows: int) -> int:
    """A generous estimate of one step's temporaries but attention's scores: float32
    hidden states and MLP activations for the step's tokens, and the logits of the rows
    that sample."""
    text = _text_config(config)
    hidden = int(text.get("hidden_size", 4096))
    intermediate = int(text.get("intermediate_size") or text.get("moe_intermediate_size") or 4 * hidden)
    vocab = int(text.get("vocab_size", 32000))
    return 4 * (step_tokens * (8 * hidden + 3 * intermediate) + 3 * rows * vocab)


def score_bytes_per_pair(config: dict[str, Any]) -> int:
    """Attention's scores of one query-key pair over every head, where they are
    materialized (MLX's CPU backend): float32 scores, their softmax and the mask."""
    return 3 * 4 * int(_text_config(config).get("num_attention_heads", 32))


def forward_area(config: dict[str, Any], scores: int, chunk_tokens: int) -> int:
    """Query-key pairs of attention one forward may compute: what `scores` bytes hold, and
    no more than one prompt chunk against the model's whole context. A step's chunks past
    that go through in more forwards. On a large device the share set aside for scores
    (a quarter of what an H200 has beside a 7 GB model: 28 GB) would otherwise let 8 chunks
    of 2,048 tokens materialize theirs at once, and MLX's buffer cache keep the buffers."""
    area = scores // score_bytes_per_pair(config)
    context = int(_text_config(config).get("max_position_embeddings") or 0)
    return min(area, chunk_tokens * context) if context > 0 else area


def limit_buffer_cache(nbytes: int) -> None:
    mx.set_cache_limit(nbytes)
