"""The llama.cpp engine in this process (real llama.cpp, the tiny llama's GGUF):
continuous batching gives each request exactly the tokens it gets alone, requests join
and leave between steps, admission stops at MAX_BATCH, prompts prefill in chunks, and a
finished request's saved KV serves a later prompt sharing its start (an agent's next
turn included) while no finished request holds KV cells."""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

import exo.engine.llamacpp.engine as llamacpp_engine
from exo.catalog.cards import card_from_model_dir
from exo.engine import limits
from exo.engine.encoding.chat_prompt import encode_prompt
from exo.engine.llamacpp.engine import LlamaCppEngine
from exo.shared.types.common import CommandId, ModelId
from exo.shared.types.shards import PipelineShardMetadata
from exo.shared.types.text_generation import ChatMessage, ChunkGenerated, TextGenerationTaskParams
from tests.support.engine import set_step_tokens
from tests.support.node import TINY_MODEL_ID


@contextmanager
def loaded_engine(tiny_models_dir: Path, home: Path) -> Iterator[LlamaCppEngine]:
    model_dir = tiny_models_dir / TINY_MODEL_ID.replace("/", "--")
    card = card_from_model_dir(model_dir, "test/model")
    shard = PipelineShardMetadata(
        model_card=card, device_rank=0, world_size=1, start_layer=0, end_layer=card.n_layers, n_layers=card.n_layers
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EXO_HOME", str(home))
        engine = LlamaCppEngine()
        engine.load(model_dir, shard, lambda done, total: None)
        engine.warm_up()
        yield engine
        engine.close()


@pytest.fixture(scope="module")
def engine(tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaCppEngine]:
    with loaded_engine(tiny_models_dir, tmp_path_factory.mktemp("home")) as loaded:
        yield loaded


def params(text: str, max_tokens: int, **extra) -> TextGenerationTaskParams:
    return TextGenerationTaskParams(
        model=ModelId("m"),
        messages=[ChatMessage(role="user", content=text)],
        max_tokens=max_tokens,
        temperature=0.0,
        **extra,
    )


def run(engine: LlamaCppEngine, requests: dict[str, TextGenerationTaskParams], join_at: dict[str, int] | None = None):
    """Steps until every request finished; those in `join_at` are submitted at that step."""
    join_at = join_at or {}
    chunks: dict[str, list[ChunkGenerated]] = {name: [] for name in requests}
    for name, request in requests.items():
        if name not in join_at:
            engine.submit(CommandId(name), request)
    step = 0
    while engine.has_work or any(at >= step for at in join_at.values()):
        for name, at in join_at.items():
            if at == step:
                engine.submit(CommandId(name), requests[name])
        for chunk in engine.step():
            chunks[chunk.command_id].append(chunk)
        step += 1
    return chunks


def tokens(chunks: list[ChunkGenerated]) -> list[int]:
    return [token for chunk in chunks for token in chunk.token_ids]


def logprobs(chunks: list[ChunkGenerated]) -> list[list[float]]:
    return [[alt.logprob for alt in lp.top_logprobs] for chunk in chunks for lp in chunk.logprobs or []]


REQUESTS = {
    "short": params("the cat", 12, logprobs=True, top_logprobs=5),
    "long": params("the quiet dog sleeps under the bright moon " * 6, 20, presence_penalty=1.5),
    "biased": params("a node runs fast", 16, logit_bias={300: 4.0}),
    "late": params("the sun is slow over the cluster", 10, frequency_penalty=0.7),
}


def test_batched_requests_get_the_tokens_each_gets_alone(engine: LlamaCppEngine):
    alone = {name: run(engine, {name: request})[name] for name, request in REQUESTS.items()}
    together = run(engine, REQUESTS, join_at={"biased": 3, "late": 5})
    for name in REQUESTS:
        assert tokens(together[name]) == tokens(alone[name]), name
        assert together[name][-1].finish_reason is not None
    got, expected = np.array(logprobs(together["short"])), np.array(logprobs(alone["short"]))
    assert got.shape == expected.shape == (12, 5)
    assert np.abs(got - expected).max() <= 1e-4


def test_a_cancelled_request_leaves_and_the_others_are_unchanged(engine: LlamaCppEngine):
    alone = run(engine, {"short": REQUESTS["short"]})["short"]
    engine.submit(CommandId("short"), REQUESTS["short"])
    engine.submit(CommandId("gone"), params("the dog", 50))
    seen: list[ChunkGenerated] = []
    for step in range(60):
        if step == 4:
            engine.cancel(CommandId("gone"))
        for chunk in engine.step():
            assert chunk.command_id == "short" or step < 4
            if chunk.command_id == "short":
                seen.append(chunk)
        if not engine.has_work:
            break
    assert tokens(seen) == tokens(alone)


def test_admission_stops_at_max_batch(engine: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(limits, "MAX_BATCH", 2)
    for i in range(4):
        engine.submit(CommandId(f"r{i}"), params(f"the node {i}", 5))
    assert engine.request_counts == (2, 2)
    stepped: set[str] = set()
    for chunk in engine.step():
        stepped.add(chunk.command_id)
    assert engine.request_counts == (2, 2)
    assert stepped == {"r0", "r1"}
    while engine.has_work:
        engine.step()
    assert engine.request_counts == (0, 0)


def test_prompts_prefill_in_chunks_of_the_budget(engine: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch):
    set_step_tokens(monkeypatch, engine, 16)
    request = params("the bright cluster node runs over the quiet moon " * 5, 2)
    chunks = run(engine, {"long": request})["long"]
    progress = [chunk.prefill.processed_tokens for chunk in chunks if chunk.prefill is not None]
    usage = chunks[-1].usage
    assert usage is not None
    steps = [b - a for a, b in zip([usage.cached_tokens, *progress], progress, strict=False)]
    assert len(steps) > 2 and all(0 < step <= 16 for step in steps), steps
    assert progress[-1] == usage.prompt_tokens


def test_a_later_prompt_reuses_the_kv_of_an_earlier_one(engine: LlamaCppEngine):
    first = run(engine, {"a": params("the moon sleeps over the slow cluster", 6)})["a"]
    again = run(engine, {"b": params("the moon sleeps over the slow cluster", 6)})["b"]
    usage = again[-1].usage
    assert usage is not None and usage.cached_tokens == usage.prompt_tokens - 1
    assert tokens(again) == tokens(first)


def test_an_agents_next_turn_prefills_only_its_new_message(engine: LlamaCppEngine):
    """Turn 2 re-sends turn 1 and its answer: they come from turn 1's snapshot, and the
    answer is what the same prompt gets with nothing cached. Turn 2 is token ids (turn
    1's prompt, its answer's tokens, a new message's), as in tests/unit/test_agent_turn_cache.py:
    a random model's answer is no text that tokenizes back to itself."""
    question = "the quiet moon runs over the bright cluster node " * 3
    turn1 = params(question, 24)
    first_prompt = encode_prompt(engine.tokenizer, turn1, engine.model_type, engine.reasoning_dialect)[0]
    first = run(engine, {"turn1": turn1})["turn1"]
    new_message = engine.tokenizer.encode(" and the cat?", add_special_tokens=False)
    turn2 = params("", 8).model_copy(update={"messages": [], "prompt": first_prompt + tokens(first) + new_message})
    warm = run(engine, {"turn2": turn2})["turn2"]
    usage1, usage2 = first[-1].usage, warm[-1].usage
    assert usage1 is not None and usage2 is not None and usage1.prompt_tokens == len(first_prompt)
    covered = usage2.cached_tokens / (usage1.prompt_tokens + usage1.completion_tokens)
    assert covered >= 0.95, (usage2.cached_tokens, usage1.prompt_tokens, usage1.completion_tokens)
    assert engine.scheduler is not None
    engine.scheduler.prefix_cache.clear()
    cold = run(engine, {"cold": turn2})["cold"]
    assert cold[-1].usage is not None and cold[-1].usage.cached_tokens == 0
    assert tokens(warm) == tokens(cold)


def test_finished_requests_hold_no_kv_cells(engine: LlamaCppEngine):
    """The prefix cache lives in host memory: once every request is done, no sequence of
    the context holds a cell (each decode attends over the cells in use)."""
    import llama_cpp

    run(engine, {name: params(f"the node {name} sleeps", 6) for name in ("a", "b", "c")})
    assert engine.scheduler is not None and engine.context is not None
    assert len(engine.scheduler.prefix_cache) >= 3
    memory = engine.context.memory
    assert [llama_cpp.llama_memory_seq_pos_max(memory, s) for s in range(limits.MAX_BATCH)] == [-1] * 8


def test_an_answer_ends_with_length_where_its_context_does(engine: LlamaCppEngine):
    assert engine.context is not None
    chunks = run(engine, {"long": params("the cat", 10**6, logit_bias={1: -100.0})})["long"]
    usage = chunks[-1].usage
    assert chunks[-1].finish_reason == "length" and usage is not None
    assert usage.prompt_tokens + usage.completion_tokens == engine.max_context == engine.context.n_ctx
    with pytest.raises(ValueError, match="do not fit"):
        huge = params("", 4).model_copy(update={"messages": [], "prompt": [5] * engine.max_context})
        engine.submit(CommandId("huge"), huge)


def test_the_context_grows_under_running_requests(tiny_models_dir: Path, tmp_path: Path):
    """A new engine's context is small; a request that may fill more makes it grow while
    another decodes, whose KV moves over: its tokens and logprobs are those it gets alone."""
    with loaded_engine(tiny_models_dir, tmp_path) as engine:
        assert engine.context is not None and engine.context.n_ctx == llamacpp_engine.FIRST_CONTEXT
        short = params("the quiet moon runs over the bright cluster node", 30, logprobs=True, top_logprobs=3)
        alone = run(engine, {"short": short})["short"]
        assert engine.context.n_ctx == llamacpp_engine.FIRST_CONTEXT
        engine.submit(CommandId("short"), short)
        seen: list[ChunkGenerated] = []
        for step in range(200):
            if step == 10:
                engine.submit(CommandId("long"), params("the dog", 1500))
            seen += [chunk for chunk in engine.step() if chunk.command_id == "short"]
            if seen and seen[-1].finish_reason is not None:
                break
        engine.cancel(CommandId("long"))
        assert engine.context.n_ctx >= 1500
        assert tokens(seen) == tokens(alone)
        assert np.abs(np.array(logprobs(seen)) - np.array(logprobs(alone))).max() <= 1e-4


def test_context_sizes_double_in_steps_up_to_the_ceiling():
    assert llamacpp_engine.context_size(512, 400, 4096) == 512
    assert llamacpp_engine.context_size(512, 600, 4096) == 1024
    assert llamacpp_engine.context_size(512, 1500, 4096) == 1536
    assert llamacpp_engine.context_size(2048, 9000, 4096) == 4096


def test_a_context_that_cannot_grow_ends_answers_where_it_is_full(
    tiny_models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A machine without memory for a larger context (llama.cpp refusing to make one,
    simulated here: the only stand-in in this file) keeps the one it has: the answer
    ends with "length" where it is full, and the next prompt is told its room."""
    with loaded_engine(tiny_models_dir, tmp_path) as engine:
        first = llamacpp_engine.FIRST_CONTEXT
        make = engine._new_context

        def limited(n_ctx: int):
            if n_ctx > first:
                raise RuntimeError("llama.cpp could not create a context")
            return make(n_ctx)

        monkeypatch.setattr(engine, "_new_context", limited)
        chunks = run(engine, {"long": params("the cat", 2000, logit_bias={1: -100.0})})["long"]
        usage = chunks[-1].usage
        assert chunks[-1].finish_reason == "length" and usage is not None
        assert usage.prompt_tokens + usage.completion_tokens == first == engine.max_context
        assert engine.context is not None and engine.context.n_ctx == first
        with pytest.raises(ValueError, match="do not fit"):
            engine.submit(CommandId("huge"), params("", 4).model_copy(update={"messages": [], "prompt": [5] * first}))


def test_a_logits_row_is_read_where_it_was_asked_and_refused_where_not(engine: LlamaCppEngine):
    """The engine views llama.cpp's logits in place: the row of a token that asked for
    them holds the vocabulary's scores; one that did not raises, not a read of address 0."""
    context = engine.context
    assert context is not None and engine.model is not None
    context.batch.clear()
    last = context.batch.add([5, 6, 7], 0, limits.MAX_BATCH - 1, True)
    try:
        assert context.decode() == 0
        row = context.logits(last)
        assert row.shape == (engine.model.n_vocab,) and np.isfinite(row).all() and row.std() > 0
        assert np.array_equal(row, context.logits(last))
        with pytest.raises(RuntimeError, match="no logits for batch row 0"):
            context.logits(0)
    finally:
        context.remove(limits.MAX_BATCH - 1)


def test_prompts_beyond_the_context_wait_for_room_and_all_finish(engine: LlamaCppEngine):
    """8 prompts of 1,024 tokens on a model whose context is 4,096: admission holds each
    running request's prompt and answer in the context's cells, so three run at once and
    the others wait in the queue; every one is answered in full, none fails."""
    assert engine.max_context == 4096
    requests = {
        f"r{i}": params("", 16).model_copy(update={"messages": [], "prompt": [5 + i] * 1024, "logit_bias": {1: -100.0}})
        for i in range(8)
    }
    for name, request in requests.items():
        engine.submit(CommandId(name), request)
    most_running, chunks = 0, {name: [] for name in requests}
    while engine.has_work:
        running, queued = engine.request_counts
        most_running = max(most_running, running)
        assert running + queued <= 8
        for chunk in engine.step():
            chunks[chunk.command_id].append(chunk)
    assert most_running == 3
    for name in requests:
        assert chunks[name][-1].finish_reason == "length", chunks[name][-1]
        assert len(tokens(chunks[name])) == 16
