"""The llama.cpp engine's streaming detokenizer, on the two ways a Hugging Face tokenizer
spells bytes: byte-level BPE (exo's tiny tokenizer; an incomplete character decodes to one
replacement character) and SentencePiece's byte fallback (one per byte). Random token
runs mix words, multi-byte characters split over tokens and bytes that are no character.
What streams is always the start of the whole answer's text, ends as exactly that text,
and runs at most 3 characters behind the tokens decoded so far."""

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models

from exo.devtools.tiny_models import write_tokenizer
from exo.engine.detokenizer import StreamingDetokenizer

CHARACTERS = "é€😀 ü字"
INVALID = [0x80, 0xBF, 0xE2, 0xF0, 0xFF]
# Byte fallback turns a whole run of byte tokens into replacement characters when any of
# it is invalid, so a run must hold no character at all: no byte here can start one.
NEVER_VALID = [0x80, 0xBF, 0xC0, 0xFF]


def _byte_level(tmp_path: Path) -> tuple[Tokenizer, dict[int, int]]:
    write_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    # GPT-2's printable stand-ins for the 256 bytes, each a token of the tiny vocab.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    stand_in = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return tokenizer, {b: tokenizer.token_to_id(stand_in[b]) for b in range(256)}


def _byte_fallback() -> tuple[Tokenizer, dict[int, int]]:
    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"▁the": 256, "▁cat": 257, "s": 258, "▁": 259}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tokenizer, {b: b for b in range(256)}


def _random_tokens(
    rng: random.Random, byte_ids: dict[int, int], words: list[int], count: int, byte_fallback: bool
) -> list[int]:
    invalid = NEVER_VALID if byte_fallback else INVALID
    tokens: list[int] = []
    while len(tokens) < count:
        pick = rng.random()
        if pick < 0.4:
            tokens += [byte_ids[b] for b in rng.choice(CHARACTERS).encode()]
        elif pick < 0.7:
            tokens += [byte_ids[rng.choice(invalid)] for _ in range(rng.randint(1, 9))]
        else:
            tokens.append(rng.choice(words))
            continue
        if byte_fallback:
            tokens.append(rng.choice(words))
    return tokens


@pytest.mark.parametrize("spelling", ["byte_level", "byte_fallback"])
def test_streamed_text_is_the_answers_start_and_at_most_3_characters_behind(spelling, tmp_path):
    if spelling == "byte_level":
        tokenizer, byte_ids = _byte_level(tmp_path)
        words = [tokenizer.token_to_id(w) for w in ("the", "Ġcat", "Ġruns") if tokenizer.token_to_id(w) is not None]
    else:
        tokenizer, byte_ids = _byte_fallback()
        words = [256, 257, 258, 259]
    assert words
    rng = random.Random(0)
    for _ in range(40):
        # Byte fallback decodes a run of byte tokens as a whole: a character followed by
        # bytes that are none turns into replacement characters too, so no stream could
        # be the start of the whole text; a word ends each run there.
        tokens = _random_tokens(rng, byte_ids, words, 60, byte_fallback=spelling == "byte_fallback")
        whole = tokenizer.decode(tokens, skip_special_tokens=False)
        detokenizer = StreamingDetokenizer(tokenizer)
        streamed = ""
        for index, token in enumerate(tokens):
            detokenizer.add_token(token)
            streamed += detokenizer.last_segment
            assert whole.startswith(streamed), (tokens[: index + 1], streamed)
            so_far = tokenizer.decode(tokens[: index + 1], skip_special_tokens=False)
            assert len(so_far) - len(streamed) <= 3, (tokens[: index + 1], so_far, streamed)
        detokenizer.finalize()
        assert streamed + detokenizer.last_segment == whole


def test_a_run_of_invalid_bytes_streams_as_it_comes(tmp_path):
    """A random model's 50 bytes that are no character: the old detokenizer held them all
    until the first valid character; now each is out 3 tokens later at most."""
    tokenizer, byte_ids = _byte_level(tmp_path)
    detokenizer = StreamingDetokenizer(tokenizer)
    streamed = ""
    for index in range(50):
        detokenizer.add_token(byte_ids[0x80])
        streamed += detokenizer.last_segment
        assert len(streamed) >= index + 1 - 3
    detokenizer.add_token(byte_ids[ord("y")])
    assert streamed + detokenizer.last_segment == "\ufffd" * 50 + "y"
