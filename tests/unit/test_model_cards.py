"""Model cards: the built-in TOML cards carry the seeds' values, local model dirs appear
as cards without any network call, and the catalog serves them from memory."""

import asyncio
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from exo.catalog import cards as catalog_cards
from exo.catalog import catalog
from exo.catalog.cards import builtin_cards, card_from_model_dir, kv_sharing_tail_start
from exo.catalog.catalog import Catalog, all_cards, local_cards
from exo.catalog.model_dirs import find_local_model_dir, is_complete_model_dir, models_dirs, read_only_models_dirs
from exo.shared.models.model_cards import ModelCard, ModelTask, ReasoningDialect, StorageSize
from exo.shared.types.common import ModelId

# (n_layers, hidden_size, num_key_value_heads, context_length), from the Gemma 4 seed.
GEMMA_4 = {
    "26b-a4b-it": (30, 2816, 8, 262144),
    "31b-it": (60, 5376, 16, 262144),
    "e2b-it": (35, 1536, 1, 131072),
    "e4b-it": (42, 2560, 2, 131072),
}
GEMMA_4_QUANTIZATIONS = ["4bit", "6bit", "8bit", "bf16"]

# The reasoning_dialect the DeepSeek V4 seed gives each card it touches.
SEED_REASONING_DIALECTS = {
    "DeepSeek-V3.1-4bit": "post_last_user",
    "DeepSeek-V3.1-8bit": "post_last_user",
    "DeepSeek-V3.2-4bit": "tool_conditional",
    "DeepSeek-V3.2-8bit": "tool_conditional",
    "DeepSeek-V4-Flash": "tool_conditional",
    "DeepSeek-V4-Pro": "tool_conditional",
    "GLM-4.5-Air-8bit": "post_last_user",
    "GLM-4.5-Air-bf16": "post_last_user",
    "GLM-4.7-4bit": "post_last_user",
    "GLM-4.7-6bit": "post_last_user",
    "GLM-4.7-8bit-gs32": "post_last_user",
    "GLM-4.7-Flash-4bit": "post_last_user",
    "GLM-4.7-Flash-5bit": "post_last_user",
    "GLM-4.7-Flash-6bit": "post_last_user",
    "GLM-4.7-Flash-8bit": "post_last_user",
    "GLM-5-8bit": "post_last_user",
    "GLM-5-MXFP4-Q8": "post_last_user",
    "GLM-5": "post_last_user",  # the card file is GLM-5-bf16.toml
    "GLM-5.1-DQ4plus-q8": "post_last_user",
    "GLM-5.1-MXFP4-Q8": "post_last_user",
    "GLM-5.1": "post_last_user",
    "Kimi-K2-Thinking": "suffix",
    "Kimi-K2.5": "suffix",
    "Kimi-K2.6-mlx-DQ3_K_M-q8": "suffix",
    "MiniMax-M2.1-3bit": "post_last_user",
    "MiniMax-M2.1-8bit": "post_last_user",
    "MiniMax-M2.5-4bit": "post_last_user",
    "MiniMax-M2.5-6bit": "post_last_user",
    "MiniMax-M2.5-8bit": "post_last_user",
    "MiniMax-M2.7-4bit-mxfp4": "post_last_user",
    "MiniMax-M2.7-4bit": "post_last_user",
    "MiniMax-M2.7-5bit": "post_last_user",
    "MiniMax-M2.7-6bit": "post_last_user",
    "MiniMax-M2.7-8bit": "post_last_user",
    "MiniMax-M2.7": "post_last_user",
    "Qwen3-Next-80B-A3B-Thinking-4bit": "post_last_user",
    "Qwen3-Next-80B-A3B-Thinking-8bit": "post_last_user",
    "Qwen3.5-122B-A10B-4bit": "post_last_user",
    "Qwen3.5-122B-A10B-6bit": "post_last_user",
    "Qwen3.5-122B-A10B-8bit": "post_last_user",
    "Qwen3.5-122B-A10B-bf16": "post_last_user",
    "Qwen3.5-27B-4bit": "post_last_user",
    "Qwen3.5-27B-8bit": "post_last_user",
    "Qwen3.5-2B-MLX-8bit": "post_last_user",
    "Qwen3.5-35B-A3B-4bit": "post_last_user",
    "Qwen3.5-35B-A3B-8bit": "post_last_user",
    "Qwen3.5-397B-A17B-4bit": "post_last_user",
    "Qwen3.5-397B-A17B-6bit": "post_last_user",
    "Qwen3.5-397B-A17B-8bit": "post_last_user",
    "Qwen3.5-9B-4bit": "post_last_user",
    "Qwen3.5-9B-8bit": "post_last_user",
    "Qwen3.6-27B-4bit": "post_last_user",
    "Qwen3.6-27B-8bit": "post_last_user",
    "Qwen3.6-27B-bf16": "post_last_user",
    "Qwen3.6-35B-A3B-4bit": "post_last_user",
    "Qwen3.6-35B-A3B-5bit": "post_last_user",
    "Qwen3.6-35B-A3B-8bit": "post_last_user",
    "Qwen3.6-35B-A3B-bf16": "post_last_user",
    "gpt-oss-120b-MXFP4-Q8": "channel",
    "gpt-oss-20b-MXFP4-Q8": "channel",
}


@pytest.fixture(autouse=True)
def no_extra_models_dirs(monkeypatch):
    monkeypatch.delenv("EXO_MODELS_DIRS", raising=False)
    monkeypatch.delenv("EXO_MODELS_READ_ONLY_DIRS", raising=False)


def write_tiny_model(model_dir: Path, config: dict | None = None) -> None:
    model_dir.mkdir(parents=True)
    config = config or {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 8,
        "num_attention_heads": 2,
        "max_position_embeddings": 512,
        "quantization": {"bits": 4, "group_size": 64},
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    weights = {"embed.weight": np.zeros((4, 8), dtype=np.float32)}
    save_file(weights, str(model_dir / "model.safetensors"))
    (model_dir / "tokenizer_config.json").write_text("{}")


def test_every_builtin_card_parses_and_round_trips_json():
    cards = builtin_cards()
    assert len(cards) >= 76
    for card in cards.values():
        assert ModelCard.model_validate_json(card.model_dump_json()) == card


def test_every_builtin_vision_card_counts_its_vision_weights():
    """Placement puts the tower and projector on rank 0 only (their bytes added there, not
    split with the layers): a built-in card that says vision must say how many bytes they
    are, one figure per base model (mlx-vlm's convert leaves them bf16 at every
    quantization), a small share of the whole."""
    vision_cards = [card for card in builtin_cards().values() if "vision" in card.capabilities]
    assert len(vision_cards) >= 16
    by_base: dict[str, set[int]] = {}
    for card in vision_cards:
        assert 0 < card.vision_bytes < card.storage_size.in_bytes // 2, card.model_id
        by_base.setdefault(card.base_model, set()).add(card.vision_bytes)
    assert all(len(figures) == 1 for figures in by_base.values()), by_base


def test_gemma_4_cards_carry_the_seed_values():
    cards = builtin_cards()
    for size, (n_layers, hidden_size, kv_heads, context_length) in GEMMA_4.items():
        for quantization in GEMMA_4_QUANTIZATIONS:
            card = cards[f"mlx-community/gemma-4-{size}-{quantization}"]
            assert card.n_layers == n_layers
            assert card.hidden_size == hidden_size
            assert card.num_key_value_heads == kv_heads
            assert card.context_length == context_length
            assert card.quantization == quantization
            assert card.capabilities == ["text", "vision"]
            assert card.reasoning_dialect == ReasoningDialect.none
    assert cards["mlx-community/gemma-4-26b-a4b-it-4bit"].storage_size.in_bytes == 15608614044


def test_deepseek_v4_cards_carry_the_seed_values():
    flash = builtin_cards()["mlx-community/DeepSeek-V4-Flash"]
    pro = builtin_cards()["mlx-community/DeepSeek-V4-Pro"]
    assert (flash.n_layers, flash.hidden_size, flash.num_key_value_heads) == (43, 4096, 1)
    assert (pro.n_layers, pro.hidden_size, pro.num_key_value_heads) == (61, 7168, 1)
    for card in (flash, pro):
        assert card.reasoning_dialect == ReasoningDialect.tool_conditional
        assert card.context_length == 1048576
        assert card.sampling_defaults.temperature == 1.0
        assert card.sampling_defaults.top_p == 1.0
        assert card.tasks == [ModelTask.TextGeneration]
    assert pro.storage_size.in_bytes == 849681803879


def test_seed_changed_cards_have_the_seed_reasoning_dialect():
    cards = builtin_cards()
    for name, dialect in SEED_REASONING_DIALECTS.items():
        assert cards[f"mlx-community/{name}"].reasoning_dialect == dialect, name


@pytest.mark.parametrize(
    "text",
    ['model_id = "acme/broken"\nn_layers = 0\n', 'model_id = "acme/broken\n'],
    ids=["invalid-card", "invalid-toml"],
)
def test_malformed_card_file_names_the_file(tmp_path, monkeypatch, text):
    (tmp_path / "model_cards").mkdir()
    (tmp_path / "model_cards" / "acme--broken.toml").write_text(text)
    monkeypatch.setattr(catalog_cards, "resource_dir", lambda name: tmp_path / name)
    builtin_cards.cache_clear()

    # A failed load is not cached, so later tests read the real cards again.
    with pytest.raises(ValueError, match="acme--broken.toml"):
        builtin_cards()


def test_complete_local_model_dir_appears_with_derived_fields(tmp_path):
    write_tiny_model(tmp_path / "models" / "acme--tiny")

    card = local_cards(tmp_path)["acme/tiny"]

    assert card.n_layers == 2
    assert card.hidden_size == 8
    assert card.num_key_value_heads == 2
    assert card.context_length == 512
    assert card.family == "llama"
    assert card.quantization == "4bit"
    assert card.capabilities == ["text"]
    assert card.supports_tensor
    assert card.tasks == [ModelTask.TextGeneration]
    weights = tmp_path / "models" / "acme--tiny" / "model.safetensors"
    assert card.storage_size.in_bytes == weights.stat().st_size
    assert "acme/tiny" in all_cards(tmp_path)
    assert find_local_model_dir("acme/tiny", tmp_path) == tmp_path / "models" / "acme--tiny"


def test_multimodal_config_is_read_from_text_config(tmp_path):
    config = {
        "model_type": "gemma4",
        "text_config": {
            "num_hidden_layers": 3,
            "hidden_size": 6,
            "num_attention_heads": 3,
            "num_key_value_heads": 1,
            "max_position_embeddings": 1024,
        },
        "vision_config": {"hidden_size": 4},
        "image_token_id": 7,
    }
    write_tiny_model(tmp_path / "acme--seeing", config)

    card = card_from_model_dir(tmp_path / "acme--seeing", "acme/seeing")

    assert (card.n_layers, card.hidden_size, card.num_key_value_heads) == (3, 6, 1)
    assert card.context_length == 1024
    assert card.capabilities == ["text", "vision"]
    # exo's own Gemma 4 tensor strategy (engine/mlx/sharding/gemma4.py) covers it.
    assert card.supports_tensor


E4B_LAYER_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 7


@pytest.mark.parametrize(
    ("n_layers", "n_shared", "layer_types", "expected"),
    [
        (8, 2, "tiny", 4),  # the tiny Gemma 4 of devtools/tiny_configs.py, as it is
        (35, 20, None, 13),  # E2B: no layer_types, mlx-lm's default pattern of 5
        (42, 18, E4B_LAYER_TYPES, 22),  # E4B
        (8, 0, None, None),  # no KV sharing, no constraint
    ],
)
def test_kv_sharing_tail_starts_at_the_first_layer_a_shared_layer_reads(n_layers, n_shared, layer_types, expected):
    from mlx_lm.models import gemma4_text

    from exo.devtools.tiny_configs import TINY_CONFIGS

    text = dict(TINY_CONFIGS["gemma4"]["text_config"], num_hidden_layers=n_layers, num_kv_shared_layers=n_shared)
    if layer_types is None:
        del text["layer_types"]
    elif layer_types != "tiny":
        text["layer_types"] = layer_types
    config = {"model_type": "gemma4", "text_config": text}

    assert kv_sharing_tail_start(config) == expected
    # mlx-lm's own map of which layer each layer takes its keys and values from agrees.
    model = gemma4_text.Gemma4TextModel(gemma4_text.ModelArgs.from_dict(text))
    borrowed = [source for layer, source in enumerate(model.previous_kvs) if source != layer]
    assert min(borrowed, default=None) == expected


def test_dir_whose_index_lists_a_missing_shard_is_ignored(tmp_path):
    model_dir = tmp_path / "models" / "acme--partial"
    write_tiny_model(model_dir)
    weight_map = {"embed.weight": "model.safetensors", "head.weight": "model-00002.safetensors"}
    index = {"weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))

    assert not is_complete_model_dir(model_dir)
    assert "acme/partial" not in local_cards(tmp_path)
    assert find_local_model_dir("acme/partial", tmp_path) is None


def test_dir_without_tokenizer_is_ignored(tmp_path):
    model_dir = tmp_path / "models" / "acme--mute"
    write_tiny_model(model_dir)
    (model_dir / "tokenizer_config.json").unlink()

    assert "acme/mute" not in local_cards(tmp_path)


def test_builtin_card_wins_over_derived_card(tmp_path):
    write_tiny_model(tmp_path / "models" / "mlx-community--gemma-4-e2b-it-4bit")

    card = local_cards(tmp_path)["mlx-community/gemma-4-e2b-it-4bit"]

    assert card == builtin_cards()["mlx-community/gemma-4-e2b-it-4bit"]


def test_exo_models_dirs_is_honoured(tmp_path, monkeypatch):
    extra_a, extra_b = tmp_path / "extra-a", tmp_path / "extra-b"
    write_tiny_model(extra_b / "acme--elsewhere")
    monkeypatch.setenv("EXO_MODELS_DIRS", f"{extra_a}:{extra_b}")

    home = tmp_path / "home"
    assert models_dirs(home) == [home / "models", extra_a, extra_b]
    assert "acme/elsewhere" in local_cards(home)
    assert find_local_model_dir("acme/elsewhere", home) == extra_b / "acme--elsewhere"


def test_exo_models_read_only_dirs_is_honoured(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    write_tiny_model(shared / "acme--shared")
    monkeypatch.setenv("EXO_MODELS_READ_ONLY_DIRS", str(shared))

    assert read_only_models_dirs()[-1] == shared
    assert read_only_models_dirs()[0].parts[-2:] == ("resources", "models")
    assert "acme/shared" in local_cards(tmp_path / "home")


def test_writable_dir_is_searched_before_read_only_dir(tmp_path, monkeypatch):
    home, shared = tmp_path / "home", tmp_path / "shared"
    write_tiny_model(home / "models" / "acme--tiny")
    write_tiny_model(shared / "acme--tiny")
    monkeypatch.setenv("EXO_MODELS_READ_ONLY_DIRS", str(shared))

    assert find_local_model_dir("acme/tiny", home) == home / "models" / "acme--tiny"


# The catalog serves cards from memory: a request reads no directory and no config.json;
# a change in a models dir shows after the next refresh, which rescans only on a change.


def _no_disk(*args, **kwargs):
    raise AssertionError("the catalog read the disk")


def test_cards_are_served_from_memory(tmp_path, monkeypatch):
    write_tiny_model(tmp_path / "models" / "acme--tiny")
    node_catalog = Catalog(tmp_path)
    monkeypatch.setattr(catalog, "_local_models", _no_disk)
    monkeypatch.setattr(catalog, "models_dirs_stamp", _no_disk)

    assert "acme/tiny" in node_catalog.cards({})
    assert "mlx-community/gemma-4-e2b-it-4bit" in node_catalog.cards({})
    assert node_catalog.local_model_ids() >= {"acme/tiny", "exo/demo-chat"}
    assert node_catalog.local_model_dir("acme/tiny") == tmp_path / "models" / "acme--tiny"
    assert node_catalog.local_model_dir("mlx-community/gemma-4-e2b-it-4bit") is None


def test_custom_cards_win(tmp_path):
    write_tiny_model(tmp_path / "models" / "acme--tiny")
    custom = ModelCard(
        model_id="acme/tiny",
        n_layers=7,
        hidden_size=8,
        tasks=[ModelTask.TextGeneration],
        storage_size=StorageSize(in_bytes=1),
    )

    assert Catalog(tmp_path).cards({ModelId("acme/tiny"): custom})["acme/tiny"] == custom


def test_refresh_rescans_only_when_a_models_dir_changed(tmp_path, monkeypatch):
    node_catalog = Catalog(tmp_path)
    assert "acme/tiny" not in node_catalog.cards({})

    write_tiny_model(tmp_path / "models" / "acme--tiny")
    assert "acme/tiny" not in node_catalog.cards({})
    node_catalog.refresh()
    assert "acme/tiny" in node_catalog.cards({})

    with monkeypatch.context() as patch:
        patch.setattr(catalog, "_local_models", _no_disk)
        node_catalog.refresh()  # nothing changed: no rescan

    shutil.rmtree(tmp_path / "models" / "acme--tiny")
    node_catalog.refresh()
    assert "acme/tiny" not in node_catalog.cards({})
    assert node_catalog.local_model_dir("acme/tiny") is None


def test_a_model_completed_in_place_appears(tmp_path):
    model_dir = tmp_path / "models" / "acme--tiny"
    write_tiny_model(model_dir)
    tokenizer = (model_dir / "tokenizer_config.json").read_text()
    (model_dir / "tokenizer_config.json").unlink()
    node_catalog = Catalog(tmp_path)
    assert "acme/tiny" not in node_catalog.cards({})

    (model_dir / "tokenizer_config.json").write_text(tokenizer)
    node_catalog.refresh()
    assert "acme/tiny" in node_catalog.cards({})


def test_watch_refreshes_in_the_background(tmp_path, monkeypatch):
    monkeypatch.setattr(catalog, "WATCH_SECONDS", 0.01)
    node_catalog = Catalog(tmp_path)

    async def main() -> None:
        watch = asyncio.create_task(node_catalog.watch())
        write_tiny_model(tmp_path / "models" / "acme--tiny")
        for _ in range(500):
            if "acme/tiny" in node_catalog.cards({}):
                break
            await asyncio.sleep(0.01)
        watch.cancel()

    asyncio.run(main())
    assert "acme/tiny" in node_catalog.cards({})


def test_a_derived_card_says_vision_only_where_exo_runs_it(tmp_path):
    text = {"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "max_position_embeddings": 64}
    base = {"model_type": "gemma4", "text_config": text, "vision_config": {"hidden_size": 4}, "image_token_id": 7}
    no_token = {k: v for k, v in base.items() if k != "image_token_id"}
    layouts = {
        "e2b": (base, ["text", "vision"]),
        # 26B-A4B / 31B: image tokens attend both ways on sliding layers.
        "big": ({**base, "text_config": {**text, "use_bidirectional_attention": "vision"}}, ["text", "vision"]),
        "notoken": (no_token, ["text"]),
        "qwen": ({**base, "model_type": "qwen2_5_vl"}, ["text", "vision"]),
        "qwen3": ({**base, "model_type": "qwen3_vl"}, ["text", "vision"]),
        # Kimi-VL's config names its image token the media placeholder.
        "kimi": ({**no_token, "model_type": "kimi_vl", "media_placeholder_token_id": 7}, ["text", "vision"]),
        "kimi_notoken": ({**no_token, "model_type": "kimi_vl"}, ["text"]),
        # Kimi K2.5's tower (MoonViT 3-D) exo does not wire.
        "kimi_k25": ({**base, "model_type": "kimi_k25"}, ["text"]),
    }
    for name, (config, capabilities) in layouts.items():
        write_tiny_model(tmp_path / f"acme--{name}", config)
        assert card_from_model_dir(tmp_path / f"acme--{name}", f"acme/{name}").capabilities == capabilities, name
