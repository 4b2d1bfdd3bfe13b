"""The reasoning parser separates thinking from the answer however the decoded pieces
split its markers, and never shows or loses a partial marker."""

import pytest

from exo.engine.parsing.base import Parsed
from exo.engine.parsing.reasoning import ReasoningParser, prompt_opens_reasoning, repair_unmatched_end
from exo.shared.models.families import THINK_MARKERS

MARKER_PAIRS = {
    "qwen": ("<think>", "</think>"),
    "kimi_vl": ("◁think▷", "◁/think▷"),
    "gemma4": THINK_MARKERS["gemma4"],
}
# How each marker is cut into pieces: whole, in three, or in two at every index.
SPLITS = ["whole", "thirds", *range(1, 20)]


def split_marker(marker: str, how: str | int) -> list[str]:
    if how == "whole":
        return [marker]
    if how == "thirds":
        a, b = len(marker) // 3, 2 * len(marker) // 3
        return [part for part in (marker[:a], marker[a:b], marker[b:]) if part]
    cut = min(int(how), len(marker) - 1)
    return [marker[:cut], marker[cut:]]


def run(parser, pieces: list[str]) -> Parsed:
    total = Parsed()
    for piece in pieces:
        total.extend(parser.feed(piece))
    total.extend(parser.finish())
    return total


@pytest.mark.parametrize("how", SPLITS)
@pytest.mark.parametrize("family", MARKER_PAIRS)
def test_markers_split_across_pieces_are_recognised(family: str, how: str | int) -> None:
    start, end = MARKER_PAIRS[family]
    pieces = ["Hmm. ", *split_marker(start, how), "Because 2+2=4.", *split_marker(end, how), "The answer is 4."]
    result = run(ReasoningParser(start, end), pieces)
    assert result.reasoning == "Because 2+2=4."
    assert result.text == "Hmm. The answer is 4."


@pytest.mark.parametrize("family", MARKER_PAIRS)
def test_character_by_character_matches_whole(family: str) -> None:
    start, end = MARKER_PAIRS[family]
    output = f"{start}step one\nstep two{end}\n\nDone <b>bold</b> a < b"
    by_char = run(ReasoningParser(start, end), list(output))
    whole = run(ReasoningParser(start, end), [output])
    assert by_char == whole
    assert whole.reasoning == "step one\nstep two"
    assert whole.text == "\n\nDone <b>bold</b> a < b"


def test_partial_marker_is_held_back_not_shown() -> None:
    parser = ReasoningParser()
    assert parser.feed("<") == Parsed()
    assert parser.feed("th") == Parsed()
    assert parser.feed("ink>") == Parsed()
    assert parser.feed("why") == Parsed(reasoning="why")


def test_partial_marker_at_the_end_is_flushed_as_text() -> None:
    result = run(ReasoningParser(), ["The tag is <th"])
    assert result == Parsed(text="The tag is <th")


def test_partial_end_marker_at_the_end_is_flushed_as_reasoning() -> None:
    result = run(ReasoningParser(starts_in_reasoning=True), ["still thinking </thi"])
    assert result == Parsed(reasoning="still thinking </thi")


def test_text_that_only_resembles_a_marker_is_text() -> None:
    result = run(ReasoningParser(), list("<thinking> and <th>cells</th>"))
    assert result == Parsed(text="<thinking> and <th>cells</th>")


def test_prompt_that_opened_the_block_starts_in_reasoning() -> None:
    result = run(ReasoningParser(starts_in_reasoning=True), ["Let me see", ".</think>", "\n\nYes."])
    assert result.reasoning == "Let me see."
    assert result.text == "\n\nYes."


def test_thinking_can_reopen_later_in_the_turn() -> None:
    result = run(ReasoningParser(), ["<think>a</think>b<think>c</think>d"])
    assert result == Parsed(text="bd", reasoning="ac")


def test_stray_end_marker_is_not_shown() -> None:
    result = run(ReasoningParser(), ["thought</think>answer"])
    assert result == Parsed(text="thoughtanswer")


def test_no_markers_at_all_is_plain_text() -> None:
    assert run(ReasoningParser(), ["Hello", " world"]) == Parsed(text="Hello world")


@pytest.mark.parametrize(
    ("prompt", "opens"),
    [
        ("<|im_start|>assistant\n<think>\n", True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        ("<think>old</think>answer<|im_start|>assistant\n<think>\n", True),
        ("<think>old</think>answer<|im_start|>assistant\n", False),
        ("<|im_start|>assistant\n", False),
    ],
)
def test_prompt_opens_reasoning(prompt: str, opens: bool) -> None:
    assert prompt_opens_reasoning(prompt, "<think>", "</think>") is opens


def test_prompt_opens_reasoning_with_gemma_markers() -> None:
    start, end = THINK_MARKERS["gemma4"]
    assert prompt_opens_reasoning(f"<|turn>model\n{start}", start, end)
    assert not prompt_opens_reasoning(f"<|turn>model\n{start}{end}", start, end)


# Token ids: 1-token markers (7 = <think>, 8 = </think>) and 3-token ones (70 71 72 / 80 81 82).
ONE = ([7], [8])
THREE = ([70, 71, 72], [80, 81, 82])


@pytest.mark.parametrize("markers", [ONE, THREE], ids=["1-token", "3-token"])
def test_repair_inserts_start_before_an_unmatched_end(markers: tuple[list[int], list[int]]) -> None:
    start, end = markers
    tokens = [1, 2, *end, 3]
    assert repair_unmatched_end(tokens, start, end) == [1, 2, *start, *end, 3]


@pytest.mark.parametrize("markers", [ONE, THREE], ids=["1-token", "3-token"])
def test_repair_leaves_matched_blocks_alone(markers: tuple[list[int], list[int]]) -> None:
    start, end = markers
    tokens = [1, *start, 2, *end, 3, *start, 4, *end]
    assert repair_unmatched_end(tokens, start, end) == tokens


@pytest.mark.parametrize("markers", [ONE, THREE], ids=["1-token", "3-token"])
def test_repair_fixes_each_unmatched_end_among_matched_ones(markers: tuple[list[int], list[int]]) -> None:
    start, end = markers
    tokens = [*start, 1, *end, 2, *end, 3, *end]
    expected = [*start, 1, *end, 2, *start, *end, 3, *start, *end]
    assert repair_unmatched_end(tokens, start, end) == expected


def test_repair_ignores_a_partial_multi_token_marker() -> None:
    start, end = THREE
    tokens = [80, 81, 5, 82, 80, 80, 81, 82]
    assert repair_unmatched_end(tokens, start, end) == [80, 81, 5, 82, 80, *start, 80, 81, 82]


def test_the_engine_repairs_an_answer_sent_back_with_only_its_end_marker(tmp_path):
    """Through the engine's real prompt encoding, with a Qwen3-family scripted tokenizer
    whose think markers are single tokens."""
    from mlx_lm.utils import load_tokenizer

    from exo.devtools.scripted_families import FAMILY_SCRIPTS
    from exo.devtools.scripted_models import make_scripted_model
    from exo.engine.mlx.chat_template import encode_prompt
    from exo.shared.types.common import ModelId
    from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams

    model_dir = make_scripted_model(tmp_path / "qwen3", "qwen3", FAMILY_SCRIPTS["qwen3"].script)
    tokenizer = load_tokenizer(model_dir)
    messages = [
        ChatMessage(role="user", content="hi"),
        ChatMessage(role="assistant", content="I should greet.</think>Hello!"),
        ChatMessage(role="user", content="again"),
    ]
    params = TextGenerationTaskParams(model=ModelId("m"), messages=messages)
    tokens, _ = encode_prompt(tokenizer, params, "qwen3", "post_last_user")
    start, end = (tokenizer.encode(m, add_special_tokens=False) for m in ("<think>", "</think>"))
    assert len(start) == 1 and len(end) == 1
    position = tokens.index(end[0])
    assert tokens[position - 1] == start[0]
