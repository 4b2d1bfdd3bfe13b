"""Splitting a model across the ranks of an MLX distributed group (ring backend, TCP).

Pipeline: each rank keeps a contiguous range of layers. The first local layer of rank
r > 0 takes its input from rank r-1; the last local layer sends to rank r+1. Only rank 0
embeds and only the last rank applies the final norm and the head (the others hold
neither, drop_unused_ends): it draws the tokens and shares them with the other ranks in
one small all-sum (from_last_rank), so every rank feeds and emits the same tokens.

Tensor: exo's own strategy for the architecture where it has one (engine/mlx/sharding),
else mlx-lm's `shard(group)` (column-split in, row-split out, one all-sum per block)."""

import functools
import json
import os
import tempfile
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from mlx.utils import tree_flatten

from exo.engine.mlx.sharding import pipeline_fix_up, tensor_strategy
from exo.shared.cluster_secret import derive_key, secret_from_env
from exo.shared.types.instances import Instance
from exo.shared.types.shards import PipelineShardMetadata, ShardMetadata, TensorShardMetadata


def connect_group(instance: Instance, shard: ShardMetadata) -> mx.distributed.Group | None:
    """Join the instance's ring. Every rank listens on its own entry of instance.hosts."""
    if shard.world_size == 1:
        return None
    if len(instance.hosts) != shard.world_size:
        raise ValueError(f"instance has {len(instance.hosts)} ring hosts for {shard.world_size} ranks")
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="exo-ring-", delete=False) as hostfile:
        json.dump([[host] for host in instance.hosts], hostfile)
    os.environ["MLX_RANK"] = str(shard.device_rank)
    os.environ["MLX_HOSTFILE"] = hostfile.name
    try:
        group = mx.distributed.init(backend="ring", strict=True)
    finally:
        # Read once, by init: left behind, every split load would leave a file in /tmp.
        os.unlink(hostfile.name)
    if group.size() != shard.world_size or group.rank() != shard.device_rank:
        raise RuntimeError(f"ring formed as rank {group.rank()}/{group.size()}, expected {shard.device_rank}")
    # A first collective proves every link of the ring works before loading starts.
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))
    return group


class _LayerWrapper(nn.Module):
    """Wraps one transformer block; attribute reads the wrapper lacks (a block's
    `use_sliding`, `layer_type`, ...) go to the block, since models consult them."""

    def __init__(self, layer: nn.Module, group: mx.distributed.Group) -> None:
        super().__init__()
        self.layer = layer
        self.group = group

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "layer" not in self:
                raise
            return getattr(self["layer"], name)


class ReceiveFromPrevious(_LayerWrapper):
    def __init__(self, layer: nn.Module, group: mx.distributed.Group, wire_dtype: mx.Dtype) -> None:
        super().__init__(layer, group)
        self.wire_dtype = wire_dtype

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        x = mx.distributed.recv(x.shape, self.wire_dtype, self.group.rank() - 1, group=self.group)
        return self.layer(x, *args, **kwargs)


class SendToNext(_LayerWrapper):
    def __init__(self, layer: nn.Module, group: mx.distributed.Group, wire_dtype: mx.Dtype) -> None:
        super().__init__(layer, group)
        self.wire_dtype = wire_dtype

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        out = self.layer(x, *args, **kwargs)
        rank, size = self.group.rank(), self.group.size()
        if rank == size - 1:
            return out
        # Some blocks (Gemma 4) return (hidden, keys/values, offset); only hidden travels.
        hidden, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
        hidden = mx.distributed.send(hidden.astype(self.wire_dtype), rank + 1, group=self.group)
        return hidden if rest is None else (hidden, *rest)


def from_last_rank(x: mx.array, group: mx.distributed.Group) -> mx.array:
    """The last pipeline rank's `x` on every rank (a token drawn, log-probabilities): one
    all-sum to which the other ranks add zeros. Their zeros still depend on their own `x`,
    so evaluating the result runs their part of the forward (the send to the next rank)."""
    if group.rank() != group.size() - 1:
        x = mx.depends(mx.zeros_like(x), x)
    return mx.distributed.all_sum(x, group=group)


class _PassThrough(nn.Module):
    """In place of the final norm on a rank before the last."""

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        return x


class _NoLogits(nn.Module):
    """In place of the head on a rank before the last (as_linear: of tied embeddings):
    zeros of the logits' shape, depending on the hidden state so that its send runs."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def __call__(self, x: mx.array) -> mx.array:
        return mx.depends(mx.zeros((*x.shape[:-1], self.vocab_size), dtype=x.dtype), x)

    def as_linear(self, x: mx.array) -> mx.array:
        return self(x)


class _NoEmbedding(_NoLogits):
    """In place of the embeddings on a rank after the first: its first layer reads the
    previous rank's hidden state instead, so only the shape of what it gives counts.
    `weight` serves the models that multiply by the tied table themselves (on a rank
    before the last, whose logits nobody reads): zeros, broadcast."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: mx.Dtype) -> None:
        super().__init__(vocab_size)
        self.hidden_size = hidden_size
        self.dtype = dtype

    def __call__(self, x: mx.array) -> mx.array:  # token ids
        return mx.zeros((*x.shape, self.hidden_size), dtype=self.dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        return super().__call__(x)

    @property
    def weight(self) -> mx.array:
        return mx.broadcast_to(mx.zeros((1, 1), dtype=self.dtype), (self.vocab_size, self.hidden_size))


class _EmbeddingOnly(nn.Module):
    """Rank 0's tied embeddings on a split: it embeds, and leaves the logits to the last rank."""

    def __init__(self, embedding: Any) -> None:  # nn.Embedding or nn.QuantizedEmbedding
        super().__init__()
        self.embedding = embedding

    def __call__(self, x: mx.array) -> mx.array:
        return self.embedding(x)

    def as_linear(self, x: mx.array) -> mx.array:
        return mx.depends(mx.zeros((*x.shape[:-1], self.embedding.weight.shape[0]), dtype=x.dtype), x)

    @property
    def weight(self) -> mx.array:
        return self.embedding.weight


def _table_shape(embedding: Any) -> tuple[int, int]:
    vocab, width = embedding.weight.shape[:2]
    if isinstance(embedding, nn.QuantizedEmbedding):
        width = width * 32 // embedding.bits
    return vocab, width


def _head_owner(model: nn.Module) -> Any:
    for owner in (model, getattr(model, "language_model", None)):
        if owner is not None and isinstance(getattr(owner, "lm_head", None), nn.Module):
            return owner
    return None


def drop_unused_ends(model: nn.Module, inner: Any, rank: int, size: int, dtype: mx.Dtype) -> None:
    """Leaves out what this pipeline rank never reads (shared/models/weight_files.py
    fetches only the rest): the embeddings after rank 0 (kept on the last rank when the
    head is the embeddings, and on every rank where each layer takes an input from them,
    Gemma 3n / 4), the final norm and the head before the last rank. `dtype`: what the
    missing embeddings would give (the rank's own weights')."""
    embedding = getattr(inner, "embed_tokens", None)
    owner = _head_owner(model)
    tied = owner is None
    last = rank == size - 1
    if isinstance(embedding, nn.Embedding | nn.QuantizedEmbedding):
        every_rank_embeds = getattr(inner, "embed_tokens_per_layer", None) is not None
        if rank > 0 and not every_rank_embeds and not (last and tied):
            inner.embed_tokens = _NoEmbedding(*_table_shape(embedding), dtype)
        elif tied and not last:
            inner.embed_tokens = _EmbeddingOnly(embedding)
    if last:
        return
    if isinstance(getattr(inner, "norm", None), nn.Module):
        inner.norm = _PassThrough()
    if owner is not None:
        owner.lm_head = _NoLogits(owner.lm_head.weight.shape[0])


def inner_model(model: nn.Module) -> Any:
    """The module that owns `.layers` (mlx-lm models mostly keep it at `model.model`).
    Any: each architecture's inner module has its own attributes."""
    candidates = (
        getattr(model, "model", None),
        getattr(model, "backbone", None),  # NemotronH
        getattr(getattr(model, "language_model", None), "model", None),
    )
    for candidate in candidates:
        if candidate is not None and hasattr(candidate, "layers"):
            return candidate
    raise ValueError(f"cannot find the transformer layers of {type(model).__name__}")


def apply_pipeline(
    model: nn.Module, model_type: str, shard: PipelineShardMetadata, group: mx.distributed.Group
) -> None:
    inner = inner_model(model)
    layers = list(inner.layers)[shard.start_layer : shard.end_layer]
    # First, so that only this rank's weights count for the wire dtype.
    inner.layers = layers
    drop_unused_ends(model, inner, shard.device_rank, shard.world_size, _floating_dtype(layers))
    wire_dtype = agree_on_wire_dtype(model, group)
    if shard.device_rank > 0:
        layers[0] = ReceiveFromPrevious(layers[0], group, wire_dtype)
    layers[-1] = SendToNext(layers[-1], group, wire_dtype)
    inner.layers = layers
    _fix_layer_indices(inner, shard.start_layer, shard.end_layer)
    fix_up = pipeline_fix_up(model_type)
    if fix_up is not None:
        fix_up(model, shard.start_layer, shard.end_layer)


def _floating_dtype(layers: list[nn.Module]) -> mx.Dtype:
    """The dtype of the first floating weight of these layers (a checkpoint's own)."""
    for layer in layers:
        for _, leaf in tree_flatten(layer.parameters()):
            if isinstance(leaf, mx.array) and mx.issubdtype(leaf.dtype, mx.floating):
                return leaf.dtype
    return mx.float32


# Floating dtypes by width; a mix of float16 and bfloat16 promotes to float32.
_WIRE_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def agree_on_wire_dtype(model: nn.Module, group: mx.distributed.Group) -> mx.Dtype:
    """The dtype hidden states travel in between pipeline ranks, the same on every rank:
    what the floating weights of all ranks together promote to. A rank's hidden state
    takes the dtype of the widest weight it met (float32 norms in a bfloat16
    checkpoint; a node that computes in another dtype than its neighbour), and a
    receiver reads exactly the bytes of the dtype it expects: without agreement a
    float32 sender and a bfloat16 receiver read garbage. One all-sum at load time."""
    held = {leaf.dtype for _, leaf in tree_flatten(model.parameters()) if isinstance(leaf, mx.array)}
    flags = mx.array([dtype in held for dtype in _WIRE_DTYPES], dtype=mx.int32)
    counts = cast(list[int], mx.distributed.all_sum(flags, group=group).tolist())
    union = [dtype for dtype, count in zip(_WIRE_DTYPES, counts, strict=True) if count]
    return union[0] if len(union) == 1 else mx.float32


class _SoloGroup:
    """A one-rank group: lets an mlx-lm PipelineMixin model recompute its per-rank indices."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


def _fix_layer_indices(inner: Any, start: int, end: int) -> None:
    """Some models pick a mask or cache by a layer's index into the full stack, or zip
    their layers with a per-layer list; after slicing, both must describe this rank's layers."""
    local = list(inner.layers)
    layer_types = getattr(inner, "layer_types", None)
    if isinstance(layer_types, list) and len(layer_types) > len(local):
        # gpt-oss zips its layers with layer_types and builds its caches from it.
        inner.layer_types = layer_types = layer_types[start:end]
    for name in ("num_hidden_layers", "num_layers"):
        if isinstance(getattr(inner, name, None), int):
            setattr(inner, name, end - start)
    if callable(getattr(inner, "pipeline", None)):
        # mlx-lm's PipelineMixin models (ministral3, qwen3_next, qwen3_5, ...) recompute
        # their fa_idx / swa_idx / ssm_idx from the layers they hold; with one rank,
        # pipeline() changes nothing else.
        inner.pipeline(_SoloGroup())
        return

    def kind(i: int, layer: nn.Module) -> str:
        if getattr(layer, "is_linear", False):
            return "linear"
        sliding = getattr(layer, "use_sliding", getattr(layer, "is_sliding", None))
        if sliding is None and isinstance(layer_types, list):
            sliding = layer_types[i] == "sliding_attention"
        return "sliding" if sliding else "full"

    kinds = [kind(i, layer) for i, layer in enumerate(local)]
    wanted = {
        "fa_idx": "full",
        "ga_idx": "full",
        "_full_idx": "full",
        "swa_idx": "sliding",
        "_swa_idx": "sliding",
        "ssm_idx": "linear",
    }
    for name, layer_kind in wanted.items():
        if hasattr(inner, name):
            # Without such a layer on this rank the mask goes unused; any valid index will do.
            setattr(inner, name, kinds.index(layer_kind) if layer_kind in kinds else 0)


def apply_tensor(model: nn.Module, model_type: str, group: mx.distributed.Group) -> None:
    strategy = tensor_strategy(model_type)
    if strategy is not None:
        strategy(model, group)
    elif callable(shard := getattr(model, "shard", None)):
        shard(group)
    else:
        raise ValueError(f"{model_type} has no tensor-parallel strategy")


def shard_model(model: nn.Module, model_type: str, shard: ShardMetadata, group: mx.distributed.Group | None) -> None:
    if group is None:
        return
    if isinstance(shard, TensorShardMetadata):
        apply_tensor(model, model_type, group)
    else:
        apply_pipeline(model, model_type, shard, group)


_RING_NONCE_BYTES = 12
_RING_AAD = b"exo mlx ring broadcast"


@functools.cache
def _ring_aead() -> AESGCM | None:
    """With a cluster secret, what rank 0 broadcasts (each request's start op, its
    messages included) crosses the ring encrypted."""
    secret = secret_from_env()
    return AESGCM(derive_key(secret, b"exo mlx ring v1")) if secret else None


def _ring_seal(payload: bytes) -> bytes:
    aead = _ring_aead()
    if aead is None:
        return payload
    nonce = os.urandom(_RING_NONCE_BYTES)
    return nonce + aead.encrypt(nonce, payload, _RING_AAD)


def _ring_open(sealed: bytes) -> bytes:
    aead = _ring_aead()
    if aead is None or not sealed:
        return sealed
    return aead.decrypt(sealed[:_RING_NONCE_BYTES], sealed[_RING_NONCE_BYTES:], _RING_AAD)


def collective_stream(generation_stream: mx.Stream | mx.ThreadLocalStream) -> mx.Stream:
    """The stream a forward pass's own collectives (pipeline send / recv, tensor
    all-sums) run on, in the calling thread; the engine's other collectives must run on
    it too, in the same order on every rank. The ring backend computes on the CPU: it
    puts collectives on the default CPU stream, which inside generation on a CPU node is
    generation_stream itself, and on a CUDA or Metal node the thread's own CPU stream.
    Given generation_stream there (a GPU stream), the ring looks for a CPU stream of its
    index and fails with "There is no Stream(cpu, N) in current thread", as every rank of
    a split on NVIDIA did."""
    with mx.stream(generation_stream):
        return mx.default_stream(mx.cpu)


def broadcast_bytes(payload: bytes | None, group: mx.distributed.Group, stream: Any) -> bytes:
    """Rank 0's payload, on every rank (others pass None). Two small all-sums: the size,
    then the bytes (sealed with the cluster secret when there is one). `stream` must be
    `collective_stream`: a token's forward pass may still be in flight (mlx-lm evaluates
    the next token asynchronously), and its collectives must come first on every rank."""
    is_root = group.rank() == 0
    if is_root and payload:
        payload = _ring_seal(payload)
    size = mx.distributed.all_sum(mx.array([len(payload) if is_root and payload else 0]), group=group, stream=stream)
    n = cast(int, size.item())
    if n == 0:
        return b""
    data = mx.array(list(payload), dtype=mx.int32) if is_root and payload else mx.zeros((n,), dtype=mx.int32)
    total = mx.distributed.all_sum(data, group=group, stream=stream)
    return _ring_open(bytes(cast(list[int], total.astype(mx.uint8).tolist())))


def agree_on_minimum(value: int, group: mx.distributed.Group, stream: Any) -> int:
    """The smallest of every rank's `value` (below 2**31), on every rank: one all-sum of
    a vector holding each rank's value at its own index."""
    values = mx.zeros((group.size(),), dtype=mx.int32)
    values[group.rank()] = min(value, (1 << 31) - 1)
    every = mx.distributed.all_sum(values, group=group, stream=stream)
    return min(cast(list[int], every.tolist()))
