"""Chunks waiting together in a runner's pipe go on as one per request, in order, with
prefill progress, last chunks and other messages kept apart; and the runner's hold
(`HeldChunks`) sends a request's first token and its last at once, the tokens between
merged per interval."""

import time

from exo.shared.types.common import CommandId, TaskId
from exo.shared.types.events import TaskStatusUpdated
from exo.shared.types.tasks import TaskStatus
from exo.shared.types.text_generation import ChunkGenerated, PrefillProgress, TokenLogprob, Usage
from exo.worker.chunk_coalescing import HeldChunks, coalesced


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


def test_held_chunks_send_the_first_token_at_once_and_the_rest_merged_per_interval():
    sent: list[ChunkGenerated] = []
    hold = HeldChunks(sent.append, interval=0.05)
    hold.put(ChunkGenerated(command_id=CommandId("a"), prefill=PrefillProgress(processed_tokens=2, total_tokens=2)))
    hold.put(token("a", "he", 1))
    assert [c.text for c in sent] == ["", "he"]  # prefill progress and the first token: not held
    hold.put(token("a", "l", 2))
    hold.put(token("b", "x", 9))  # b's first token goes at once, a's stay held
    hold.put(token("a", "l", 3))
    hold.tick()
    assert [c.text for c in sent] == ["", "he", "x"]
    time.sleep(0.06)
    hold.tick()
    assert [(c.text, c.token_ids) for c in sent[3:]] == [("ll", [2, 3])]
    hold.put(token("a", "o", 4))
    hold.put(token("a", "!", 5, finish_reason="stop"))  # the last takes what was held, at once
    assert [(c.text, c.token_ids, c.finish_reason) for c in sent[4:]] == [("o!", [4, 5], "stop")]
    hold.put(token("b", "y", 8))
    hold.forget(CommandId("b"))  # cancelled: what it held goes first
    assert [c.text for c in sent[5:]] == ["y"]
    hold.put(token("b", "z", 7))  # no longer streaming: a late chunk is not held
    assert [c.text for c in sent[6:]] == ["z"]


def test_held_chunks_keep_an_error_after_the_tokens_before_it():
    sent: list[ChunkGenerated] = []
    hold = HeldChunks(sent.append, interval=10)
    hold.put(token("a", "1", 1))
    hold.put(token("a", "2", 2, logprobs=lp(2)))
    hold.put(ChunkGenerated(command_id=CommandId("a"), finish_reason="error", error_message="boom"))
    assert [(c.text, c.finish_reason) for c in sent] == [("1", None), ("2", None), ("", "error")]
