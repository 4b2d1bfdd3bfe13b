"""Tiny models whose weights script their output: under greedy decoding each one writes a
known text, so tests can check exact outputs through chat templates, reasoning and
tool-call parsers and the API adapters, on one node or split over several.

How the weights do it: every block's output projections (attention's o_proj, the MLP's
and the experts' down_proj, DeepSeek V4's wo_b, Gemma 4's per-layer projection) are zero,
so each block adds nothing and the hidden state before the final norm is the token's own
embedding (times a positive scalar, where the architecture scales or mixes residual
streams). The tokens of the script get one-hot embeddings, and lm_head's row for each
token's successor points along its predecessor's direction, so the next token depends on
the current one alone:

    last prompt token -> script[0] -> script[1] -> ... -> script[-1] -> EOS

The last prompt token is the one the family's generation prompt ends with ("\\n" after
"<|im_start|>assistant", "<think>" for GLM 4.7 and DeepSeek, ...). Each script piece is one
token: a piece equal to one of the family's marker tokens ("<think>", "<tool_call>", ...)
uses that added token, any other piece gets a vocabulary entry of its own (which the BPE
never produces when encoding, so prompts tokenize as they would without the script). Since
a token has one successor, a script must not repeat a piece; to write the same text twice,
split it differently the second time ("<|channel|>" once whole, later "<|chan" + "nel|>").

Prompts are rendered as the engine renders a request that does not say whether to think:
in the template's own default mode (thinking on for Qwen3 and GLM, off for Gemma 4); a
mode whose generation prompt ends in another token (GLM's or DeepSeek's chat mode, which
end in "</think>") does not start the script.

A second script, for tool round trips: since the last prompt token picks the script, a
model can hold two scripts that start from two different tokens. A family with a
`tool_result_prompt_end` token (Qwen3) has a test template that appends that control
token to the generation prompt when the conversation's last message is a tool result, so

    ...<|im_start|>assistant\n                      -> the first script (e.g. a tool call)
    ...</tool_response><|im_end|>\n<|im_start|>assistant\n<|after_tool|>
                                                    -> the `after_tool_result` script

No piece may appear in both scripts (a token has one successor). The families and their
scripts are in scripted_families.py: FAMILY_SCRIPTS[family] and
AFTER_TOOL_RESULT_SCRIPTS[family] make a full round trip: thinking and a get_weather
call for Paris, then, given the tool's result, thinking and the final answer."""

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import _get_classes, load_tokenizer
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

import exo.engine.mlx.models  # noqa: F401  (registers DeepSeek V4 with mlx-lm)
from exo.devtools.scripted_families import (
    FAMILIES,
    GET_WEATHER_TOOL,
    SAMPLE_MESSAGES,
    SAMPLE_TOOL_RESULT_MESSAGES,
    Family,
)
from exo.devtools.tiny_models import _random_weights, _set_vocab_size, _training_sentences
from exo.engine.mlx.chat_template import template_renderer

# Parameters that write a block's result into the residual stream, by their module name
# in mlx-lm's model classes (and ours for DeepSeek V4). Zeroed, they make the block the
# identity on the stream.
OUTPUT_PROJECTIONS = ("o_proj", "down_proj", "out_proj", "wo_b", "per_layer_projection")
# lm_head's weight from a script token's direction to its successor: far above the zero
# logit every other token gets, and still clear of Gemma's softcap of 30.
LOGIT_SCALE = 8.0


def render_prompt(
    tokenizer: TokenizerWrapper,
    family: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    enable_thinking: bool | None = None,
) -> str:
    """The prompt exo gives a model of `family`: the chat template with the generation
    prompt, or for DeepSeek V3.2 and V4 the Python encoders."""
    if family in ("deepseek_v32", "deepseek_v4"):
        from exo.engine.encoding import deepseek_v4, deepseek_v32
        from exo.shared.types.text_generation import ChatMessage

        encoder = deepseek_v4 if family == "deepseek_v4" else deepseek_v32
        chat = [ChatMessage(**message) for message in messages]
        return encoder.encode_messages(chat, tools, thinking=enable_thinking is not False)
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    renderer = template_renderer(tokenizer, enable_thinking)
    return renderer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False, **extra)


def make_scripted_model(
    path: Path,
    family: str,
    script: list[str] | tuple[str, ...],
    seed: int = 0,
    dtype: mx.Dtype = mx.float32,
    after_tool_result: list[str] | tuple[str, ...] | None = None,
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    """Writes at `path` a model of `family` (a FAMILIES key) that, given any prompt the
    family's template renders with its generation prompt, writes the pieces of `script`
    one token each and then its EOS token under greedy decoding. With `after_tool_result`
    (families with a tool_result_prompt_end only), a prompt whose last message is a tool
    result gets that script instead. Returns `path`.

    float32 by default: MLX on CPU runs the MoE families' expert matmuls in float32 only.
    `config_overrides` change the family's tiny config (a wider model for a long script,
    or one sized for a benchmark)."""
    path = Path(path)
    spec = FAMILIES[family]
    if config_overrides:
        spec = replace(spec, config={**spec.config, **config_overrides})
    scripts = [list(script), *([list(after_tool_result)] if after_tool_result is not None else [])]
    if after_tool_result is not None and spec.tool_result_prompt_end is None:
        raise ValueError(f"{family}'s template has no prompt end of its own after a tool result")
    _check_script(spec, scripts)
    piece_ids = _write_tokenizer(path, spec, [piece for pieces in scripts for piece in pieces])
    tokenizer = load_tokenizer(path)
    starts = [_prompt_end_token(tokenizer, family)]
    if after_tool_result is not None:
        starts.append(_tool_result_prompt_end_token(tokenizer, family))
    for start in starts:
        if start in piece_ids:
            raise ValueError(f"the prompt's last token {tokenizer.decode([start])!r} is also a script piece")
    eos = tokenizer.convert_tokens_to_ids(spec.eos)
    chains, offset = [], 0
    for start, pieces in zip(starts, scripts, strict=True):
        chains.append([start, *piece_ids[offset : offset + len(pieces)], eos])
        offset += len(pieces)
    _write_model(path, spec, chains, len(tokenizer.vocab), tokenizer, seed, dtype)
    return path


def _check_script(spec: Family, scripts: list[list[str]]) -> None:
    if any(not script for script in scripts):
        raise ValueError("a script needs at least one piece")
    pieces = [piece for script in scripts for piece in script]
    if any(not piece for piece in pieces):
        raise ValueError("script pieces must not be empty")
    repeated = sorted({piece for piece in pieces if pieces.count(piece) > 1})
    if repeated:
        raise ValueError(
            f"script pieces must not repeat (each token has one successor): {repeated}; split repeated text differently"
        )
    reserved = [piece for piece in pieces if piece in spec.control_tokens or piece in spec.stop_tokens]
    if reserved:
        raise ValueError(f"control and end-of-generation tokens cannot be script pieces: {reserved}")
    hidden = _text_config(spec.config)["hidden_size"]
    if len(pieces) + len(scripts) > hidden:
        raise ValueError(f"scripts of {len(pieces)} pieces need more than the model's {hidden} dimensions")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


def _write_tokenizer(path: Path, spec: Family, script: list[str], pad_to_multiple_of: int = 64) -> list[int]:
    """A byte-level BPE tokenizer with the family's special tokens, and one token for
    every script piece. Returns the pieces' token ids."""
    special = list(dict.fromkeys([*([spec.bos] if spec.bos else []), *spec.control_tokens, *spec.stop_tokens]))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(_training_sentences(), trainer)

    # Pieces that are not marker tokens become vocabulary entries with no merge leading to
    # them: decoding gives their text, encoding a prompt never produces them.
    data = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    to_unicode = _bytes_to_unicode()
    for piece in script:
        if piece not in spec.marker_tokens:
            vocab.setdefault("".join(to_unicode[byte] for byte in piece.encode()), len(vocab))
    tokenizer = Tokenizer.from_str(json.dumps(data))
    tokenizer.add_tokens([AddedToken(marker, special=False, normalized=False) for marker in spec.marker_tokens])
    missing = -tokenizer.get_vocab_size() % pad_to_multiple_of
    tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])

    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec.bos,
        "eos_token": spec.eos,
        "pad_token": spec.eos,
        "model_max_length": 4096,
    }
    if spec.chat_template is not None:
        config["chat_template"] = spec.chat_template.strip()
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))

    ids = []
    for piece in script:
        token = piece if piece in spec.marker_tokens else "".join(to_unicode[byte] for byte in piece.encode())
        ids.append(tokenizer.token_to_id(token))
        if tokenizer.decode([ids[-1]], skip_special_tokens=False) != piece:
            raise ValueError(f"script piece {piece!r} does not decode to itself")
    return ids


def _prompt_end_token(tokenizer: TokenizerWrapper, family: str) -> int:
    """The token the family's generation prompt ends with, the same with tools or without."""
    ends = {
        tokenizer.encode(render_prompt(tokenizer, family, SAMPLE_MESSAGES, tools), add_special_tokens=False)[-1]
        for tools in (None, [GET_WEATHER_TOOL])
    }
    if len(ends) != 1:
        raise ValueError(f"{family}'s generation prompt ends in different tokens with tools and without")
    return ends.pop()


def _tool_result_prompt_end_token(tokenizer: TokenizerWrapper, family: str) -> int:
    """The token the generation prompt ends with after a tool result: the family's
    tool_result_prompt_end, checked against what its template renders."""
    spec = FAMILIES[family]
    assert spec.tool_result_prompt_end is not None
    end = tokenizer.encode(
        render_prompt(tokenizer, family, SAMPLE_TOOL_RESULT_MESSAGES, [GET_WEATHER_TOOL]), add_special_tokens=False
    )[-1]
    if end != tokenizer.convert_tokens_to_ids(spec.tool_result_prompt_end):
        raise ValueError(f"{family}'s template does not end the prompt after a tool result in its own token")
    return end


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def _write_model(
    path: Path,
    spec: Family,
    chains: list[list[int]],
    vocab_size: int,
    tokenizer: TokenizerWrapper,
    seed: int,
    dtype: mx.Dtype,
) -> None:
    config = copy.deepcopy(spec.config)
    config["model_type"] = spec.model_type
    _set_vocab_size(config, vocab_size)
    stop_ids = [tokenizer.convert_tokens_to_ids(token) for token in spec.stop_tokens]
    bos_id = tokenizer.convert_tokens_to_ids(spec.bos) if spec.bos else None
    for section in [config, *([config["text_config"]] if "text_config" in config else [])]:
        # lm_head must be free of the embeddings to map each token to its successor.
        section["tie_word_embeddings"] = False
        section["eos_token_id"] = stop_ids
        section["bos_token_id"] = bos_id
        section["torch_dtype"] = "float32" if dtype == mx.float32 else "bfloat16"

    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(copy.deepcopy(config)))
    model.set_dtype(dtype)
    weights = _random_weights(model, seed, perturb_constants=False)
    for name, value in weights.items():
        if any(f".{projection}." in name for projection in OUTPUT_PROJECTIONS):
            weights[name] = mx.zeros_like(value)

    [embed_name] = [name for name in weights if name.endswith(".embed_tokens.weight")]
    [head_name] = [name for name in weights if name.endswith("lm_head.weight")]
    embedding = np.array(weights[embed_name].astype(mx.float32))
    head = np.zeros(weights[head_name].shape, dtype=np.float32)
    edges = [edge for chain in chains for edge in zip(chain, chain[1:], strict=False)]
    for direction, (token, successor) in enumerate(edges):
        embedding[token] = 0.0
        embedding[token, direction] = 1.0
        head[successor, direction] = LOGIT_SCALE
    weights[embed_name] = mx.array(embedding).astype(dtype)
    weights[head_name] = mx.array(head).astype(dtype)
    model.update(tree_unflatten(list(weights.items())))
    for chain in chains:
        _check_successors(model, chain)

    mx.save_safetensors(
        str(path / "model.safetensors"), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"}
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))


def _check_successors(model, chain: list[int]) -> None:
    """Every token of the chain, read in one sequence, predicts the next, and no other
    token gets any logit: the hidden state before the final norm has no part along another
    chain token's direction, so the blocks added nothing, whatever attention saw."""
    logits = model(mx.array([chain[:-1]]))[0].astype(mx.float32)
    predicted = mx.argmax(logits, axis=-1).tolist()
    if predicted != chain[1:]:
        raise AssertionError(f"the scripted weights predict {predicted}, not {chain[1:]}")
    successors = mx.array(chain[1:])[:, None] == mx.arange(logits.shape[-1])[None, :]
    leak = mx.max(mx.abs(mx.where(successors, 0.0, logits))).item()
    if leak != 0.0:
        raise AssertionError(f"the blocks are not the identity: other tokens get logits up to {leak}")


def make_copy_model(
    path: Path, length: int, family: str = "qwen3", config_overrides: dict[str, Any] | None = None
) -> list[int]:
    """A scripted model whose answer is a `length`-token text that its prompt holds: the
    best case of speculation by prompt lookup (an edited file written back), with every
    proposal right. Writes the model at `path`, at least `length` + 1 wide (a script
    token's embedding is one-hot); returns the prompt's token ids (the text, then the
    token the family's generation prompt ends with, which starts the script)."""
    pieces = [f" w{i}" for i in range(length)]
    overrides = dict(config_overrides or {})
    overrides.setdefault(
        "hidden_size", max(_text_config(FAMILIES[family].config)["hidden_size"], -(-(length + 1) // 64) * 64)
    )
    make_scripted_model(path, family, pieces, config_overrides=overrides)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    to_unicode = _bytes_to_unicode()
    ids = [tokenizer.token_to_id("".join(to_unicode[byte] for byte in piece.encode())) for piece in pieces]
    if any(token is None for token in ids):
        raise ValueError("a script piece has no token of its own")
    return [*(token for token in ids if token is not None), _prompt_end_token(load_tokenizer(path), family)]
