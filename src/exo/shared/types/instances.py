"""A placed model: which runner on which node holds which shard."""

from enum import StrEnum

from exo.shared.types.common import FrozenModel, InstanceId, ModelId, NodeId, RunnerId
from exo.shared.types.shards import ShardMetadata


class Sharding(StrEnum):
    Pipeline = "Pipeline"
    Tensor = "Tensor"


class InstanceMeta(StrEnum):
    MlxRing = "MlxRing"


class EngineKind(StrEnum):
    """What runs a model: MLX (Apple silicon, and its CPU backend elsewhere) or
    llama.cpp (ggml's CPU kernels). A node runs one; an instance records its own, which
    is MLX where llama.cpp cannot run the model (engine/llamacpp/support.py)."""

    Mlx = "mlx"
    LlamaCpp = "llamacpp"


class ShardAssignments(FrozenModel):
    model_id: ModelId
    runner_to_shard: dict[RunnerId, ShardMetadata]
    node_to_runner: dict[NodeId, RunnerId]


class PrefillPlacement(FrozenModel):
    """Disaggregated serving (issue 36): the instance whose runner, on another node and
    holding the same model whole, prefills this one's long prompts, at `host` ("ip:port",
    the address this instance's node reaches it at); prompts with at least `min_tokens`
    tokens left to prefill go there."""

    instance_id: InstanceId
    host: str
    min_tokens: int


class PrefillFor(FrozenModel):
    """On an instance that prefills for another (which takes no requests of its own): that
    instance, and the port its runner takes KV handoffs on."""

    instance_id: InstanceId
    port: int


class Instance(FrozenModel):
    instance_id: InstanceId
    sharding: Sharding
    instance_meta: InstanceMeta = InstanceMeta.MlxRing
    shard_assignments: ShardAssignments
    # One "host:port" per rank for the MLX ring (llama.cpp: a follower's RPC server);
    # empty for a single-rank instance.
    hosts: list[str] = []
    engine: EngineKind = EngineKind.Mlx
    # Why it runs MLX on nodes that run llama.cpp (placement's reason); None otherwise.
    engine_reason: str | None = None
    # A smaller model with the same tokenizer that rank 0 loads beside its shard to
    # propose tokens for speculative decoding (the card's draft_model, or the placement's).
    draft_model: ModelId | None = None
    # Disaggregated serving: where this instance's long prompts prefill, or which
    # instance this one prefills for (None: neither).
    prefill: PrefillPlacement | None = None
    prefill_for: PrefillFor | None = None

    @property
    def model_id(self) -> ModelId:
        return self.shard_assignments.model_id

    @property
    def world_size(self) -> int:
        return len(self.shard_assignments.runner_to_shard)
