"""Tokenizers of the kinds people publish, trained on tiny_models' sentences, for checking
what each engine does with them. With the `tokenizers` library, a tokenizer.json alone:
byte-level BPE without merges (valid for transformers and MLX, refused by llama.cpp's
loader), Unigram, BERT's WordPiece, and Llama 2's BPE with byte fallback. With
`sentencepiece`, a tokenizer.model (Unigram or BPE, byte fallback, text as written) and
the tokenizer.json and tokenizer_config.json transformers saves beside it. Each keeps
tiny_models' special tokens first, so its chat template and ids 0-5 match."""

import io
import json
from pathlib import Path

import sentencepiece
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer

from exo.devtools.tiny_models import SPECIAL_TOKENS, _training_sentences, write_tokenizer

KINDS = ("bpe-no-merges", "unigram", "wordpiece", "bpe-byte-fallback", "sentencepiece-unigram", "sentencepiece-bpe")
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


def _write_sentencepiece(path: Path, model_type: str) -> None:
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_training_sentences()),
        model_writer=model,
        model_type=model_type,
        vocab_size=320,
        hard_vocab_limit=False,
        byte_fallback=True,
        # As Llama 2's: text as written (llama.cpp's tokenizer normalizes nothing).
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        user_defined_symbols=SPECIAL_TOKENS,
        unk_id=len(SPECIAL_TOKENS),
        bos_id=-1,
        eos_id=-1,
        pad_id=-1,
        minloglevel=2,
    )
    (path / "tokenizer.json").unlink(missing_ok=True)
    (path / "tokenizer.model").write_bytes(model.getvalue())
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="LlamaTokenizer", unk_token="<unk>", add_bos_token=False, legacy=False)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    # transformers converts the model, and saves what a published repo holds beside it.
    AutoTokenizer.from_pretrained(path).save_pretrained(path)


def write_tokenizer_of_kind(path: Path, kind: str) -> None:
    """The tokenizer files of `kind` at `path` (tiny_models' tokenizer_config.json with
    a tokenizer.json of that kind, or a SentencePiece model as transformers saves it)."""
    write_tokenizer(path)
    if kind.startswith("sentencepiece-"):
        _write_sentencepiece(path, kind.removeprefix("sentencepiece-"))
        return
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
