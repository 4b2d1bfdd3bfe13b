"""What batching holds twice for a moment (engine/mlx/batching.py), on a real tiny llama
in this process: merging requests' caches into one batch, prefilling them together and
growing the decode batch copy the KV, and the memory budget reserves a fifth of it for
such copies. Done a layer at a time, the sources of a layer are freed as its copy is
made; done for every layer before any is evaluated (as before), the requests' whole KV
was held twice. Measured here (24 MiB of KV in 4 requests, 8 layers): prefilling them
together peaked 8.0 MiB above it (55.6 MiB before), 4 joining 4 in the decode batch
19.8 MiB (35.8 MiB before). Requests leaving the decode batch are copied out and their
rows dropped after the step, together and a layer at a time: 4 of 8 leaving peaked 7.0
MiB above the batch's 63.5 MiB of KV, where filtering at each leave peaked 67.6 MiB."""

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from exo.devtools.tiny_models import make_tiny_llama
from exo.engine.mlx.batching import DecodeBatch, Joiner, prefill_together
from exo.engine.mlx.engine import MlxEngine
from exo.shared.types.common import CommandId
from tests.support.engine import load_engine

LAYERS = 8
ROWS = 4
PROMPT_TOKENS = 760  # just under a multiple of 256, where mlx-lm grows a cache by 256


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> MlxEngine:
    model_dir = make_tiny_llama(
        tmp_path_factory.mktemp("batching_memory") / "llama",
        hidden_size=256,
        num_hidden_layers=LAYERS,
        intermediate_size=512,
    )
    return load_engine(model_dir)


def _prefilled(engine: MlxEngine, seed: int) -> list[Any]:
    assert engine.model is not None
    cache = make_prompt_cache(engine.model)
    tokens = mx.array([[(seed * 31 + 7 * position) % 400 + 3 for position in range(PROMPT_TOKENS)]])
    engine.model(tokens, cache=cache)
    mx.eval([[layer.keys, layer.values] for layer in cache])
    return cache


def _kv_bytes(caches: list[list[Any]]) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for cache in caches for layer in cache)


def _jump(run) -> tuple[int, Any]:
    """What `run` held at its peak beyond what was there before it."""
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    result = run()
    mx.synchronize()
    return mx.get_peak_memory() - before, result


def test_prefilling_together_holds_one_layer_twice_not_the_whole_kv(engine: MlxEngine):
    assert engine.model is not None
    caches = [_prefilled(engine, seed) for seed in range(ROWS)]
    kv = _kv_bytes(caches)
    chunks = [[5 + row, 9, 11, 13] for row in range(ROWS)]
    jump, filled = _jump(lambda: prefill_together(engine.model, caches, chunks))
    print(f"prefill_together of {ROWS} rows: peak {jump / 2**20:.2f} MiB above its {kv / 2**20:.2f} MiB of KV")
    assert [layer.offset for layer in filled[0]] == [PROMPT_TOKENS + 4] * LAYERS
    assert caches == [[] for _ in range(ROWS)]  # taken: nothing keeps the sources alive
    assert jump < kv / 2, "the requests' KV was held twice"


def test_joining_the_decode_batch_holds_one_layer_twice_not_the_whole_kv(engine: MlxEngine):
    assert engine.model is not None
    batch = DecodeBatch()
    sampler = lambda logprobs: mx.argmax(logprobs, axis=-1)  # noqa: E731

    def joiners(first: int) -> list[Joiner]:
        return [
            Joiner(CommandId(f"r{seed}"), _prefilled(engine, seed), 17, sampler, [])
            for seed in range(first, first + ROWS)
        ]

    batch.join(engine.model, joiners(0))
    batch.step()
    later = joiners(ROWS)
    kv = _kv_bytes([joiner.cache for joiner in later])
    jump, _ = _jump(lambda: batch.join(engine.model, later))
    print(f"{ROWS} rows joining {ROWS}: peak {jump / 2**20:.2f} MiB above their {kv / 2**20:.2f} MiB of KV")
    assert len(batch) == 2 * ROWS
    # Due: the joiners' first forward grows their cache by mlx-lm's 256 positions (a third
    # here), and the batch grown one layer at a time holds a layer of it twice.
    assert jump < kv, "the joiners' KV (or the batch's) was held twice"
    assert len(batch.step()) == 2 * ROWS


def test_requests_leaving_the_decode_batch_together_hold_one_layer_twice_not_the_whole_kv(engine: MlxEngine):
    assert engine.model is not None
    batch = DecodeBatch()
    sampler = lambda logprobs: mx.argmax(logprobs, axis=-1)  # noqa: E731
    batch.join(
        engine.model,
        [Joiner(CommandId(f"r{seed}"), _prefilled(engine, seed), 17, sampler, []) for seed in range(2 * ROWS)],
    )
    batch.step()
    batch.step()
    assert batch._batch is not None
    kv = _kv_bytes([batch._batch.prompt_cache])

    def leave_half() -> list[list[Any]]:
        left = [batch.leave(CommandId(f"r{seed}")) for seed in range(ROWS)]
        batch.settle()  # as the engine does after the step in which they finished
        return left

    jump, left = _jump(leave_half)
    print(
        f"{ROWS} of {2 * ROWS} rows leaving: peak {jump / 2**20:.2f} MiB above the batch's {kv / 2**20:.2f} MiB of KV"
    )
    # Each one's copy holds its prompt and 3 tokens: the joining one, fed as it joined, and
    # one fed by each step (mlx-lm feeds a step ahead).
    assert [[layer.offset for layer in cache] for cache in left] == [[PROMPT_TOKENS + 3] * LAYERS] * ROWS
    assert len(batch) == ROWS
    # Due: a layer of the batch with its rows' copies and the filtered layer made from it
    # (the copies stay, as the old batch goes); the batch held twice is its whole KV more.
    assert jump < kv / 2, "the batch's KV was held twice"
    assert len(batch.step()) == ROWS
