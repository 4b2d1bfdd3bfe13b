"""The API tells a model's think markers from its vocabulary by the rules mlx-lm's
TokenizerWrapper uses in the engine (`vocabulary_think_markers` against mlx-lm's own
`_infer_thinking`), so what Ollama's `show` and the prompt count say about thinking is
what the engine does."""

import pytest
from mlx_lm.tokenizer_utils import _infer_thinking

from exo.engine.parsing.output import vocabulary_think_markers

VOCABULARIES = {
    "plain": ["a", "b", "<|end|>"],
    "think": ["a", "<think>", "</think>"],
    "start only": ["a", "<think>"],
    "longcat": ["<longcat_think>", "</longcat_think>"],
    "think tokens": ["<|think:start|>", "<|think:end|>"],
    "think before longcat": ["<longcat_think>", "</longcat_think>", "<think>", "</think>"],
    "gemma 4 channel": ["<|channel>", "<channel|>", "thought"],
    "xtml": ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "think"],
    "xtml incomplete": ["<|open|>", "<|close|>", "<|sep|>"],
}


class _Vocabulary:
    """What `_infer_thinking` reads of a tokenizer: its vocabulary, and encode for the
    token ids of multi-token markers (not compared here)."""

    def __init__(self, tokens: list[str]) -> None:
        self.vocab = {token: i for i, token in enumerate(tokens)}

    def get_vocab(self) -> dict[str, int]:
        return self.vocab

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return []


@pytest.mark.parametrize("name", VOCABULARIES)
def test_vocabulary_think_markers_are_mlx_lm_s(name: str) -> None:
    tokens = VOCABULARIES[name]
    start, end, _, _ = _infer_thinking(_Vocabulary(tokens))
    expected = (start, end) if start is not None and end is not None else None
    assert vocabulary_think_markers(set(tokens)) == expected
