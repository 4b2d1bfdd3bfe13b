"""Gemma's turn end and tool-response marker stop generation even though its config
names only <eos>; in a vocabulary where those ids are ordinary tokens nothing changes."""

import json

from mlx_lm.tokenizer_utils import load as load_tokenizer
from tokenizers import Tokenizer, models, pre_tokenizers

from exo.engine.mlx.loading import add_family_eos_ids


def _write_tokenizer(path, special_ids: set[int]) -> None:
    names = [f"<special_{i}>" if i in special_ids else f"w{i}" for i in range(128)]
    tokenizer = Tokenizer(models.WordLevel({name: i for i, name in enumerate(names)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([names[i] for i in sorted(special_ids)])
    path.mkdir()
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": names[1] if 1 in special_ids else "w1"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def test_gemma_turn_end_and_tool_response_end_generation(tmp_path):
    _write_tokenizer(tmp_path / "gemma", {1, 50, 106})
    tokenizer = load_tokenizer(tmp_path / "gemma", eos_token_ids=[1])
    add_family_eos_ids(tokenizer, "gemma4")
    assert tokenizer.eos_token_ids == {1, 50, 106}


def test_ordinary_tokens_with_those_ids_are_left_alone(tmp_path):
    _write_tokenizer(tmp_path / "tiny", {1})
    tokenizer = load_tokenizer(tmp_path / "tiny", eos_token_ids=[1])
    add_family_eos_ids(tokenizer, "gemma4_text")
    assert tokenizer.eos_token_ids == {1}
    add_family_eos_ids(tokenizer, "llama")
    assert tokenizer.eos_token_ids == {1}
