"""Which node takes a file from the hub when several need it (shared/queries.py's
hub_fetcher): decided from State alone, so every node agrees without talking."""

from exo.catalog.cards import builtin_cards
from exo.shared.queries import hub_fetcher
from exo.shared.types.common import ModelId, NodeId, RunnerId
from exo.shared.types.downloads import DownloadCompleted, DownloadFailed, DownloadOrderEntry, DownloadPending
from exo.shared.types.state import State
from tests.unit.test_apply import node_info
from tests.unit.test_planner import instance_over

CARD = builtin_cards()["mlx-community/Qwen3.5-2B-MLX-8bit"]
MODEL = ModelId(CARD.model_id)
A, B, C = NodeId("node-a"), NodeId("node-b"), NodeId("node-c")
HALF = CARD.n_layers // 2
# Embeddings and head in one file, each half's layers in its own.
WEIGHTS = {
    "model.embed_tokens.weight": "shared.safetensors",
    "model.layers.0.mlp.weight": "first.safetensors",
    f"model.layers.{HALF}.mlp.weight": "second.safetensors",
}


def with_nodes(*nodes: NodeId, **fields) -> State:
    return State(nodes={node: node_info(node) for node in nodes}, **fields)


def test_the_lowest_node_needing_a_file_fetches_it_for_the_others():
    pipeline = instance_over(CARD, [(B, RunnerId("rb")), (A, RunnerId("ra"))])  # B runs the first half
    state = with_nodes(A, B, instances={pipeline.instance_id: pipeline})
    assert hub_fetcher(state, MODEL, "config.json", None) == A
    assert hub_fetcher(state, MODEL, "shared.safetensors", WEIGHTS) == A
    assert hub_fetcher(state, MODEL, "first.safetensors", WEIGHTS) == B
    assert hub_fetcher(state, MODEL, "second.safetensors", WEIGHTS) == A
    # Before the index is read every node needs every file.
    assert hub_fetcher(state, MODEL, "first.safetensors", None) == A


def test_a_start_order_needs_the_model_too():
    state = with_nodes(B, C, download_orders={C: {MODEL: DownloadOrderEntry(order="start")}})
    assert hub_fetcher(state, MODEL, "config.json", None) == C
    state = state.model_copy(update={"download_orders": {**state.download_orders, B: state.download_orders[C]}})
    assert hub_fetcher(state, MODEL, "config.json", None) == B


def test_nodes_that_hold_the_file_failed_or_left_are_not_asked():
    order = {MODEL: DownloadOrderEntry(order="start")}
    orders = {A: order, B: order, C: order}
    failed = {MODEL: DownloadFailed(error_message="x")}
    holds = {MODEL: DownloadCompleted(total_bytes=1, path="/m", files=["config.json"], layers=(0, 1))}
    state = with_nodes(B, C, download_orders=orders)  # A left the cluster
    assert hub_fetcher(state, MODEL, "config.json", None) == B
    state = state.model_copy(update={"downloads": {B: failed}})
    assert hub_fetcher(state, MODEL, "config.json", None) == C
    state = state.model_copy(update={"downloads": {B: holds}})
    assert hub_fetcher(state, MODEL, "config.json", None) == C  # B holds it: C takes it from B
    assert hub_fetcher(state, MODEL, "tokenizer.json", None) == B
    state = state.model_copy(update={"downloads": {B: {MODEL: DownloadPending()}, C: failed}})
    assert hub_fetcher(state, MODEL, "config.json", None) == B
    assert hub_fetcher(with_nodes(A, B), MODEL, "config.json", None) is None
