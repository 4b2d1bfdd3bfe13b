"""Whether a model's prompts should prefill on another node than the one that decodes
them: a pure rule over measured speeds.

Prefill is bound by compute, decode by the memory bus. A cluster often has one node with
far more compute (an NVIDIA GPU) and another with more memory bandwidth and room (a Mac
Studio). Prefilling on the first and decoding on the second pays off when the first
prefills well above the second's speed and the link carries the prompt's KV in less time
than the prefill saves. The KV streams layer by layer while prefill runs, so the wait is
the longer of the two plus one layer's share of the shorter.

A node's speeds come from its probe (worker/speed_probe.py: matmul GFLOP/s, one-row
matmul GB/s); a model's prefill tok/s is the probe's FLOP/s over two FLOPs a weight, its
decode tok/s the probe's bytes/s over the weights read per token. The preview shows
every number the decision took."""

from exo.shared.models.model_cards import ModelCard
from exo.shared.types.common import FrozenModel, NodeId
from exo.shared.types.nodes import NodeSpeed

# What agents send: tens of thousands of tokens, and 8k is where prefill dominates the
# wait on every machine people own.
REFERENCE_PROMPT_TOKENS = 8192
# "Well above": the prefill node must prefill at least this many times faster.
MIN_PREFILL_SPEEDUP = 1.5
# Bytes a weight takes by the card's quantization; unquantized checkpoints are bf16.
BYTES_PER_WEIGHT = {"2bit": 0.25, "3bit": 0.375, "4bit": 0.5, "5bit": 0.625, "6bit": 0.75, "8bit": 1.0}
UNQUANTIZED_BYTES_PER_WEIGHT = 2.0


class ModelSpeed(FrozenModel):
    """A model's tok/s on one node, estimated from the node's measured speeds."""

    prefill_tps: float
    decode_tps: float


class DisaggregationPlan(FrozenModel):
    """Prefill on `prefill_node`, decode on `decode_node`, for a prompt of
    `prompt_tokens`: the estimates the rule compared, and its verdict."""

    prefill_node: NodeId
    decode_node: NodeId
    prompt_tokens: int
    prefill_node_speed: ModelSpeed
    decode_node_speed: ModelSpeed
    kv_bytes_per_token: int
    link_mbps: float | None
    # The decode node prefilling the prompt itself, against prefill there + the transfer.
    ttft_alone_seconds: float
    prefill_seconds: float
    transfer_seconds: float | None
    ttft_seconds: float | None
    worth_it: bool
    reason: str


def model_speed(card: ModelCard, speed: NodeSpeed) -> ModelSpeed:
    weight_bytes = max(card.storage_size.in_bytes - card.vision_bytes, 1)
    weights = weight_bytes / BYTES_PER_WEIGHT.get(card.quantization, UNQUANTIZED_BYTES_PER_WEIGHT)
    return ModelSpeed(
        prefill_tps=speed.matmul_gflops * 1e9 / (2 * weights),
        decode_tps=speed.matvec_gbps * 1e9 / weight_bytes,
    )


def disaggregated_ttft(prefill_seconds: float, transfer_seconds: float, layers: int) -> float:
    """The KV of each layer travels while the next layers prefill: the wait is the longer
    of the two, plus one layer's share of the other (what is left when it ends)."""
    longer, shorter = max(prefill_seconds, transfer_seconds), min(prefill_seconds, transfer_seconds)
    return longer + shorter / max(layers, 1)


def plan_disaggregation(
    card: ModelCard,
    prefill_node: NodeId,
    prefill_speed: NodeSpeed,
    decode_node: NodeId,
    decode_speed: NodeSpeed,
    kv_bytes_per_token: int,
    link_mbps: float | None,
    prompt_tokens: int = REFERENCE_PROMPT_TOKENS,
) -> DisaggregationPlan:
    """The rule, for one pair of nodes. `link_mbps` is the measured bandwidth the KV would
    travel at (prefill node to decode node); None where no link was measured."""
    prefill_side = model_speed(card, prefill_speed)
    decode_side = model_speed(card, decode_speed)
    alone = prompt_tokens / decode_side.prefill_tps
    prefill = prompt_tokens / prefill_side.prefill_tps
    transfer = None if not link_mbps else prompt_tokens * kv_bytes_per_token * 8 / (link_mbps * 1e6)
    ttft = None if transfer is None else disaggregated_ttft(prefill, transfer, card.n_layers)
    speedup = prefill_side.prefill_tps / decode_side.prefill_tps
    if speedup < MIN_PREFILL_SPEEDUP:
        worth_it, reason = (
            False,
            (f"{prefill_node} prefills at {speedup:.2f}x {decode_node}'s speed (needs {MIN_PREFILL_SPEEDUP}x)"),
        )
    elif prefill_side.decode_tps >= decode_side.decode_tps:
        worth_it, reason = False, f"{prefill_node} also decodes faster: the whole instance belongs there"
    elif transfer is None or ttft is None:
        worth_it, reason = False, f"the link from {prefill_node} to {decode_node} has no measured bandwidth yet"
    elif transfer >= alone - prefill:
        worth_it, reason = (
            False,
            (f"moving the KV ({transfer:.2f} s) costs more than the prefill it saves ({alone - prefill:.2f} s)"),
        )
    else:
        worth_it, reason = (
            True,
            (
                f"time to first token on {prompt_tokens} tokens {alone:.2f} s -> {ttft:.2f} s "
                f"(prefill {prefill:.2f} s on {prefill_node}, KV transfer {transfer:.2f} s)"
            ),
        )
    return DisaggregationPlan(
        prefill_node=prefill_node,
        decode_node=decode_node,
        prompt_tokens=prompt_tokens,
        prefill_node_speed=prefill_side,
        decode_node_speed=decode_side,
        kv_bytes_per_token=kv_bytes_per_token,
        link_mbps=link_mbps,
        ttft_alone_seconds=alone,
        prefill_seconds=prefill,
        transfer_seconds=transfer,
        ttft_seconds=ttft,
        worth_it=worth_it,
        reason=reason,
    )


def best_plan(plans: list[DisaggregationPlan]) -> DisaggregationPlan | None:
    """The plan with the shortest wait among those worth it; else the closest miss (so a
    preview can say why not), which is the one prefilling fastest."""
    worth = [plan for plan in plans if plan.worth_it and plan.ttft_seconds is not None]
    if worth:
        return min(worth, key=lambda plan: plan.ttft_seconds or 0.0)
    return max(plans, key=lambda plan: plan.prefill_node_speed.prefill_tps, default=None)
