"""Disaggregated serving over the wire (issue 36, point 2): the decode runner's side
(worker/kv_handoffs.py's DecodeHandoffs) asks a prefill runner's KvServer on loopback
for a long prompt's KV, which streams back part by part, sealed with the cluster secret;
the greedy answer is a single engine's, and the request's stats carry the bytes on the
wire and the seconds it took. A decode side with another secret gets nothing and
prefills the request itself. Two real engines in this process, stepped in turn as two
runners would step."""

import time

import pytest

from exo.devtools.tiny_models import make_tiny
from exo.engine.kv_wire import KvServer
from exo.engine.mlx.engine import MlxEngine
from exo.shared.types.common import CommandId, ModelId
from exo.shared.types.text_generation import ChunkGenerated, GenerationStats, TextGenerationTaskParams
from exo.worker.kv_handoffs import DecodeHandoffs, PrefillService
from tests.support.engine import answers, load_engine, set_step_tokens, tokens_of

SECRET = "a cluster secret"
PROMPT_TOKENS = 150


def _params(engine: MlxEngine) -> TextGenerationTaskParams:
    assert engine.tokenizer is not None
    text = "cluster node model token the cat runs over the quiet moon and sleeps " * 20
    prompt = engine.tokenizer.encode(text)[:PROMPT_TOKENS]
    return TextGenerationTaskParams(
        model=ModelId("test/model"), messages=[], prompt=prompt, max_tokens=16, temperature=0.0
    )


def _served(
    prefill: MlxEngine,
    decode: MlxEngine,
    params: TextGenerationTaskParams,
    decode_secret: str,
    prefilled: list[ChunkGenerated] | None = None,
) -> list[ChunkGenerated]:
    """The request asked of `decode`, its prompt prefilled by `prefill` behind a KvServer
    (whose chunks go to `prefilled`)."""
    service = PrefillService(prefill, KvServer("127.0.0.1", 0, SECRET, lambda: None))
    handoffs = DecodeHandoffs(decode, ("127.0.0.1", service.server.port), decode_secret, 32, lambda: None)
    request_id = CommandId("decoded")
    if not handoffs.start(request_id, params):
        decode.submit(request_id, params)
    chunks: list[ChunkGenerated] = []
    deadline = time.monotonic() + 60
    while (handoffs.pending or decode.has_work) and time.monotonic() < deadline:
        service.poll()
        for chunk in prefill.step() if prefill.has_work else []:
            assert service.finished(chunk)
            if prefilled is not None:
                prefilled.append(chunk)
        for command_id, ready in handoffs.poll():
            decode.submit(command_id, ready)
        chunks += decode.step() if decode.has_work else []
        time.sleep(0.001)
    service.close()
    return chunks


def _fresh(monkeypatch, prefill: MlxEngine, decode: MlxEngine) -> tuple[TextGenerationTaskParams, list[int]]:
    """Both engines at 32 tokens a step with empty prefix caches; the request, and the
    decode engine's own answer to it."""
    for engine in (prefill, decode):
        set_step_tokens(monkeypatch, engine, 32)
        assert engine.scheduler is not None
        engine.scheduler.prefix_cache.clear()
    params = _params(decode)
    alone = tokens_of(answers(decode, {"alone": params})["alone"])
    assert decode.scheduler is not None
    decode.scheduler.prefix_cache.clear()
    return params, alone


def _stats(chunks: list[ChunkGenerated]) -> GenerationStats:
    [stats] = [chunk.stats for chunk in chunks if chunk.stats is not None]
    return stats


@pytest.fixture(scope="module", params=["llama", "gemma4", "qwen3_next"])
def engines(request, tmp_path_factory) -> tuple[str, MlxEngine, MlxEngine]:
    model_dir = make_tiny(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, load_engine(model_dir), load_engine(model_dir)


def test_kv_streamed_between_runners_gives_the_single_engines_answer(engines, monkeypatch):
    family, prefill, decode = engines
    params, alone = _fresh(monkeypatch, prefill, decode)

    chunks = _served(prefill, decode, params, SECRET)
    handoff = _stats(chunks).kv_handoff
    assert handoff is not None
    print(
        f"{family}: KV of {handoff.tokens} tokens, {handoff.bytes} bytes sealed, {handoff.seconds * 1000:.1f} ms "
        f"(prefill {handoff.prefill_seconds * 1000:.1f} ms)"
    )
    assert handoff.tokens == PROMPT_TOKENS - 1
    assert handoff.bytes > 0 and handoff.seconds >= handoff.prefill_seconds > 0
    assert tokens_of(chunks) == alone


def test_the_decode_sides_cached_prefix_is_offered_to_the_prefill_side(engines, monkeypatch):
    """The decode side answered the prompt itself; a longer one starting with it is
    prefilled on the other side from where the decode side's cache ends, after the
    decode side sent it that prefix over the same sealed connection."""
    family, prefill, decode = engines
    params, _ = _fresh(monkeypatch, prefill, decode)
    assert isinstance(params.prompt, list) and decode.tokenizer is not None
    answers(decode, {"first": params})
    longer = params.prompt + decode.tokenizer.encode(" and then? tell me more about the moon and the cat" * 3)
    longer_params = params.model_copy(update={"prompt": longer})

    prefilled: list[ChunkGenerated] = []
    chunks = _served(prefill, decode, longer_params, SECRET, prefilled)
    handoff = _stats(chunks).kv_handoff
    assert handoff is not None
    print(f"{family}: {handoff.offered_tokens} tokens offered, {handoff.tokens} sent back, {handoff.bytes} bytes")
    [usage] = [chunk.usage for chunk in prefilled if chunk.usage is not None]
    assert handoff.offered_tokens == usage.cached_tokens == len(longer) - 1 - handoff.tokens > 0
    decode.scheduler.prefix_cache.clear()
    assert tokens_of(chunks) == tokens_of(answers(decode, {"alone": longer_params})["alone"])


def test_a_decode_side_without_the_secret_gets_no_kv_and_prefills_itself(engines, monkeypatch):
    _, prefill, decode = engines
    params, alone = _fresh(monkeypatch, prefill, decode)

    chunks = _served(prefill, decode, params, "another secret")
    assert _stats(chunks).kv_handoff is None
    assert tokens_of(chunks) == alone
    assert len(prefill.scheduler.prefix_cache) == 0  # the prefill side never started it


def test_a_cancelled_request_stops_the_prefill_it_asked_for(engines, monkeypatch):
    """The decode side cancels while the prefill side is partway through: the prefill
    side sees the hang-up and drops the request without being stepped again, and a
    later handoff of the same prompt (finding the partial prefill in the prefill side's
    prefix cache) still answers as a single engine does."""
    _, prefill, decode = engines
    params, alone = _fresh(monkeypatch, prefill, decode)
    set_step_tokens(monkeypatch, prefill, 8)
    service = PrefillService(prefill, KvServer("127.0.0.1", 0, SECRET, lambda: None))
    handoffs = DecodeHandoffs(decode, ("127.0.0.1", service.server.port), SECRET, 32, lambda: None)
    request_id = CommandId("cancelled")
    assert handoffs.start(request_id, params)
    deadline = time.monotonic() + 30
    steps = 0
    while steps < 3 and time.monotonic() < deadline:  # a few chunks prefilled and sent
        service.poll()
        if prefill.has_work:
            prefill.step()
            steps += 1
        time.sleep(0.001)
    assert steps == 3 and prefill.has_work

    assert handoffs.cancel(request_id)
    assert not handoffs.pending
    while prefill.has_work and time.monotonic() < deadline:
        service.poll()  # never stepped: only the hang-up can end the request
        time.sleep(0.01)
    assert not prefill.has_work and not service.serving
    service.close()

    chunks = _served(prefill, decode, params, SECRET)
    assert tokens_of(chunks) == alone
