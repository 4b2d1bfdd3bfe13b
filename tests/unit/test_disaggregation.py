"""The disaggregation rule (master/disaggregation.py) over described clusters: a node with
compute beside one with memory bandwidth, over a fast link, a slow link and an unmeasured
one; equal nodes; a node faster at both. And the placement preview showing its numbers."""

import pytest

from exo.master.disaggregation import (
    REFERENCE_PROMPT_TOKENS,
    best_plan,
    disaggregated_ttft,
    model_speed,
    plan_disaggregation,
)
from exo.master.placement import instance_previews, kv_cache_bytes
from exo.shared.models.model_cards import ModelCard, ModelTask, StorageSize
from exo.shared.types.common import NodeId
from exo.shared.types.nodes import NodeInfo, NodeSpeed
from exo.shared.types.state import State
from exo.shared.types.topology import Connection, Topology
from tests.support.fake_cluster import node_info

# Upstream exo's pair: a DGX Spark (compute) and an M3 Ultra (memory bandwidth).
SPARK = NodeSpeed(matmul_gflops=100_000, matvec_gbps=273, device="gpu")
MAC = NodeSpeed(matmul_gflops=28_000, matvec_gbps=819, device="gpu")
TEN_GBE_MBPS = 10_000.0


@pytest.fixture
def llama_8b() -> ModelCard:
    """Llama 3.1 8B in bf16: 32 layers, 8 KV heads of 128, 16 GB of weights."""
    return ModelCard(
        model_id="meta-llama/Llama-3.1-8B-Instruct",
        n_layers=32,
        hidden_size=4096,
        num_key_value_heads=8,
        tasks=[ModelTask.TextGeneration],
        storage_size=StorageSize(in_bytes=16_000_000_000),
        context_length=131072,
        vision_bytes=0,
        pipeline_tail_start=None,
    )


def plan(card: ModelCard, prefill: NodeSpeed, decode: NodeSpeed, link_mbps: float | None):
    return plan_disaggregation(
        card, NodeId("prefill"), prefill, NodeId("decode"), decode, kv_cache_bytes(card, 1), link_mbps
    )


def test_a_compute_node_prefills_for_a_bandwidth_node_over_a_fast_link(llama_8b: ModelCard) -> None:
    verdict = plan(llama_8b, SPARK, MAC, TEN_GBE_MBPS)
    assert verdict.worth_it, verdict.reason
    # 8B bf16: 8e9 weights, 2 FLOPs each; 131,072 bytes of KV a token (32 x 2 x 8 x 128 x 2).
    assert verdict.kv_bytes_per_token == 131072
    assert verdict.prefill_node_speed.prefill_tps == pytest.approx(100e12 / 16e9)
    assert verdict.decode_node_speed.decode_tps == pytest.approx(819e9 / 16e9)
    assert verdict.ttft_alone_seconds == pytest.approx(8192 / (28e12 / 16e9))
    assert verdict.transfer_seconds == pytest.approx(8192 * 131072 * 8 / 10e9)
    assert verdict.ttft_seconds == pytest.approx(
        disaggregated_ttft(verdict.prefill_seconds, verdict.transfer_seconds or 0, 32)
    )
    # About 3.5x sooner: upstream measured 2.8x end to end on this pair.
    assert 3.0 < verdict.ttft_alone_seconds / (verdict.ttft_seconds or 1) < 4.0
    assert "->" in verdict.reason


def test_a_slow_link_costs_more_than_the_prefill_it_saves(llama_8b: ModelCard) -> None:
    verdict = plan(llama_8b, SPARK, MAC, 100.0)
    assert not verdict.worth_it
    assert verdict.transfer_seconds is not None and verdict.transfer_seconds > 80
    assert "costs more than the prefill it saves" in verdict.reason


def test_equal_nodes_do_not_disaggregate(llama_8b: ModelCard) -> None:
    verdict = plan(llama_8b, MAC, MAC, TEN_GBE_MBPS)
    assert not verdict.worth_it
    assert "1.00x" in verdict.reason


def test_a_node_faster_at_both_takes_the_whole_instance(llama_8b: ModelCard) -> None:
    h100 = NodeSpeed(matmul_gflops=400_000, matvec_gbps=3_350, device="gpu")
    verdict = plan(llama_8b, h100, MAC, TEN_GBE_MBPS)
    assert not verdict.worth_it
    assert "also decodes faster" in verdict.reason


def test_an_unmeasured_link_is_not_counted_on(llama_8b: ModelCard) -> None:
    verdict = plan(llama_8b, SPARK, MAC, None)
    assert not verdict.worth_it and verdict.transfer_seconds is None
    assert "no measured bandwidth" in verdict.reason


def test_quantized_weights_prefill_by_their_count_not_their_bytes(llama_8b: ModelCard) -> None:
    four_bit = llama_8b.model_copy(update={"quantization": "4bit", "storage_size": StorageSize(in_bytes=4_000_000_000)})
    assert model_speed(four_bit, MAC).prefill_tps == pytest.approx(model_speed(llama_8b, MAC).prefill_tps)
    assert model_speed(four_bit, MAC).decode_tps == pytest.approx(4 * model_speed(llama_8b, MAC).decode_tps)


def test_the_wait_overlaps_transfer_with_prefill() -> None:
    assert disaggregated_ttft(2.0, 1.0, 10) == pytest.approx(2.1)
    assert disaggregated_ttft(1.0, 2.0, 10) == pytest.approx(2.1)


def test_best_plan_prefers_the_shortest_wait_and_otherwise_explains_the_closest_miss(llama_8b: ModelCard) -> None:
    fast = plan(llama_8b, SPARK, MAC, TEN_GBE_MBPS)
    faster = plan(llama_8b, SPARK, MAC, 4 * TEN_GBE_MBPS)
    slow = plan(llama_8b, SPARK, MAC, 100.0)
    assert best_plan([fast, slow, faster]) == faster
    assert best_plan([slow]) == slow
    assert best_plan([]) is None


def _node(name: str, speed: NodeSpeed | None) -> NodeInfo:
    return node_info(name, available_gib=100).model_copy(update={"speed": speed})


def _link(source: str, sink: str, mbps: float) -> Connection:
    return Connection(source=NodeId(source), sink=NodeId(sink), sink_ip="10.0.0.1", bandwidth_mbps=mbps)


def test_the_preview_of_the_bandwidth_node_names_the_compute_node(llama_8b: ModelCard) -> None:
    state = State(
        nodes={NodeId("mac"): _node("mac", MAC), NodeId("spark"): _node("spark", SPARK)},
        topology=Topology(connections=[_link("mac", "spark", TEN_GBE_MBPS), _link("spark", "mac", TEN_GBE_MBPS)]),
    )
    previews = {p.node_ids[0]: p for p in instance_previews(state, llama_8b) if len(p.node_ids) == 1}
    on_mac = previews[NodeId("mac")].disaggregation
    assert on_mac is not None and on_mac.worth_it
    assert (on_mac.prefill_node, on_mac.decode_node, on_mac.prompt_tokens) == ("spark", "mac", REFERENCE_PROMPT_TOKENS)
    on_spark = previews[NodeId("spark")].disaggregation
    assert on_spark is not None and not on_spark.worth_it  # the Mac prefills slower
    # A split has no disaggregation; a node whose speed is not measured yet, none either.
    assert all(p.disaggregation is None for p in instance_previews(state, llama_8b) if len(p.node_ids) == 2)
    unmeasured = state.model_copy(update={"nodes": {**state.nodes, NodeId("mac"): _node("mac", None)}})
    assert all(p.disaggregation is None for p in instance_previews(unmeasured, llama_8b) if p.node_ids == ["mac"])
