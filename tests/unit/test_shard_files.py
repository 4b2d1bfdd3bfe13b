"""A pipeline rank's weight files, and the planner asking for more files when a node's
download record covers other layers than its shard's."""

from exo.catalog.cards import builtin_cards
from exo.shared.models.weight_files import files_for_layers
from exo.shared.types.downloads import DownloadCompleted
from exo.worker.planner import CreateRunner, FindModel, plan
from tests.unit.test_planner import INSTANCE, NODE, NOW, RUNNER, single_node_state

WEIGHT_MAP = {
    "model.embed_tokens.weight": "a.safetensors",
    "model.layers.0.self_attn.q_proj.weight": "a.safetensors",
    "model.layers.1.mlp.up_proj.weight": "b.safetensors",
    "model.layers.2.mlp.up_proj.weight": "c.safetensors",
    "model.layers.3.mlp.up_proj.weight": "c.safetensors",
    "model.norm.weight": "d.safetensors",
    "lm_head.weight": "d.safetensors",
}


def test_a_rank_takes_its_layers_files_the_embeddings_on_the_first_and_the_head_on_the_last() -> None:
    assert files_for_layers(WEIGHT_MAP, None) == {"a.safetensors", "b.safetensors", "c.safetensors", "d.safetensors"}
    assert files_for_layers(WEIGHT_MAP, (0, 1)) == {"a.safetensors"}
    assert files_for_layers(WEIGHT_MAP, (1, 2)) == {"b.safetensors"}
    assert files_for_layers(WEIGHT_MAP, (2, 4)) == {"c.safetensors", "d.safetensors"}
    assert files_for_layers(WEIGHT_MAP, (2, 2)) == set()


def test_tied_embeddings_go_to_the_last_rank_too_and_other_tensors_to_every_rank() -> None:
    tied = {name: file for name, file in WEIGHT_MAP.items() if not name.startswith("lm_head.")}
    tied["model.rotary_emb.inv_freq"] = "e.safetensors"  # of no layer, and not an end: every rank
    assert files_for_layers(tied, (1, 2)) == {"b.safetensors", "e.safetensors"}
    assert files_for_layers(tied, (2, 4)) == {"a.safetensors", "c.safetensors", "d.safetensors", "e.safetensors"}


def test_per_layer_embeddings_make_every_rank_embed() -> None:
    gemma = WEIGHT_MAP | {"model.language_model.embed_tokens_per_layer.weight": "e.safetensors"}
    assert files_for_layers(gemma, (1, 2)) == {"a.safetensors", "b.safetensors", "e.safetensors"}


def test_the_last_rank_is_the_configs_not_the_index_with_extra_layers() -> None:
    """DeepSeek V3's checkpoints carry a multi-token prediction layer past the model's."""
    mtp = WEIGHT_MAP | {"model.layers.4.eh_proj.weight": "e.safetensors"}
    assert files_for_layers(mtp, (2, 4)) == {"c.safetensors"}
    assert files_for_layers(mtp, (2, 4), n_layers=4) == {"c.safetensors", "d.safetensors"}


def test_a_record_for_other_layers_makes_the_worker_look_again() -> None:
    card = builtin_cards()["mlx-community/Qwen3.5-2B-MLX-8bit"]
    n = card.n_layers
    for layers, expected in (
        ((0, 1), FindModel(INSTANCE)),  # the single-node shard needs every layer
        ((0, n), CreateRunner(INSTANCE, RUNNER)),
        (None, CreateRunner(INSTANCE, RUNNER)),
    ):
        record = DownloadCompleted(total_bytes=1, path="/m", files=["a.safetensors"], layers=layers)
        assert plan(NODE, single_node_state(card, download=record), {}, NOW) == expected, layers
