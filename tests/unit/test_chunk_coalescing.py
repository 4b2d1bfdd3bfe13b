"""Chunks waiting together in a runner's pipe go on as one per request, in order, with
prefill progress, last chunks and other messages kept apart."""

from exo.shared.types.common import CommandId, TaskId
from exo.shared.types.events import TaskStatusUpdated
from exo.shared.types.tasks import TaskStatus
from exo.shared.types.text_generation import ChunkGenerated, PrefillProgress, TokenLogprob, Usage
from exo.worker.chunk_coalescing import coalesced


def token(request: str, text: str, token_id: int, **extra) -> ChunkGenerated:
    return ChunkGenerated(command_id=CommandId(request), text=text, token_ids=[token_id], **extra)


def lp(token_id: int) -> list[TokenLogprob]:
    return [TokenLogprob(token=str(token_id), token_id=token_id, logprob=-0.5)]


def test_a_run_of_one_requests_tokens_becomes_one_chunk_ending_where_the_last_ends():
    done = TaskStatusUpdated(task_id=TaskId("t"), status=TaskStatus.Complete)
    usage = Usage(prompt_tokens=3, completion_tokens=3)
    messages = [
        ChunkGenerated(command_id=CommandId("a"), prefill=PrefillProgress(processed_tokens=3, total_tokens=3)),
        token("a", "he", 1, logprobs=lp(1)),
        token("a", "ll", 2, logprobs=lp(2)),
        token("b", "x", 9),
        token("b", "y", 8),
        token("a", "o", 3, logprobs=lp(3), finish_reason="stop", usage=usage),
        token("a", "!", 4),
        done,
    ]
    out = list(coalesced(messages))
    assert [type(m).__name__ for m in out] == ["ChunkGenerated"] * 5 + ["TaskStatusUpdated"]
    prefill, a, b, a_last, a_after = out[:5]
    assert prefill.prefill is not None and not prefill.token_ids
    assert (a.text, a.token_ids, [e.token_id for e in a.logprobs or []]) == ("hell", [1, 2], [1, 2])
    assert (b.text, b.token_ids) == ("xy", [9, 8])
    assert (a_last.text, a_last.finish_reason, a_last.usage) == ("o", "stop", usage)
    # Nothing is merged into a chunk that ended its request.
    assert a_after.text == "!"


def test_a_last_chunk_takes_the_tokens_before_it():
    out = list(coalesced([token("a", "1", 1), token("a", "2", 2, finish_reason="length")]))
    assert len(out) == 1 and out[0].text == "12" and out[0].token_ids == [1, 2] and out[0].finish_reason == "length"
