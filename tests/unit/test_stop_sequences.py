"""Stop sequences cut the stream without ever showing any part of one, however the
tokens happen to split it."""

from exo.engine.stop_sequences import StopSequenceFilter


def stream(stop: list[str], pieces: list[str]) -> tuple[str, bool]:
    """Feed the pieces in order as a generator would; what was shown, and whether a stop
    sequence ended the stream (held text is flushed only when none did)."""
    text_filter = StopSequenceFilter(stop)
    shown = ""
    for piece in pieces:
        text, stopped = text_filter.feed(piece)
        shown += text
        if stopped:
            return shown, True
    return shown + text_filter.flush(), False


def test_stop_sequence_split_over_several_feeds_is_never_shown():
    text_filter = StopSequenceFilter(["</answer>"])
    shown = [text_filter.feed(piece) for piece in ["42", "</", "ans", "wer", ">", " more"]]

    assert shown[:4] == [("42", False), ("", False), ("", False), ("", False)]
    assert shown[4] == ("", True)


def test_text_before_the_stop_sequence_is_shown():
    assert stream(["STOP"], ["Hello, wor", "ld!ST", "OP and more"]) == (
        "Hello, world!",
        True,
    )


def test_text_before_a_stop_sequence_inside_one_feed_is_shown():
    assert stream(["\n\n"], ["first line\n\nsecond"]) == ("first line", True)


def test_a_false_start_is_released_once_it_stops_matching():
    text_filter = StopSequenceFilter(["Abc"])
    assert text_filter.feed("Ab") == ("", False)
    assert text_filter.feed("x") == ("Abx", False)


def test_flush_returns_the_held_text():
    text_filter = StopSequenceFilter(["Abc"])
    assert text_filter.feed("the end: Ab") == ("the end: ", False)
    assert text_filter.flush() == "Ab"
    assert text_filter.flush() == ""


def test_multiple_stop_sequences_the_earliest_wins():
    assert stream(["world", "lo"], ["hello world"]) == ("hel", True)
    stop_filter = StopSequenceFilter(["world", "lo"])
    stop_filter.feed("hello world")
    assert stop_filter.matched == "lo"


def test_multiple_stop_sequences_held_prefix_of_one_and_hit_of_another():
    # "<|e" could still become "<|end|>", but "||" completes first and earlier.
    assert stream(["<|end|>", "||"], ["a <", "||e"]) == ("a <", True)


def test_without_stop_sequences_everything_passes_through():
    assert stream([], ["Ab", "c"]) == ("Abc", False)
    assert stream([""], ["Ab", "c"]) == ("Abc", False)
