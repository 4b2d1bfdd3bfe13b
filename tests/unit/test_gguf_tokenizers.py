"""The GGUF converter over the tokenizer kinds people publish (issue 33 point 4): each
either converts to a vocab llama.cpp loads, whose own tokenizer gives transformers' ids
for the same strings, or is refused before converting with a reason (then its model runs
on MLX). A byte-level BPE without merges converts, and llama.cpp's loader refuses it with
its own error, which the runner records.

exo feeds llama.cpp transformers' ids, so what serving needs is a vocab that lines up id
for id with transformers' (checked for every id). llama.cpp's own tokenizer is checked too.
Measured: byte-level BPE (the tiny models' own) and BPE with byte fallback (Llama 2's
tokenizer.json, written as llama.cpp's "llama" vocab with each merged token scored by its
merge's rank) give transformers' ids on all four strings; SentencePiece tokenizer.model,
Unigram and BPE, on the plain strings, not on text that starts with spaces or follows a
special token: there llama.cpp adds sentencepiece's dummy "▁" (after every special token
too) and transformers' Metaspace does not, the tokenizers' own difference (sentencepiece
itself agrees with llama.cpp on the leading spaces). Unigram and WordPiece in a
tokenizer.json alone are refused up front."""

import shutil
from pathlib import Path

import llama_cpp
import pytest
from gguf import GGUFReader, TokenType
from transformers import AutoTokenizer

from exo.devtools.tiny_models import SPECIAL_TOKENS, make_tiny_llama
from exo.devtools.tiny_tokenizers import write_tokenizer_of_kind
from exo.engine.llamacpp.gguf_convert import convert
from exo.engine.llamacpp.native import Model
from exo.engine.llamacpp.support import LlamaCppRefused, dir_refusal

# Plain text: words, a newline, accents, an emoji (bytes for byte fallback).
PLAIN = ["the cat runs over the moon", "Ünïcödé 🦙 3.14 x@y", "the node sleeps\nunder a  quiet sun"]
# Where SentencePiece-style tokenizers differ among themselves (see above).
EDGES = ["  two  spaces\nand a newline", "<|user|>hi<|end|>"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tokenizers") / "llama")


def with_tokenizer(tiny_llama: Path, tmp_path: Path, kind: str | None) -> Path:
    model_dir = tmp_path / (kind or "byte-level-bpe")
    shutil.copytree(tiny_llama, model_dir)
    if kind is not None:
        write_tokenizer_of_kind(model_dir, kind)
    return model_dir


@pytest.mark.parametrize(
    ("kind", "texts"),
    [
        (None, PLAIN + EDGES),
        ("bpe-byte-fallback", PLAIN + EDGES),
        ("sentencepiece-unigram", PLAIN),
        ("sentencepiece-bpe", PLAIN),
    ],
)
def test_a_converted_vocab_lines_up_with_transformers(
    kind: str | None, texts: list[str], tiny_llama: Path, tmp_path: Path
) -> None:
    model_dir = with_tokenizer(tiny_llama, tmp_path, kind)
    assert dir_refusal(model_dir) is None
    convert(model_dir, tmp_path / "model.gguf")
    hf = AutoTokenizer.from_pretrained(model_dir)
    fields = GGUFReader(tmp_path / "model.gguf").fields
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    pieces = [bytes(tokens.parts[i]).decode() for i in tokens.data]
    assert pieces[: len(hf)] == hf.convert_ids_to_tokens(list(range(len(hf))))
    # The chat's tokens (ids 0-5) are control or user-defined ones: llama.cpp keeps them whole.
    whole = {TokenType.CONTROL, TokenType.USER_DEFINED}
    assert all(int(types.parts[i][0]) in whole for i in types.data[: len(SPECIAL_TOKENS)])
    llama = llama_cpp.Llama(str(tmp_path / "model.gguf"), vocab_only=True, verbose=False)
    for text in texts:
        ids = hf.encode(text, add_special_tokens=False)
        assert llama.tokenize(text.encode(), add_bos=False, special=True) == ids, text


@pytest.mark.parametrize("kind", ["unigram", "wordpiece"])
def test_a_vocab_the_converter_cannot_write_is_refused_before_converting(
    kind: str, tiny_llama: Path, tmp_path: Path
) -> None:
    model_dir = with_tokenizer(tiny_llama, tmp_path, kind)
    AutoTokenizer.from_pretrained(model_dir).encode(PLAIN[0])  # transformers (and so MLX) takes it
    reason = dir_refusal(model_dir)
    name = {"unigram": "Unigram", "wordpiece": "WordPiece"}[kind]
    assert reason is not None and f"its tokenizer.json is {name}" in reason
    with pytest.raises(ValueError, match=name):
        convert(model_dir, tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()


def test_bpe_without_merges_converts_and_llamacpp_refuses_it_with_its_own_error(
    tiny_llama: Path, tmp_path: Path
) -> None:
    model_dir = with_tokenizer(tiny_llama, tmp_path, "bpe-no-merges")
    assert dir_refusal(model_dir) is None
    convert(model_dir, tmp_path / "model.gguf")
    with pytest.raises(LlamaCppRefused, match="cannot find tokenizer merges in model file"):
        Model(tmp_path / "model.gguf")
