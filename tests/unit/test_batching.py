"""Continuous batching in the MLX engine (real engine, in this process, tiny llama):
concurrent greedy requests of different prompt lengths, joining at different steps and
leaving at different lengths, give exactly the tokens each gives alone, with
log-probabilities (the chosen token's and the top 5) within 1e-4; once all decode, a
step is one forward of the model; penalties and logit bias stay per request; a
cancelled member leaves without disturbing the others; beyond the admission limit
requests wait and still answer the same. A request alone in the batch answers as on
mlx-lm's own generate_step."""

from collections import defaultdict
from dataclasses import replace
from itertools import pairwise

import numpy as np
import pytest

from exo.devtools.tiny_models import make_tiny_llama
from exo.engine import limits
from exo.engine.mlx import engine as engine_module
from exo.engine.mlx.batching import forward_groups
from exo.engine.mlx.engine import MlxEngine
from exo.shared.types.common import CommandId, ModelId
from exo.shared.types.text_generation import ChatMessage, ChunkGenerated, TextGenerationTaskParams
from tests.support.engine import load_engine, set_step_tokens

TOLERANCE = 1e-4
WORDS = "cluster node model token the cat runs over the quiet moon "


def _params(repeat: int, max_tokens: int, **extra) -> TextGenerationTaskParams:
    return TextGenerationTaskParams(
        model=ModelId("test/model"),
        messages=[ChatMessage(role="user", content=WORDS * repeat)],
        max_tokens=max_tokens,
        temperature=0.0,
        logprobs=True,
        top_logprobs=5,
        **extra,
    )


REQUESTS = {
    "short": _params(1, 30),
    "long": _params(9, 24),
    "middle": _params(4, 32, presence_penalty=1.5),
    "biased": _params(2, 28, logit_bias={7: 4.0, 9: 3.0}),
}


class _CountingModel:
    """The engine's model with its calls counted: a decode forward is a call of the whole
    model (prefill calls the inner model)."""

    def __init__(self, model) -> None:
        self.model_object = model
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.model_object(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model_object, name)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> MlxEngine:
    return load_engine(make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", num_hidden_layers=4))


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch, engine):
    set_step_tokens(monkeypatch, engine, 16)
    engine.scheduler.prefix_cache.clear()


def _collect(chunks: list[ChunkGenerated], out: dict) -> None:
    for chunk in chunks:
        record = out[chunk.command_id]
        record["tokens"] += chunk.token_ids
        for logprob in chunk.logprobs or []:
            record["chosen"].append(logprob.logprob)
            record["top"].append(sorted((top.token_id, top.logprob) for top in logprob.top_logprobs))
        if chunk.finish_reason is not None:
            record["finish"] = chunk.finish_reason


def _record() -> dict:
    return defaultdict(lambda: {"tokens": [], "chosen": [], "top": [], "finish": None})


def _alone(engine: MlxEngine, name: str) -> dict:
    engine.scheduler.prefix_cache.clear()
    out = _record()
    engine.submit(CommandId(name), REQUESTS[name])
    while engine.has_work:
        _collect(engine.step(), out)
    return out[name]


def _assert_same(got: dict, alone: dict, name: str) -> None:
    assert got["tokens"] == alone["tokens"], name
    assert got["finish"] == alone["finish"], name
    np.testing.assert_allclose(got["chosen"], alone["chosen"], atol=TOLERANCE)
    for step_got, step_alone in zip(got["top"], alone["top"], strict=True):
        assert [token for token, _ in step_got] == [token for token, _ in step_alone], name
        np.testing.assert_allclose([lp for _, lp in step_got], [lp for _, lp in step_alone], atol=TOLERANCE)


def test_alone_in_the_batch_answers_as_mlx_lms_generate_step(engine, monkeypatch):
    batched = {name: _alone(engine, name) for name in REQUESTS}
    monkeypatch.setattr(engine_module, "can_batch", lambda cache: False)
    for name in REQUESTS:
        _assert_same(batched[name], _alone(engine, name), name)


def test_concurrent_greedy_requests_answer_as_alone_in_one_forward_per_step(engine, monkeypatch):
    alone = {name: _alone(engine, name) for name in REQUESTS}
    engine.scheduler.prefix_cache.clear()
    counting = _CountingModel(engine.model)
    monkeypatch.setattr(engine, "model", counting)
    out = _record()
    names = list(REQUESTS)
    # Two start together; the others join while those decode.
    for name in names[:2]:
        engine.submit(CommandId(name), REQUESTS[name])
    steps, batched_steps = 0, 0
    while engine.has_work:
        if steps == 3:
            for name in names[2:]:
                engine.submit(CommandId(name), REQUESTS[name])
        before = counting.calls
        chunks = engine.step()
        decoding = [chunk for chunk in chunks if chunk.token_ids]
        if len(decoding) == len(REQUESTS) and not any(chunk.prefill for chunk in chunks):
            # Every request got its token from a single forward of the model.
            assert counting.calls - before == 1
            batched_steps += 1
        _collect(chunks, out)
        steps += 1
    assert batched_steps >= 3, batched_steps
    for name in names:
        _assert_same(out[name], alone[name], name)


def test_a_cancelled_member_leaves_and_the_others_answer_as_alone(engine):
    alone = {name: _alone(engine, name) for name in ("short", "middle")}
    engine.scheduler.prefix_cache.clear()
    out = _record()
    for name in ("short", "long", "middle"):
        engine.submit(CommandId(name), REQUESTS[name])
    cancelled = False
    while engine.has_work:
        chunks = engine.step()
        _collect(chunks, out)
        if not cancelled and len(out["long"]["tokens"]) >= 3:
            engine.cancel(CommandId("long"))
            cancelled = True
            tokens_at_cancel = len(out["long"]["tokens"])
    assert cancelled and len(out["long"]["tokens"]) == tokens_at_cancel
    assert out["long"]["finish"] is None
    for name in ("short", "middle"):
        _assert_same(out[name], alone[name], name)


def test_requests_beyond_the_admission_limit_wait_their_turn(engine, monkeypatch):
    alone = {name: _alone(engine, name) for name in REQUESTS}
    engine.scheduler.prefix_cache.clear()
    monkeypatch.setattr(limits, "MAX_BATCH", 2)
    out = _record()
    for name in REQUESTS:
        engine.submit(CommandId(name), REQUESTS[name])
    finished: set[str] = set()
    while engine.has_work:
        chunks = engine.step()
        active = {chunk.command_id for chunk in chunks}
        # Only the two oldest unfinished requests are stepped.
        waiting_order = [name for name in REQUESTS if name not in finished]
        assert active <= set(waiting_order[:2]), (active, waiting_order)
        _collect(chunks, out)
        finished |= {chunk.command_id for chunk in chunks if chunk.finish_reason is not None}
    for name in REQUESTS:
        _assert_same(out[name], alone[name], name)


def test_short_prompts_arriving_together_prefill_in_one_step_within_the_budget(engine, monkeypatch):
    set_step_tokens(monkeypatch, engine, 64)
    names = ["a", "b", "c"]
    for name in names:
        engine.submit(CommandId(name), _params(1, 4))
    progress: dict[str, int] = {}
    first = engine.step()
    # All three prompts (about 20 tokens each) fit in one step's 64 tokens: each has its
    # first token after that step, none waits for another's prefill.
    assert {chunk.command_id for chunk in first if chunk.token_ids} == set(names)
    for chunk in first:
        if chunk.prefill is not None:
            progress[chunk.command_id] = chunk.prefill.processed_tokens
    assert sum(progress.values()) <= 64
    while engine.has_work:
        engine.step()
    # A long prompt takes at most 64 prompt tokens a step (none from the prefix cache).
    engine.scheduler.prefix_cache.clear()
    engine.submit(CommandId("long"), _params(12, 2))
    done = 0
    while engine.has_work:
        for chunk in engine.step():
            if chunk.prefill is not None:
                assert chunk.prefill.processed_tokens - done <= 64
                done = chunk.prefill.processed_tokens
    assert done > 64


def _forwards_of(engine: MlxEngine, names: list[str], monkeypatch) -> tuple[list[tuple[int, int]], dict, set]:
    """The named requests submitted together and stepped to the end: the prompt forwards
    the engine ran, as (rows, longest chunk), everyone's answer, and who had a first token
    after the first step."""
    forwards: list[tuple[int, int]] = []
    together, alone = engine_module.prefill_together, engine_module.prefill_chunk

    def recorded_together(model, caches, chunks):
        forwards.append((len(chunks), max(len(chunk) for chunk in chunks)))
        return together(model, caches, chunks)

    def recorded_alone(model, tokens, cache, *args):
        forwards.append((1, len(tokens)))
        return alone(model, tokens, cache, *args)

    engine.scheduler.prefix_cache.clear()
    out = _record()
    with monkeypatch.context() as patched:
        patched.setattr(engine_module, "prefill_together", recorded_together)
        patched.setattr(engine_module, "prefill_chunk", recorded_alone)
        for name in names:
            engine.submit(CommandId(name), REQUESTS[name])
        first = engine.step()
        _collect(first, out)
        while engine.has_work:
            _collect(engine.step(), out)
    return forwards, out, {chunk.command_id for chunk in first if chunk.token_ids}


def test_a_steps_prompt_chunks_past_a_forwards_attention_area_go_through_in_more_forwards(engine, monkeypatch):
    # Three prompts (about 20 to 50 tokens) in one step of 256 tokens. With no limit on
    # attention's area they prefill in one forward; with an area that fits any one of them
    # alone but not all three padded to one length, in more forwards within it. Either
    # way every one has its first token after that step and answers as it does alone.
    names = ["short", "middle", "biased"]
    alone = {name: _alone(engine, name) for name in names}
    budget = replace(engine.scheduler.budget, step_tokens=256, forward_area=None)
    monkeypatch.setattr(engine.scheduler, "budget", budget)
    forwards, out, first = _forwards_of(engine, names, monkeypatch)
    assert len(forwards) == 1 and forwards[0][0] == 3, forwards
    assert first == set(names)
    longest = forwards[0][1]  # no prompt is cached: a chunk attends to itself alone
    area = 2 * longest * longest - 1
    monkeypatch.setattr(engine.scheduler, "budget", replace(budget, forward_area=area))
    forwards, out, first = _forwards_of(engine, names, monkeypatch)
    assert len(forwards) >= 2, forwards
    assert all(rows * chunk * chunk <= area for rows, chunk in forwards), (forwards, area)
    assert sum(rows for rows, _ in forwards) == 3
    assert first == set(names)
    for name in names:
        _assert_same(out[name], alone[name], name)


def test_a_steps_chunks_are_grouped_into_forwards_within_their_tokens_and_area():
    chunks = [(2048, 2048)] * 4 + [(16, 16)]  # 4 prompts of 2,048 tokens and a short one
    assert forward_groups(chunks, None, None) == [[0, 1, 2, 3, 4]]
    # 4,096 tokens a forward (a GPU's): two long prompts, padded to one length, fill one.
    assert forward_groups(chunks, None, 4096) == [[0, 1], [2, 3], [4]]
    # The area of one 2,048-token chunk against 4,096 positions holds two at depth 2,048.
    assert forward_groups(chunks, 2048 * 4096, None) == [[0, 1], [2, 3], [4]]
    # A chunk too large for either still goes, alone.
    assert forward_groups(chunks, 1000, 10) == [[0], [1], [2], [3], [4]]


def test_an_nvidia_gpu_steps_as_mlx_lms_batch_generator_in_forwards_of_4096_tokens(monkeypatch):
    monkeypatch.delenv("EXO_PREFILL_STEP", raising=False)
    monkeypatch.delenv("EXO_PREFILL_CHUNK", raising=False)
    assert (limits.step_tokens("cuda"), limits.chunk_tokens("cuda")) == (16384, 2048)
    assert limits.forward_tokens("cuda", 16384, 2048) == 4096
    for device, step in (("metal", 2048), ("cpu", 512)):  # one step, one chunk, one forward
        assert (limits.step_tokens(device), limits.chunk_tokens(device)) == (step, None)
        assert limits.forward_tokens(device, step, None) == step
    # A chunk set larger than the device's forward widens the forward to hold it.
    monkeypatch.setenv("EXO_PREFILL_STEP", "16384")
    monkeypatch.setenv("EXO_PREFILL_CHUNK", "2048")
    assert limits.forward_tokens("cpu", limits.step_tokens("cpu"), limits.chunk_tokens("cpu")) == 2048


def test_a_chunk_whose_attention_exceeds_a_forwards_area_alone_is_cut_to_fit(engine, monkeypatch):
    # An area of 400 query-key pairs: a prompt of ~50 tokens feeds 20 (20 x 20), then
    # chunks that shrink as it goes deeper (13 x 33, ...), and answers as it does alone.
    alone = _alone(engine, "middle")
    budget = replace(engine.scheduler.budget, step_tokens=256, forward_area=400)
    monkeypatch.setattr(engine.scheduler, "budget", budget)
    engine.scheduler.prefix_cache.clear()
    out = _record()
    engine.submit(CommandId("middle"), REQUESTS["middle"])
    fed = [0]
    while engine.has_work:
        chunks = engine.step()
        _collect(chunks, out)
        fed += [chunk.prefill.processed_tokens for chunk in chunks if chunk.prefill is not None]
    lengths = [end - start for start, end in pairwise(fed)]
    assert lengths[0] == 20 and len(lengths) > 3, lengths
    assert all(length * end <= 400 for length, end in zip(lengths, fed[1:], strict=True)), fed
    _assert_same(out["middle"], alone, "middle")


def test_each_prompt_feeds_at_most_its_chunk_a_step_beside_the_others(engine, monkeypatch):
    # A step of 64 tokens, 8 of them at most from one prompt (EXO_PREFILL_CHUNK, vLLM's
    # long_prefill_token_threshold): prompts arriving together each feed 8 tokens in every
    # step, all in the first, and answer as they do alone.
    monkeypatch.setenv("EXO_PREFILL_CHUNK", "8")
    assert limits.chunk_tokens("cpu") == 8
    budget = replace(engine.scheduler.budget, step_tokens=64, chunk_tokens=limits.chunk_tokens("cpu"))
    monkeypatch.setattr(engine.scheduler, "budget", budget)
    names = ["short", "middle", "biased"]
    alone = {name: _alone(engine, name) for name in names}
    engine.scheduler.prefix_cache.clear()
    out = _record()
    for name in names:
        engine.submit(CommandId(name), REQUESTS[name])
    fed: dict[str, list[int]] = defaultdict(list)
    steps = 0
    while engine.has_work:
        chunks = engine.step()
        steps += 1
        for chunk in chunks:
            if chunk.prefill is not None:
                fed[chunk.command_id].append(chunk.prefill.processed_tokens)
        _collect(chunks, out)
    for name in names:
        assert fed[name][0] == 8, name  # in the first step, beside the other two
        assert all(b - a <= 8 for a, b in zip([0, *fed[name]], fed[name], strict=False)), fed[name]
        assert len(fed[name]) > 1, name
        _assert_same(out[name], alone[name], name)
