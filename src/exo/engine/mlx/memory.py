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


def buffer_cache_bytes(config: dict[str, Any], activations: int, scores: int, step_tokens: int) -> int:
    """What MLX's buffer cache may keep: one step's temporaries, for the next step to
    reuse. A step's scores come to at most its tokens against the model's whole context,
    on a large device far less than the share of memory set aside for them (a quarter of
    what an H200 has beside a 7 GB model: 28 GB, which the cache would fill with the
    buffers a growing KV leaves behind, sizes no step asks for again)."""
    context = int(_text_config(config).get("max_position_embeddings") or 0)
    if context > 0:
        scores = min(scores, step_tokens * context * score_bytes_per_pair(config))
    return activations + scores


def limit_buffer_cache(nbytes: int) -> None:
    mx.set_cache_limit(nbytes)
