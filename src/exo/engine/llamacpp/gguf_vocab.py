"""A Hugging Face tokenizer written into a GGUF so llama.cpp loads its vocabulary.

exo tokenizes with the HF tokenizer itself and hands llama.cpp token ids, so what counts
is that llama.cpp accepts the vocabulary (its size equal to the embedding's rows, a known
pre-tokenizer name, merges for a BPE vocab), that special tokens are marked as control
tokens (llama.cpp renders them as text only when asked) and the chat template travels
with the weights. Byte-level BPE tokenizers (Llama 3, Qwen, GPT-2 style) are written as
llama.cpp's "gpt2" model; SentencePiece ones (tokenizer.model) and tokenizer.json BPE with
byte fallback (Llama 2 and Mistral's layout) as its "llama" model. Other kinds (Unigram
or WordPiece in a tokenizer.json alone) are refused before converting (vocab_refusal),
and their models run on MLX."""

import json
import re
from hashlib import sha256
from pathlib import Path

from gguf import GGUFWriter, SentencePieceVocab, SpecialVocab, TokenType
from tokenizers import Tokenizer

# llama.cpp picks its pre-tokenizer regex by name. Its converter names it by hashing the
# ids a tokenizer gives for this text; these are the hashes of the families exo converts
# (from llama.cpp's convert_hf_to_gguf.py). Any other byte-level tokenizer gets "default":
# the regex matters only to llama.cpp's own tokenizer, which exo does not use.
_CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 333 "
    "3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на "
    "Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not sure I'll make "
    "it, 'D you like some tea? We'Ve a'lL"
)
_PRE_TOKENIZERS = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
    "0fe1cf6eda062318a1af7270f3331a85c539a01778ff948e24388e949c5282f4": "gpt-2",
}

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def _pre_tokenizer(tokenizer: Tokenizer) -> str:
    ids = tokenizer.encode(_CHECK_TEXT).ids
    return _PRE_TOKENIZERS.get(sha256(str(ids).encode()).hexdigest(), "default")


def _is_byte_level(spec: dict) -> bool:
    def has_byte_level(part: dict | None) -> bool:
        if not part:
            return False
        if part.get("type") == "ByteLevel":
            return True
        return any(has_byte_level(p) for p in part.get("pretokenizers", []) + part.get("decoders", []))

    return spec.get("model", {}).get("type") == "BPE" and (
        has_byte_level(spec.get("pre_tokenizer")) or has_byte_level(spec.get("decoder"))
    )


def _is_byte_fallback_bpe(spec: dict) -> bool:
    model = spec.get("model", {})
    return model.get("type") == "BPE" and bool(model.get("byte_fallback"))


def _tokenizer_spec(model_dir: Path) -> dict:
    path = model_dir / "tokenizer.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def vocab_refusal(model_dir: Path) -> str | None:
    """Why the converter cannot write the tokenizer of `model_dir` as a vocab llama.cpp
    loads, if it cannot."""
    spec = _tokenizer_spec(model_dir)
    if (spec and (_is_byte_level(spec) or _is_byte_fallback_bpe(spec))) or (model_dir / "tokenizer.model").is_file():
        return None
    if not spec:
        return "no tokenizer.json or tokenizer.model to convert"
    kind = spec.get("model", {}).get("type", "unknown")
    return (
        f"its tokenizer.json is {kind}; the GGUF converter writes byte-level BPE, BPE with byte fallback "
        "and SentencePiece (tokenizer.model) vocabularies"
    )


def _tokens(spec: dict, kinds: dict[int, TokenType], vocab_size: int) -> tuple[list[str], list[TokenType]]:
    """Every id's text and llama.cpp token type (`kinds`' where it names one), the added
    tokens included, padded to the embedding's rows."""
    texts: dict[int, str] = {i: t for t, i in spec["model"]["vocab"].items()}
    for added in spec.get("added_tokens", []):
        texts[added["id"]] = added["content"]
        kinds[added["id"]] = TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED
    if max(texts) >= vocab_size:
        raise ValueError(f"the tokenizer has id {max(texts)}, past the model's vocab_size {vocab_size}")
    tokens = [texts.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [kinds.get(i, TokenType.NORMAL) if i in texts else TokenType.UNUSED for i in range(vocab_size)]
    return tokens, types


def _added_token_kinds(model_dir: Path) -> dict[int, TokenType]:
    """The tokens transformers keeps whole (tokenizer.json's added tokens, or an older
    tokenizer_config.json's added_tokens_decoder): control tokens if special, else user
    defined, so llama.cpp keeps them whole too (as llama.cpp's converter marks them)."""
    added = _tokenizer_spec(model_dir).get("added_tokens", [])
    config_path = model_dir / "tokenizer_config.json"
    if not added and config_path.is_file():
        decoder = json.loads(config_path.read_text()).get("added_tokens_decoder", {})
        added = [{"id": int(i), **token} for i, token in decoder.items()]
    return {t["id"]: TokenType.CONTROL if t.get("special") else TokenType.USER_DEFINED for t in added}


def _write_sentencepiece(writer: GGUFWriter, model_dir: Path, vocab_size: int) -> None:
    vocab = SentencePieceVocab(model_dir)
    added = _added_token_kinds(model_dir)
    tokens, scores, types = [], [], []
    for i, (text, score, kind) in enumerate(vocab.all_tokens()):
        tokens.append(text)
        scores.append(score)
        # Unknown and byte tokens keep their kind; gguf types user-defined pieces normal.
        types.append(added.get(i, kind) if kind == TokenType.NORMAL else kind)
    for i in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{i}]".encode())
        scores.append(-1000.0)
        types.append(TokenType.UNUSED)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens[:vocab_size])
    writer.add_token_scores(scores[:vocab_size])
    writer.add_token_types(types[:vocab_size])


def _byte_fallback_tokens(spec: dict, vocab_size: int) -> tuple[list[str], list[float], list[TokenType]]:
    """A BPE-with-byte-fallback vocab as SentencePiece's: llama.cpp's "llama" tokenizer
    merges the adjacent pair of highest score, so a merged token's score is minus its
    merge's rank and BPE's order is kept; <0xXX> tokens are bytes."""
    vocab: dict[str, int] = spec["model"]["vocab"]
    scores = {i: 0.0 for i in vocab.values()}
    for rank, merge in enumerate(spec["model"].get("merges", [])):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        if (i := vocab.get(left + right)) is not None and scores[i] == 0.0:
            scores[i] = -float(rank + 1)
    unk = spec["model"].get("unk_token")
    kinds = {i: TokenType.BYTE for t, i in vocab.items() if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", t)}
    if unk in vocab:
        kinds[vocab[unk]] = TokenType.UNKNOWN
    tokens, types = _tokens(spec, kinds, vocab_size)
    return tokens, [scores.get(i, -1000.0) for i in range(vocab_size)], types


def write_vocab(writer: GGUFWriter, model_dir: Path, vocab_size: int) -> None:
    """The tokenizer's tokens, merges, special ids and chat template, as GGUF keys."""
    path = model_dir / "tokenizer.json"
    spec = _tokenizer_spec(model_dir)
    if (reason := vocab_refusal(model_dir)) is not None:
        raise ValueError(f"{model_dir.name}: {reason}")
    if spec and _is_byte_level(spec):
        tokens, types = _tokens(spec, {}, vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(_pre_tokenizer(Tokenizer.from_file(str(path))))
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        special = SpecialVocab(model_dir, load_merges=True, n_vocab=vocab_size)
    elif (model_dir / "tokenizer.model").is_file():
        _write_sentencepiece(writer, model_dir, vocab_size)
        special = SpecialVocab(model_dir, load_merges=False, n_vocab=vocab_size)
    else:
        tokens, scores, types = _byte_fallback_tokens(spec, vocab_size)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        special = SpecialVocab(model_dir, load_merges=False, n_vocab=vocab_size)
    special.add_to_gguf(writer, quiet=True)
