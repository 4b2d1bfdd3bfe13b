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


def test_a_rank_takes_its_layers_files_and_the_files_of_no_layer() -> None:
    assert files_for_layers(WEIGHT_MAP, None) == {"a.safetensors", "b.safetensors", "c.safetensors", "d.safetensors"}
    assert files_for_layers(WEIGHT_MAP, (0, 1)) == {"a.safetensors", "d.safetensors"}
    assert files_for_layers(WEIGHT_MAP, (1, 2)) == {"a.safetensors", "b.safetensors", "d.safetensors"}
    assert files_for_layers(WEIGHT_MAP, (2, 4)) == {"a.safetensors", "c.safetensors", "d.safetensors"}


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
