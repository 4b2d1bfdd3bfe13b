"""Where an instance can go: a pure function of State and a model card.

A candidate is one node, or several nodes that form a ring in the topology (each node
reaches the next and the next reaches it back, last to first included), because the MLX
ring backend talks to both neighbours. A candidate fits when every node has room for its
share of the weights, its share of the KV cache for the whole context, and a fixed
runtime overhead. Among fitting candidates: fewer nodes first, then fewer nodes that
compute on their cores (a GPU, CUDA or Metal, decodes many times faster than the same
machine's CPU), then the faster decode by the nodes' measured speeds (NodeInfo.speed),
then faster links, then more free memory. A node's memory is its free
RAM, except on a CUDA node, where MLX holds weights and cache in the GPU's own memory:
there it is the GPU's free memory.
"""

from collections.abc import Iterable, Iterator
from itertools import combinations
from typing import Literal

from exo.engine.llamacpp.support import mlx_reason
from exo.master.disaggregation import REFERENCE_PROMPT_TOKENS, DisaggregationPlan, best_plan, plan_disaggregation
from exo.shared.models.families import family_facts
from exo.shared.models.model_cards import ModelCard
from exo.shared.types.common import (
    FrozenModel,
    InstanceId,
    ModelId,
    NodeId,
    RunnerId,
    new_id,
)
from exo.shared.types.instances import (
    EngineKind,
    Instance,
    InstanceMeta,
    PrefillFor,
    PrefillPlacement,
    ShardAssignments,
    Sharding,
)
from exo.shared.types.nodes import NodeInfo
from exo.shared.types.shards import (
    PipelineShardMetadata,
    ShardMetadata,
    TensorShardMetadata,
)
from exo.shared.types.state import State
from exo.shared.types.topology import Connection, Topology

GiB = 2**30
# Room for the MLX runtime, activations and the Python process beside weights and cache.
RUNTIME_OVERHEAD_BYTES = 1 * GiB
KV_BYTES_PER_ELEMENT = 2  # bf16 keys and values
DEFAULT_HEAD_DIM = 128
# Used when a card does not say how long its context is.
DEFAULT_CONTEXT_LENGTH = 4096
# Rings are searched by brute force over node orders; beyond this many nodes only the
# ones with the most free memory are considered.
MAX_PLACEMENT_NODES = 8
# Below Linux's default ephemeral range (32768-60999): an outgoing connection of any
# process on the node can otherwise hold a ring port when a rank comes to listen on it.
RING_BASE_PORT = 31000
RING_PORT_SPAN = 1000
# How many rejection reasons a PlacementError quotes.
MAX_REASONS_IN_ERROR = 8
# Disaggregated serving: prompts with at least this many tokens to prefill go to the
# prefill node (shorter ones cost less to prefill than to ask for).
DISAGGREGATION_MIN_TOKENS = 512

Links = dict[tuple[NodeId, NodeId], Connection]
# What a node's share of an instance must fit in: free RAM, or a CUDA GPU's free memory.
MemoryKind = Literal["ram", "gpu"]
# What a node's share of an instance computes on.
Compute = Literal["cuda", "metal", "cpu"]


# What a missing link (or one way only) most often means: a node that just joined, whose
# links the nodes probe within a few seconds. The API waits that long before it answers with this.
LINKS_BEING_MEASURED = (
    "the links to a node that just joined are still being measured (a few seconds): retry in 5 s; "
    "if it persists, the network keeps those nodes from reaching each other both ways"
)


class PlacementError(ValueError):
    """No node set can hold the instance; the message says why."""


class PlacementPreview(FrozenModel):
    model_id: ModelId
    sharding: Sharding
    # In rank order when the nodes form a ring.
    node_ids: list[NodeId]
    memory_needed_bytes: dict[NodeId, int]
    memory_available_bytes: dict[NodeId, int] = {}
    # What memory_available_bytes counts on each node.
    memory_kind: dict[NodeId, MemoryKind] = {}
    compute: dict[NodeId, Compute] = {}
    context_length: int | None = None
    instance: Instance | None = None
    error: str | None = None
    # Why the instance runs MLX on nodes that run llama.cpp (a family llama.cpp lacks, a
    # split under a cluster secret); None when it runs its nodes' engine.
    engine_reason: str | None = None
    # On a one-node option: whether prompts should prefill on another node, with the
    # numbers (master/disaggregation.py); None where no other node's speed is known.
    disaggregation: DisaggregationPlan | None = None


def place_instance(
    state: State,
    card: ModelCard,
    sharding: Sharding = Sharding.Pipeline,
    min_nodes: int = 1,
    context_length: int | None = None,
) -> Instance:
    """The preferred instance for `card`, or a PlacementError saying why there is none."""
    if len(state.nodes) < min_nodes:
        raise PlacementError(
            f"cannot place {card.model_id}: the cluster has {len(state.nodes)} worker node(s), "
            f"at least {min_nodes} needed"
        )
    if min_nodes > MAX_PLACEMENT_NODES:
        raise PlacementError(f"placement considers at most {MAX_PLACEMENT_NODES} nodes, {min_nodes} requested")
    previews = instance_previews(state, card, sharding, min_nodes, context_length)
    for preview in previews:
        if preview.instance is not None:
            return preview.instance
    # The candidates with the most free memory are the ones closest to fitting.
    closest = sorted(previews, key=lambda p: -sum(p.memory_available_bytes.values()))
    reasons = [f"[{', '.join(p.node_ids)}] {p.error}" for p in closest[:MAX_REASONS_IN_ERROR]]
    if len(previews) > MAX_REASONS_IN_ERROR:
        reasons.append(f"and {len(previews) - MAX_REASONS_IN_ERROR} more option(s)")
    raise PlacementError(f"cannot place {card.model_id}: " + "; ".join(reasons))


def instance_previews(
    state: State,
    card: ModelCard,
    sharding: Sharding | None = None,
    min_nodes: int = 1,
    context_length: int | None = None,
) -> list[PlacementPreview]:
    """Every option considered: the feasible ones first, most preferred first, each with
    an instance; then the rejected ones, each with an error. `sharding=None` considers
    both pipeline and tensor. Empty when the cluster has fewer than `min_nodes` worker
    nodes."""
    context = _context_length(card, context_length)
    shardings = [sharding] if sharding is not None else list(Sharding)
    node_ids = _worker_nodes(state)
    links = _links(state.topology)
    previews: list[tuple[tuple, PlacementPreview]] = []
    for size in range(max(min_nodes, 1), len(node_ids) + 1):
        for group in combinations(node_ids, size):
            ring, no_ring_reason = _best_ring(links, list(group))
            for option in shardings:
                preview = _preview(state, links, card, option, ring, no_ring_reason, context)
                previews.append((_preference(state, links, preview, option), preview))
    return [preview for _, preview in sorted(previews, key=lambda item: item[0])]


def kv_cache_bytes(card: ModelCard, context_length: int) -> int:
    """Keys and values of every layer for `context_length` tokens, in bf16."""
    head_dim = _head_dim(card)
    kv_heads = card.num_key_value_heads or card.hidden_size // head_dim
    return 2 * card.n_layers * kv_heads * head_dim * context_length * KV_BYTES_PER_ELEMENT


def split_layers(n_layers: int, weights: list[int], tail_start: int | None = None) -> list[tuple[int, int]]:
    """Contiguous layer ranges proportional to weights, every range non-empty; with
    `tail_start`, the last range starts no later than that layer."""
    total = sum(weights) or 1
    last_start = n_layers - 1 if tail_start is None else min(max(tail_start, len(weights) - 1), n_layers - 1)
    bounds = [0]
    for i in range(1, len(weights)):
        share = round(n_layers * sum(weights[:i]) / total)
        bounds.append(min(max(share, bounds[-1] + 1), last_start - (len(weights) - 1 - i)))
    bounds.append(n_layers)
    return list(zip(bounds, bounds[1:], strict=False))


# --- candidates ------------------------------------------------------------------------


def _worker_nodes(state: State) -> list[NodeId]:
    """Nodes that run a worker, capped at the ones with the most free memory."""
    by_memory = sorted(state.nodes, key=lambda n: (-free_memory(state.nodes[n])[0], n))
    return sorted(by_memory[:MAX_PLACEMENT_NODES])


def free_memory(info: NodeInfo) -> tuple[int, MemoryKind]:
    """The free memory a node's share of an instance must fit in, and which memory that
    is. MLX on CUDA computes on one GPU (the first the driver lists) and keeps weights and
    cache in its memory; on Apple silicon Metal's working set is the unified memory,
    which is the RAM; on a CPU, and for llama.cpp, it is the RAM too. A CUDA node that
    could not report its GPU is judged by its RAM."""
    if info.backend == "cuda" and info.engine == EngineKind.Mlx and info.gpus:
        return info.gpus[0].free_bytes, "gpu"
    return info.memory.available_bytes, "ram"


def computes_on(info: NodeInfo) -> Compute:
    """MLX computes on the node's GPU where it has one; llama.cpp (built for the CPU)
    and MLX without a GPU compute on the cores."""
    if info.engine == EngineKind.Mlx and info.backend in ("cuda", "metal"):
        return "cuda" if info.backend == "cuda" else "metal"
    return "cpu"


def _links(topology: Topology) -> Links:
    return {(c.source, c.sink): c for c in topology.connections}


def _best_ring(links: Links, group: list[NodeId]) -> tuple[list[NodeId], str | None]:
    """The fastest ring order through `group`, or the group with a reason there is none."""
    if len(group) == 1:
        return group, None
    best = min(_rings(links, group), default=None)
    if best is None:
        return group, _no_ring_reason(links, group)
    return best[1], None


def _rings(links: Links, group: list[NodeId]) -> Iterator[tuple[tuple[float, float], list[NodeId]]]:
    """Every ring through all of `group` over links both ways, with its _link_key; each
    starts at group[0] and runs one way only (a ring and its reverse share their links)."""
    pair_key = {
        (a, b): _link_key(links, [a, b]) for a in group for b in group if a != b and (a, b) in links and (b, a) in links
    }
    two_way = {a: [b for b in group if (a, b) in pair_key] for a in group}

    def extend(path: list[NodeId], key: tuple[float, float]) -> Iterator[tuple[tuple[float, float], list[NodeId]]]:
        if len(path) == len(group):
            closing = (path[-1], path[0])
            if closing in pair_key and (len(path) < 3 or path[1] < path[-1]):
                yield _worse(key, pair_key[closing]), path
            return
        for following in two_way[path[-1]]:
            if following not in path:
                yield from extend([*path, following], _worse(key, pair_key[(path[-1], following)]))

    return extend([group[0]], (float("-inf"), 0.0))


def _worse(key: tuple[float, float], other: tuple[float, float]) -> tuple[float, float]:
    return (max(key[0], other[0]), max(key[1], other[1]))


def _ring_edges(ring: list[NodeId]) -> list[tuple[NodeId, NodeId]]:
    pairs = [(ring[i - 1], ring[i]) for i in range(len(ring))] if len(ring) > 1 else []
    return [*pairs, *((b, a) for a, b in pairs)]


def _no_ring_reason(links: Links, group: list[NodeId]) -> str:
    gaps = []
    for a, b in combinations(group, 2):
        there, back = (a, b) in links, (b, a) in links
        if there and not back:
            gaps.append(f"only {a} -> {b}")
        elif back and not there:
            gaps.append(f"only {b} -> {a}")
        elif not there:
            gaps.append(f"no link between {a} and {b}")
    return f"no cycle through {', '.join(group)} with links both ways ({'; '.join(gaps)}); {LINKS_BEING_MEASURED}"


def _link_key(links: Links, ring: list[NodeId]) -> tuple[float, float]:
    """Sorts faster rings first: higher slowest bandwidth, then lower worst latency; an
    unmeasured link counts as the slowest possible."""
    bandwidth, latency = float("inf"), 0.0
    for edge in _ring_edges(ring):
        connection = links.get(edge)
        measured_bandwidth = connection.bandwidth_mbps if connection else None
        measured_latency = connection.latency_ms if connection else None
        bandwidth = min(bandwidth, float("-inf") if measured_bandwidth is None else measured_bandwidth)
        latency = max(latency, float("inf") if measured_latency is None else measured_latency)
    return (-bandwidth, latency)


def _preference(state: State, links: Links, preview: PlacementPreview, sharding: Sharding) -> tuple:
    return (
        preview.instance is None,
        len(preview.node_ids),
        sum(computes_on(state.nodes[node_id]) == "cpu" for node_id in preview.node_ids),
        _decode_seconds(state, preview),
        _link_key(links, preview.node_ids),
        -sum(preview.memory_available_bytes.values()),
        list(Sharding).index(sharding),
        preview.node_ids,
    )


def _decode_seconds(state: State, preview: PlacementPreview) -> float:
    """Relative time a decoded token takes on the option, from the nodes' measured
    speeds: a pipeline's ranks read their layers' weights one after another, a tensor
    split's ranks their slice of every layer at once. A node not measured yet counts as
    the slowest measured one; with none measured, every option ties."""
    measured = [info.speed.matvec_gbps for info in state.nodes.values() if info.speed is not None]
    if not measured or preview.instance is None:
        return 0.0
    shards = preview.instance.shard_assignments
    times = []
    for node_id, runner_id in shards.node_to_runner.items():
        shard = shards.runner_to_shard[runner_id]
        speed = state.nodes[node_id].speed
        gbps = speed.matvec_gbps if speed is not None else min(measured)
        if isinstance(shard, TensorShardMetadata):
            times.append(1 / shard.world_size / gbps)
        else:
            times.append((shard.end_layer - shard.start_layer) / shard.n_layers / gbps)
    return max(times) if preview.sharding == Sharding.Tensor else sum(times)


# --- one candidate -------------------------------------------------------------------


def _preview(
    state: State,
    links: Links,
    card: ModelCard,
    sharding: Sharding,
    ring: list[NodeId],
    no_ring_reason: str | None,
    context: int,
) -> PlacementPreview:
    n = len(ring)
    memory = {node_id: free_memory(state.nodes[node_id]) for node_id in ring}
    available = {node_id: free for node_id, (free, _) in memory.items()}
    kinds: dict[NodeId, MemoryKind] = {node_id: kind for node_id, (_, kind) in memory.items()}
    layer_ranges = _layer_ranges(card, sharding, [available[node_id] for node_id in ring])
    needed = {
        node_id: _bytes_needed(card, context, end - start, n if sharding == Sharding.Tensor else 1)
        for node_id, (start, end) in zip(ring, layer_ranges, strict=True)
    }
    # The vision tower and projector run on rank 0 alone.
    needed[ring[0]] += card.vision_bytes
    reasons = [
        reason
        for reason in (
            no_ring_reason,
            _structure_reason(card, sharding, n),
            _memory_reason(state, card, context, ring, layer_ranges, needed, sharding),
        )
        if reason is not None
    ]
    preview = PlacementPreview(
        model_id=ModelId(card.model_id),
        sharding=sharding,
        node_ids=ring,
        memory_needed_bytes=needed,
        memory_available_bytes=available,
        memory_kind=kinds,
        compute={node_id: computes_on(state.nodes[node_id]) for node_id in ring},
        context_length=context,
    )
    if reasons:
        return preview.model_copy(update={"error": "; ".join(reasons)})
    instance = _build_instance(card, sharding, ring, layer_ranges, _ring_hosts(state, links, ring))
    engine, engine_reason = _instance_engine(state, card, sharding, ring)
    instance = instance.model_copy(update={"engine": engine, "engine_reason": engine_reason})
    disaggregation = _disaggregation(state, links, card, ring[0]) if n == 1 else None
    return preview.model_copy(
        update={"instance": instance, "engine_reason": engine_reason, "disaggregation": disaggregation}
    )


def _disaggregation(state: State, links: Links, card: ModelCard, decode_node: NodeId) -> DisaggregationPlan | None:
    """The best node to prefill for `decode_node`, among those that hold the whole model
    and a reference prompt's KV beside it, judged by disaggregation.py's rule."""
    decode_speed = state.nodes[decode_node].speed
    if decode_speed is None:
        return None
    plans = []
    for node_id, info in state.nodes.items():
        if node_id == decode_node or info.speed is None:
            continue
        if free_memory(info)[0] < _bytes_needed(card, REFERENCE_PROMPT_TOKENS, card.n_layers, 1):
            continue
        # The decode node's probe of the prefill node timed bytes coming from it.
        link = links.get((decode_node, node_id)) or links.get((node_id, decode_node))
        plans.append(
            plan_disaggregation(
                card,
                node_id,
                info.speed,
                decode_node,
                decode_speed,
                kv_cache_bytes(card, 1),
                link.bandwidth_mbps if link else None,
            )
        )
    return best_plan(plans)


def _instance_engine(
    state: State, card: ModelCard, sharding: Sharding, ring: list[NodeId]
) -> tuple[EngineKind, str | None]:
    """The engine the instance runs (its nodes', or MLX where llama.cpp cannot serve it),
    and why it is MLX on llama.cpp nodes. Every node has MLX (a llama.cpp node's setup
    installs its CPU build), so a ring of nodes that run different engines (a CUDA node
    and a CPU node) runs MLX on every rank."""
    engines = {node_id: state.nodes[node_id].engine for node_id in ring}
    if EngineKind.LlamaCpp not in engines.values():
        return EngineKind.Mlx, None
    if len(set(engines.values())) > 1:
        each = ", ".join(f"{node_id} runs {engine.value}" for node_id, engine in engines.items())
        return EngineKind.Mlx, f"runs on MLX: the nodes run different engines ({each}), and every node has MLX"
    sealed = any(state.nodes[node_id].sealed for node_id in ring)
    refusals = (state.nodes[node_id].llamacpp_refusals.get(ModelId(card.model_id)) for node_id in ring)
    refused = next((refusal for refusal in refusals if refusal is not None), None)
    reason = f"runs on MLX: {refused}" if refused is not None else mlx_reason(card, sharding, len(ring), sealed)
    return (EngineKind.Mlx, reason) if reason is not None else (EngineKind.LlamaCpp, None)


def _layer_ranges(card: ModelCard, sharding: Sharding, available: list[int]) -> list[tuple[int, int]]:
    if sharding == Sharding.Tensor:
        return [(0, card.n_layers)] * len(available)
    if len(available) > card.n_layers:
        # Cannot be placed; one layer each still shows roughly what a node would hold.
        return [(0, 1)] * len(available)
    # What is left after the fixed overhead (and on rank 0 the vision tower) is what the
    # layers can use.
    weights = [
        max(free - RUNTIME_OVERHEAD_BYTES - (card.vision_bytes if rank == 0 else 0), 0)
        for rank, free in enumerate(available)
    ]
    return split_layers(card.n_layers, weights, card.pipeline_tail_start)


def _bytes_needed(card: ModelCard, context: int, layers: int, tensor_ways: int) -> int:
    share = (_layer_weight_bytes(card) + kv_cache_bytes(card, context)) * layers // card.n_layers
    return -(-share // tensor_ways) + RUNTIME_OVERHEAD_BYTES


def _layer_weight_bytes(card: ModelCard) -> int:
    """The weights the layers share out (all but the vision side's)."""
    return max(card.storage_size.in_bytes - card.vision_bytes, 0)


def _structure_reason(card: ModelCard, sharding: Sharding, n: int) -> str | None:
    if sharding == Sharding.Pipeline and n > card.n_layers:
        return f"{card.model_id} has {card.n_layers} layers, too few for {n} pipeline ranks"
    tail = card.pipeline_tail_start
    if sharding == Sharding.Pipeline and tail is not None and n > tail + 1:
        return (
            f"{card.model_id} keeps layers {tail}..{card.n_layers - 1} on one pipeline rank (they share keys "
            f"and values), which leaves {tail} layers for the other {n - 1} ranks"
        )
    if sharding != Sharding.Tensor or n == 1:
        return None
    if not card.supports_tensor:
        return f"{card.model_id} does not support tensor parallelism"
    if card.hidden_size % n:
        return f"tensor parallel over {n} nodes needs hidden_size ({card.hidden_size}) divisible by {n}"
    # Built-in cards name DeepSeek V4 by base model (their family is "deepseek"); a local
    # model dir's card names its model_type, which the family table knows.
    keeps_kv_heads = card.base_model.startswith("DeepSeek V4") or not family_facts(card.family).tensor_splits_kv_heads
    kv_heads = card.num_key_value_heads
    if not keeps_kv_heads and kv_heads is not None and kv_heads % n:
        return f"tensor parallel over {n} nodes needs num_key_value_heads ({kv_heads}) divisible by {n}"
    return None


def _memory_reason(
    state: State,
    card: ModelCard,
    context: int,
    ring: list[NodeId],
    layer_ranges: list[tuple[int, int]],
    needed: dict[NodeId, int],
    sharding: Sharding,
) -> str | None:
    ways = len(ring) if sharding == Sharding.Tensor else 1
    short = []
    for rank, (node_id, (start, end)) in enumerate(zip(ring, layer_ranges, strict=True)):
        info = state.nodes[node_id]
        available, kind = free_memory(info)
        if needed[node_id] <= available:
            continue
        fraction = (end - start) / card.n_layers / ways
        weights = _layer_weight_bytes(card) * fraction
        kv = kv_cache_bytes(card, context) * fraction
        tower = f" + {_gib(card.vision_bytes)} vision tower" if rank == 0 and card.vision_bytes else ""
        free = f"{_gib(available)} free"
        if kind == "gpu":
            free = f"{_gib(available)} of GPU memory free ({info.gpus[0].name})"
        short.append(
            f"node {node_id} has {free}, needs {_gib(needed[node_id])} "
            f"({_gib(weights)} weights + {_gib(kv)} KV cache for {context} tokens{tower}"
            f" + {_gib(RUNTIME_OVERHEAD_BYTES)} runtime)"
        )
    return "; ".join(short) or None


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / GiB:.2f} GiB"


def _head_dim(card: ModelCard) -> int:
    # Cards do not record head_dim: derive it from the attention head count when a card
    # has one, else assume 128, the head size of most current models.
    attention_heads = getattr(card, "num_attention_heads", None)
    return card.hidden_size // attention_heads if attention_heads else DEFAULT_HEAD_DIM


def _context_length(card: ModelCard, requested: int | None) -> int:
    maximum = card.context_length or DEFAULT_CONTEXT_LENGTH
    if requested is None:
        return maximum
    if requested < 1:
        raise PlacementError(f"context_length must be at least 1, got {requested}")
    return min(requested, maximum)


# --- the instance --------------------------------------------------------------------


def _ring_hosts(state: State, links: Links, ring: list[NodeId]) -> list[str]:
    """One "ip:port" per rank: the address rank r-1 reached rank r at, and a port no
    other rank of this or any existing instance uses, so ranks sharing a host never
    collide."""
    if len(ring) == 1:
        return []
    ips = [links[(ring[rank - 1], ring[rank])].sink_ip for rank in range(len(ring))]
    return _with_ports(ips, _ring_ports(state, len(ring)))


def _ring_ports(state: State, count: int) -> list[int]:
    # Start where the event log stands, so an instance placed right after another was
    # deleted does not reuse its ports while the old ranks may still hold them.
    first = (max(state.last_event_applied_idx, 0) * 7) % RING_PORT_SPAN
    return _free_ports(_used_ports(state.instances.values()), count, first)


def _with_ports(ips: list[str], ports: list[int]) -> list[str]:
    return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip, port in zip(ips, ports, strict=True)]


def with_free_ring_ports(state: State, instance: Instance) -> Instance:
    """`instance`, its ring ports moved where they would clash with an instance in
    `state`. Placements made at the same moment from one State (two place requests at
    once, on one node or two) pick the same ports, and two rings listening on one port
    cross-connect and hang; the master, which sees every instance, moves the later one."""
    ports = [int(host.rsplit(":", 1)[1]) for host in instance.hosts]
    if not ports or (len(set(ports)) == len(ports) and _used_ports(state.instances.values()).isdisjoint(ports)):
        return instance
    ips = [host.rsplit(":", 1)[0].strip("[]") for host in instance.hosts]
    return instance.model_copy(update={"hosts": _with_ports(ips, _ring_ports(state, len(ports)))})


def with_ring_port_moved(state: State, instance: Instance, host: str, avoid: set[int]) -> Instance:
    """`instance` with the rank listening on `host` given a port that no instance in
    `state` uses and that is not in `avoid` (ports found taken on some node)."""
    used = _used_ports([*state.instances.values(), instance]) | avoid
    first = (max(state.last_event_applied_idx, 0) * 7) % RING_PORT_SPAN
    (port,) = _free_ports(used, 1, first)
    ip = host.rsplit(":", 1)[0].strip("[]")
    hosts = [_with_ports([ip], [port])[0] if entry == host else entry for entry in instance.hosts]
    return instance.model_copy(update={"hosts": hosts})


def _used_ports(instances: Iterable[Instance]) -> set[int]:
    used = set()
    for instance in instances:
        for host in instance.hosts:
            port = host.rsplit(":", 1)[-1]
            if port.isdigit():
                used.add(int(port))
        if instance.prefill_for is not None:
            used.add(instance.prefill_for.port)
    return used


def _free_ports(used: set[int], count: int, first: int = 0) -> list[int]:
    ports: list[int] = []
    offset = first
    while len(ports) < count:
        port = RING_BASE_PORT + offset % RING_PORT_SPAN
        if port not in used:
            ports.append(port)
        offset += 1
    return ports


def _build_instance(
    card: ModelCard,
    sharding: Sharding,
    node_ids: list[NodeId],
    layer_ranges: list[tuple[int, int]],
    hosts: list[str],
) -> Instance:
    shard_type = TensorShardMetadata if sharding == Sharding.Tensor else PipelineShardMetadata
    runner_to_shard: dict[RunnerId, ShardMetadata] = {}
    node_to_runner: dict[NodeId, RunnerId] = {}
    for rank, (node_id, (start, end)) in enumerate(zip(node_ids, layer_ranges, strict=True)):
        runner_id = RunnerId(new_id())
        runner_to_shard[runner_id] = shard_type(
            model_card=card,
            device_rank=rank,
            world_size=len(node_ids),
            start_layer=start,
            end_layer=end,
            n_layers=card.n_layers,
        )
        node_to_runner[node_id] = runner_id
    return Instance(
        instance_id=InstanceId(new_id()),
        sharding=sharding,
        instance_meta=InstanceMeta.MlxRing,
        shard_assignments=ShardAssignments(
            model_id=ModelId(card.model_id), runner_to_shard=runner_to_shard, node_to_runner=node_to_runner
        ),
        hosts=hosts,
    )


# --- instances placed before ------------------------------------------------------------


def splits_to_move_to_mlx(state: State) -> list[tuple[Instance, Instance]]:
    """Each split instance on llama.cpp that placement would now put on MLX (most often:
    llama.cpp refused its model on one of its nodes), with the same placement on MLX. A
    single runner loads such a model on MLX itself; a split cannot (only its rank 0 loads
    under llama.cpp, and one rank cannot change the engine of a ring), so the master
    places it again."""
    moves = []
    for instance in state.instances.values():
        if instance.engine != EngineKind.LlamaCpp or instance.world_size == 1:
            continue
        ring = _nodes_by_rank(instance)
        if any(node_id not in state.nodes for node_id in ring):
            continue  # a node left: the master re-places what remains
        card = next(iter(instance.shard_assignments.runner_to_shard.values())).model_card
        engine, reason = _instance_engine(state, card, instance.sharding, ring)
        if engine == EngineKind.Mlx:
            moves.append((instance, _on_mlx(state, instance, ring, reason)))
    return moves


def _nodes_by_rank(instance: Instance) -> list[NodeId]:
    shards = instance.shard_assignments.runner_to_shard
    ranks = {
        node_id: shards[runner_id].device_rank
        for node_id, runner_id in instance.shard_assignments.node_to_runner.items()
    }
    return sorted(ranks, key=ranks.__getitem__)


def _on_mlx(state: State, instance: Instance, ring: list[NodeId], reason: str | None) -> Instance:
    """The same nodes, ranks and layers on MLX. New ids, so no runner status or failure
    count carries over; ring ports the old instance (still in `state`, its runners maybe
    still holding theirs) does not use."""
    assignments = instance.shard_assignments
    shards = [assignments.runner_to_shard[assignments.node_to_runner[node_id]] for node_id in ring]
    ranges = [(shard.start_layer, shard.end_layer) for shard in shards]
    moved = _build_instance(shards[0].model_card, instance.sharding, ring, ranges, instance.hosts)
    moved = moved.model_copy(update={"engine": EngineKind.Mlx, "engine_reason": reason})
    return with_free_ring_ports(state, moved)


# --- instances made elsewhere ------------------------------------------------------------


def instance_problem(state: State, instance: Instance) -> str | None:
    """Why an instance a client built by hand (POST /instance) cannot run in this cluster,
    or None. Placement's own instances always pass."""
    assignments = instance.shard_assignments
    runners = set(assignments.runner_to_shard)
    if sorted(assignments.node_to_runner.values()) != sorted(runners):
        return "node_to_runner must give each runner of runner_to_shard to exactly one node"
    missing = [node_id for node_id in assignments.node_to_runner if node_id not in state.nodes]
    if missing:
        return f"node(s) {', '.join(missing)} are not in the cluster"
    taken = runners & {r for other in state.instances.values() for r in other.shard_assignments.runner_to_shard}
    if taken:
        return f"runner id(s) {', '.join(sorted(taken))} belong to another instance"
    shards = sorted(assignments.runner_to_shard.values(), key=lambda shard: shard.device_rank)
    n_layers = shards[0].n_layers
    if [shard.device_rank for shard in shards] != list(range(len(shards))) or any(
        shard.world_size != len(shards) for shard in shards
    ):
        return f"ranks must be 0..{len(shards) - 1}, each with world_size {len(shards)}"
    if any(shard.n_layers != n_layers or shard.model_card.model_id != assignments.model_id for shard in shards):
        return "every shard must hold the instance's model with the same n_layers"
    ranges = [(shard.start_layer, shard.end_layer) for shard in shards]
    if instance.sharding == Sharding.Tensor:
        if any(r != (0, n_layers) for r in ranges):
            return f"a tensor instance gives every rank all {n_layers} layers"
    elif [start for start, _ in ranges] != [0, *(end for _, end in ranges[:-1])] or ranges[-1][1] != n_layers:
        return f"pipeline ranks must cover layers 0..{n_layers - 1} in order, without gaps or overlaps"
    if len(shards) > 1 and len(instance.hosts) != len(shards):
        return f"a {len(shards)}-rank instance needs one host:port per rank in hosts"
    if any(not host.rpartition(":")[2].isdigit() for host in instance.hosts):
        return "every entry of hosts must be host:port with a numeric port"
    if instance.engine == EngineKind.LlamaCpp:
        others = [n for n in assignments.node_to_runner if state.nodes[n].engine != EngineKind.LlamaCpp]
        if others:
            return f"engine llamacpp, but node(s) {', '.join(others)} do not run it"
        if len(shards) > 1 and any(state.nodes[n].sealed for n in assignments.node_to_runner):
            return "a llama.cpp split under a cluster secret: its RPC port is unauthenticated; use engine mlx"
    return None


# --- disaggregated serving -----------------------------------------------------------


def place_disaggregated(
    state: State,
    card: ModelCard,
    prefill_node: NodeId,
    decode_node: NodeId,
    context_length: int | None = None,
    min_tokens: int = DISAGGREGATION_MIN_TOKENS,
) -> tuple[Instance, Instance]:
    """The model whole on `decode_node`, which serves it, and whole on `prefill_node`,
    which prefills its prompts of `min_tokens` or more (issue 36): the decode instance
    and the prefill instance, or a PlacementError saying why not. Both run MLX, whose
    KV the handoff carries (engine/mlx/kv_transfer.py)."""
    if prefill_node == decode_node:
        raise PlacementError("the prefill and decode nodes must differ")
    unknown = [node for node in (prefill_node, decode_node) if node not in state.nodes]
    if unknown:
        raise PlacementError(f"node(s) {', '.join(unknown)} are not in the cluster")
    links = _links(state.topology)
    link = links.get((decode_node, prefill_node))
    if link is None:
        raise PlacementError(f"node {decode_node} has not reached node {prefill_node}; {LINKS_BEING_MEASURED}")
    context = _context_length(card, context_length)
    decode, prefill = (_whole_on(state, links, card, node, context) for node in (decode_node, prefill_node))
    (port,) = _ring_ports(state, 1)  # the decode instance, on one node, has no ring
    host = _with_ports([link.sink_ip], [port])[0]
    prefill = prefill.model_copy(update={"prefill_for": PrefillFor(instance_id=decode.instance_id, port=port)})
    placement = PrefillPlacement(instance_id=prefill.instance_id, host=host, min_tokens=min_tokens)
    return decode.model_copy(update={"prefill": placement}), prefill


def _whole_on(state: State, links: Links, card: ModelCard, node: NodeId, context: int) -> Instance:
    preview = _preview(state, links, card, Sharding.Pipeline, [node], None, context)
    if preview.instance is None:
        raise PlacementError(f"cannot place {card.model_id} on node {node}: {preview.error}")
    reason = preview.instance.engine_reason or "runs on MLX: disaggregated serving hands MLX's KV over"
    return preview.instance.model_copy(update={"engine": EngineKind.Mlx, "engine_reason": reason})
