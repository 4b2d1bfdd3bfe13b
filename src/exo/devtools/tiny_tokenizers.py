"""Tokenizers of the kinds people publish, trained on tiny_models' sentences with the
`tokenizers` library, for checking what each engine does with them: byte-level BPE
without merges (valid for transformers and MLX, refused by llama.cpp's loader),
SentencePiece-style Unigram, BERT's WordPiece, and Llama 2's BPE with byte fallback.
Each keeps tiny_models' special tokens first, so its chat template and ids 0-5 match."""

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from exo.devtools.tiny_models import SPECIAL_TOKENS, _training_sentences, write_tokenizer

KINDS = ("bpe-no-merges", "unigram", "wordpiece", "bpe-byte-fallback")
_BYTES = [f"<0x{i:02X}>" for i in range(256)]


def _unigram() -> Tokenizer:
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=200, special_tokens=SPECIAL_TOKENS + ["<unk>"], unk_token="<unk>")
    tokenizer.train_from_iterator(_training_sentences(), trainer)
    return tokenizer


def _wordpiece() -> Tokenizer:
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=SPECIAL_TOKENS + ["[UNK]"])
    tokenizer.train_from_iterator(_training_sentences(), trainer)
    return tokenizer


def _byte_fallback_bpe() -> dict:
    """Llama 2's layout: spaces as ▁ with one prepended, no pre-tokenizer, <0xXX> byte
    tokens in the vocab for what it cannot spell."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL_TOKENS + ["<unk>", *_BYTES])
    tokenizer.train_from_iterator(_training_sentences(), trainer)
    spec = json.loads(tokenizer.to_str())
    # The byte tokens are the vocab's own, as in Llama 2, not added tokens matched in text.
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in _BYTES]
    return spec


def write_tokenizer_of_kind(path: Path, kind: str) -> None:
    """tokenizer.json (and tiny_models' tokenizer_config.json) of `kind` at `path`."""
    write_tokenizer(path)
    if kind == "bpe-no-merges":
        spec = json.loads((path / "tokenizer.json").read_text())
        spec["model"]["merges"] = []
    elif kind == "unigram":
        spec = json.loads(_unigram().to_str())
    elif kind == "wordpiece":
        spec = json.loads(_wordpiece().to_str())
    elif kind == "bpe-byte-fallback":
        spec = _byte_fallback_bpe()
    else:
        raise ValueError(f"no tokenizer kind {kind!r}; kinds: {', '.join(KINDS)}")
    (path / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
