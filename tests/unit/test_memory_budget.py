"""A runner's memory budget, on the real MLX engine in this process: with the budget set
to N MB (EXO_MEMORY_BUDGET_MB, in place of the device's memory), 16 prompts of ~2,000
tokens submitted together are all answered in full while MLX's peak memory stays within
N + 10%: the later ones wait in the queue until the earlier ones' KV is freed, and the
prefix cache gives its entries up for them. A prompt larger than the budget allows is
refused with the number of tokens that fit; one that fits only alone waits its turn.

The engine is loaded with each device's step, chunk and forward (engine/limits.py: a
CPU's 512-token step, a Mac's 2,048, an NVIDIA GPU's 16,384 in chunks of 2,048 and
forwards of 4,096), computed here on the CPU, whose attention materializes its scores
in full: the budget's accounting for a GPU's shapes is checked where no GPU is at hand
(how MLX's CUDA allocator holds them is for bench/gpu.sh's memory part)."""

import gc
from collections.abc import Iterator

import mlx.core as mx
import pytest

import exo.engine.mlx.engine
from exo.devtools.tiny_models import make_tiny_llama
from exo.engine import limits
from exo.engine.mlx.engine import MlxEngine
from exo.engine.mlx.memory import forward_area, score_bytes_per_pair
from exo.shared.types.common import CommandId, ModelId
from exo.shared.types.text_generation import TextGenerationTaskParams
from tests.support.engine import load_engine

BUDGET_MB = 96
PROMPT_TOKENS = 2000
ANSWER_TOKENS = 16
REQUESTS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    # 4 KB of float32 KV a token: a 2,016-token request holds ~8 MB, all 16 ~130 MB.
    return make_tiny_llama(
        tmp_path_factory.mktemp("budget") / "llama", hidden_size=256, num_hidden_layers=4, intermediate_size=512
    )


@pytest.fixture(scope="module", params=["cpu", "metal", "cuda"])
def engine(request: pytest.FixtureRequest, model_dir) -> Iterator[MlxEngine]:
    # The budget counts what is alive in the process as weights: earlier tests' arrays go first.
    gc.collect()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EXO_MEMORY_BUDGET_MB", str(BUDGET_MB))
        patch.setattr(exo.engine.mlx.engine, "mlx_device", lambda: request.param)
        loaded = load_engine(model_dir)
    assert loaded.scheduler is not None
    assert loaded.scheduler.budget.step_tokens == limits.step_tokens(request.param)
    yield loaded
    loaded.close()  # the next device's budget is measured from the arrays alive then


def _params(index: int, length: int) -> TextGenerationTaskParams:
    prompt = [(7 * index + 13 * position) % 500 + 3 for position in range(length)]
    return TextGenerationTaskParams(
        model=ModelId("test/model"),
        messages=[],
        prompt=prompt,
        max_tokens=ANSWER_TOKENS,
        temperature=0.0,
        logit_bias={1: -100.0, 2: -100.0},  # both of its EOS ids
    )


def test_sixteen_long_prompts_stay_within_the_budget_and_all_finish(engine: MlxEngine):
    assert engine.scheduler is not None
    budget = engine.scheduler.budget
    print(f"budget: {budget}")
    fit_at_once = budget.kv_tokens // (PROMPT_TOKENS + ANSWER_TOKENS)
    assert 1 <= fit_at_once < REQUESTS, "the budget should hold some of the requests, not all"
    mx.reset_peak_memory()
    for index in range(REQUESTS):
        engine.submit(CommandId(f"r{index}"), _params(index, PROMPT_TOKENS))
    finished: dict[str, str] = {}
    generated: dict[str, int] = {}
    most_running = 0
    while engine.has_work:
        running, queued = engine.request_counts
        most_running = max(most_running, running)
        for chunk in engine.step():
            generated[chunk.command_id] = generated.get(chunk.command_id, 0) + len(chunk.token_ids)
            if chunk.finish_reason is not None:
                finished[chunk.command_id] = chunk.finish_reason
    peak = mx.get_peak_memory()
    print(f"peak {peak / 2**20:.1f} MiB of a {BUDGET_MB} MiB budget; at most {most_running} running at once")
    assert finished == {f"r{index}": "length" for index in range(REQUESTS)}
    assert all(count == ANSWER_TOKENS for count in generated.values())
    assert most_running == fit_at_once
    assert peak <= BUDGET_MB * 1.1 * 2**20


def test_a_prompt_larger_than_the_budget_is_refused_with_what_fits(engine: MlxEngine):
    assert engine.scheduler is not None
    fits = engine.scheduler.budget.kv_tokens
    with pytest.raises(ValueError, match=f"holds {fits} tokens"):
        engine.submit(CommandId("huge"), _params(0, fits + 1))
    assert not engine.has_work


def test_a_forward_computes_at_most_one_chunk_against_the_whole_context():
    # The GPU benchmark's 4096 x 8 llama (8 heads, 8,192 tokens of context) on an H200,
    # where a quarter of what the KV leaves, 28 GB, is set aside for attention's scores:
    # a forward's are 2,048 tokens against the whole context at most (1.6 GB), and MLX's
    # buffer cache keeps no more than that of them.
    config = {"hidden_size": 4096, "num_attention_heads": 8, "max_position_embeddings": 8192}
    assert forward_area(config, scores=28 << 30, chunk_tokens=2048) == 2048 * 8192
    # Where less is set aside than that (a small device), that share bounds it.
    assert forward_area(config, scores=64 << 20, chunk_tokens=2048) == (64 << 20) // score_bytes_per_pair(config)
    # A config naming no context: the share.
    assert forward_area({"num_attention_heads": 8}, scores=5 << 30, chunk_tokens=512) == (5 << 30) // (3 * 4 * 8)
