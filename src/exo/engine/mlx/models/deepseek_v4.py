"""DeepSeek V4 (Flash / Pro) for mlx-lm, computing what transformers' `deepseek_v4` computes.

Each layer collapses `hc_mult` residual streams into one (manifold-constrained
hyper-connections), attends, and expands back; the same around the MoE. Attention is
multi-query with one shared key = value head over a sliding window, plus, on compressed
layers, entries that each pool a window of `compress_ratio` tokens: heavily compressed
(HCA, every entry visible) or compressed sparse (CSA, overlapping windows, and a lightning
indexer picking the top-k entries per query). Output heads go through a grouped low-rank
projection (wo_a per group of heads, then wo_b). The first MoE layers route by a fixed
token-id table (hash routing), the rest by a learned router.

Parameter names follow the mlx-community conversion, so its (quantized) checkpoints load
as they are; `sanitize` maps the DeepSeek / Hugging Face layout onto them."""

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_inplace
from mlx.utils import tree_map
from mlx_lm.models.base import BaseModelArgs
from mlx_lm.models.switch_layers import SwiGLU, SwitchGLU

_RATIO_BY_LAYER_TYPE = {"sliding_attention": 0}
_DEFAULT_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "deepseek_v4"
    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    q_lora_rank: int = 1024
    qk_rope_head_dim: int | None = None
    partial_rotary_factor: float | None = None
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    # Attention kind per layer, either as compression ratios (0 = sliding window only)
    # or, as transformers writes it, as layer types plus a ratio per type.
    compress_ratios: list[int] | None = None
    layer_types: list[str] | None = None
    compress_rates: dict[str, int] | None = None
    # Which MoE layers route by token id: the first `num_hash_layers`, or per layer.
    num_hash_layers: int = 3
    mlp_layer_types: list[str] | None = None
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    # YaRN for the compressed layers: `rope_scaling`, or transformers' nested
    # `rope_parameters = {"main": {...}, "compress": {...}}`.
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    attention_bias: bool = False
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False

    def __post_init__(self):
        n = self.num_hidden_layers
        if self.compress_ratios is None:
            rates = {**_DEFAULT_COMPRESS_RATES, **(self.compress_rates or {}), **_RATIO_BY_LAYER_TYPE}
            layer_types = self.layer_types or (
                ["heavily_compressed_attention"] * min(n, 2)
                + ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(n - 2)]
            )
            self.compress_ratios = [rates[t] for t in layer_types]
        self.compress_ratios = list(self.compress_ratios[:n])
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["hash_moe" if i < self.num_hash_layers else "moe" for i in range(n)]
        self.mlp_layer_types = list(self.mlp_layer_types[:n])
        if self.qk_rope_head_dim is None:
            self.qk_rope_head_dim = int(self.head_dim * (self.partial_rotary_factor or 64 / 512))
        nested = self.rope_parameters if isinstance((self.rope_parameters or {}).get("compress"), dict) else None
        if nested is not None:
            self.rope_theta = nested["main"].get("rope_theta", self.rope_theta)
            self.compress_rope_theta = nested["compress"].get("rope_theta", self.compress_rope_theta)
            self.rope_scaling = nested["compress"]
        elif self.rope_scaling is None and self.rope_parameters is not None:
            self.rope_scaling = self.rope_parameters


def rope_inv_freq(dims: int, base: float, scaling: dict | None) -> tuple[mx.array, float]:
    """Inverse frequencies, one per rotated pair, and the cos/sin scale: plain RoPE, or
    YaRN as transformers computes it (correction range rounded outwards). DeepSeek V4
    leaves cos/sin unscaled unless a config says otherwise."""
    inv_freq = 1.0 / (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims))
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type not in ("yarn", "deepseek_yarn"):
        raise ValueError(f"DeepSeek V4 does not support rope type {rope_type}")
    factor = scaling["factor"]
    original_max = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dims * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dims - 1)
    if low == high:
        high += 0.001
    extrapolate = 1 - mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    inv_freq = inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate
    return inv_freq, float(scaling.get("attention_factor", 1.0))


class RoPE(nn.Module):
    """Interleaved RoPE (pairs of adjacent channels) on the trailing `dims` channels of a
    head; the leading channels pass through. `inverse` rotates back by the same angle."""

    def __init__(self, dims: int, base: float, scaling: dict | None = None):
        super().__init__()
        self.dims = dims
        self._inv_freq, self.scale = rope_inv_freq(dims, base, scaling)

    def __call__(self, x: mx.array, positions: mx.array, inverse: bool = False) -> mx.array:
        freqs = positions.astype(mx.float32)[:, None] * self._inv_freq
        cos, sin = mx.cos(freqs) * self.scale, mx.sin(freqs) * self.scale
        if inverse:
            sin = -sin
        nope, rope = x[..., : -self.dims], x[..., -self.dims :]
        rope = rope.astype(mx.float32).reshape(*rope.shape[:-1], self.dims // 2, 2)
        even, odd = rope[..., 0], rope[..., 1]
        rotated = mx.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
        rotated = rotated.reshape(*x.shape[:-1], self.dims).astype(x.dtype)
        return mx.concatenate([nope, rotated], axis=-1)


def unweighted_rms_norm(x: mx.array, eps: float) -> mx.array:
    return x * mx.rsqrt(x.astype(mx.float32).square().mean(axis=-1, keepdims=True) + eps).astype(x.dtype)


def router_scores(logits: mx.array, scoring_func: str) -> mx.array:
    if scoring_func == "sqrtsoftplus":
        return mx.sqrt(mx.logaddexp(logits, 0.0))
    if scoring_func == "sigmoid":
        return mx.sigmoid(logits)
    if scoring_func == "softmax":
        return mx.softmax(logits, axis=-1, precise=True)
    raise ValueError(f"DeepSeek V4 does not support scoring function {scoring_func}")


_FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def block_scales(scale: mx.array) -> mx.array:
    """DeepSeek's block scales: float, or UE8M0 (a byte e meaning 2 ** (e - 127))."""
    if scale.dtype == mx.uint8:
        return mx.power(2.0, scale.astype(mx.float32) - 127.0)
    return scale.astype(mx.float32)


def dequantize_fp8(weight: mx.array, scale: mx.array, block: int = 128) -> mx.array:
    """E4M3 bytes with one scale per `block` x `block` tile."""
    rows, cols = weight.shape
    scale = mx.repeat(mx.repeat(block_scales(scale), block, axis=0), block, axis=1)[:rows, :cols]
    return (mx.from_fp8(weight, dtype=mx.float32) * scale).astype(mx.bfloat16)


def dequantize_fp4(weight: mx.array, scale: mx.array) -> mx.array:
    """E2M1 pairs packed in bytes (low nibble first), one scale per block of inputs."""
    packed = weight.view(mx.uint8) if weight.dtype == mx.int8 else weight
    table = mx.array(_FP4_VALUES, dtype=mx.float32)
    values = mx.stack([table[packed & 0x0F], table[packed >> 4]], axis=-1).reshape(weight.shape[0], -1)
    block = values.shape[-1] // scale.shape[-1]
    return (values * mx.repeat(block_scales(scale), block, axis=-1)).astype(mx.bfloat16)


class DeepseekV4Cache:
    """One layer's cache: the last `sliding_window - 1` keys (= values) of the local
    branch, and per compressor branch ("compressor", "indexer") the projected tokens of
    the window not yet complete, the previous window's overlap half (CSA) and the pooled
    entries so far.

    Arrays are only ever replaced, never written into, so `copy()` shares them and is a
    snapshot: restoring one puts the layer back at that token, which a prefix cache
    needs since the pooled entries cannot be trimmed."""

    def __init__(self, sliding_window: int):
        self.sliding_window = sliding_window
        self.keys: mx.array | None = None
        self.offset = 0
        self.branches: dict[str, dict[str, mx.array]] = {}

    def update_local(self, kv: mx.array) -> mx.array:
        """Appends this step's keys; returns the window they attend over (the kept keys
        plus all new ones)."""
        keys = kv if self.keys is None else mx.concatenate([self.keys, kv], axis=2)
        self.keys = keys[:, :, max(keys.shape[2] - self.sliding_window + 1, 0) :]
        self.offset += kv.shape[2]
        return keys

    def branch(self, name: str) -> dict[str, mx.array]:
        return self.branches.setdefault(name, {})

    @property
    def state(self) -> dict[str, mx.array]:
        arrays = {} if self.keys is None else {"keys": self.keys}
        for name, branch in self.branches.items():
            arrays.update({f"{name}.{key}": value for key, value in branch.items()})
        return arrays

    @state.setter
    def state(self, arrays: dict[str, mx.array]) -> None:
        self.keys = arrays.get("keys")
        self.branches = {}
        for name, value in arrays.items():
            if name != "keys":
                branch, key = name.split(".")
                self.branch(branch)[key] = value

    @property
    def meta_state(self) -> tuple[str, str]:
        return str(self.offset), str(self.sliding_window)

    @meta_state.setter
    def meta_state(self, values: tuple[str, str]) -> None:
        self.offset, self.sliding_window = (int(v) for v in values)

    def copy(self) -> "DeepseekV4Cache":
        snapshot = DeepseekV4Cache(self.sliding_window)
        snapshot.keys, snapshot.offset = self.keys, self.offset
        snapshot.branches = {name: dict(branch) for name, branch in self.branches.items()}
        return snapshot

    def snapshot(self) -> "DeepseekV4Cache":
        return self.copy()

    def restore(self, snapshot: "DeepseekV4Cache") -> None:
        restored = snapshot.copy()
        self.keys, self.offset, self.branches = restored.keys, restored.offset, restored.branches

    def __deepcopy__(self, memo: dict) -> "DeepseekV4Cache":
        return self.copy()

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state.values())


class Compressor(nn.Module):
    """Pools every `compress_ratio` tokens into one entry: a softmax over the window
    (gate plus a learned position bias) weighting the projected tokens, then RMSNorm and
    RoPE at the window's first position. With `overlap` (CSA) each token projects to
    two halves and an entry pools the previous window's first half with its own
    window's second half."""

    def __init__(self, args: ModelArgs, compress_ratio: int, head_dim: int, overlap: bool):
        super().__init__()
        self.compress_ratio = compress_ratio
        self.head_dim = head_dim
        self.overlap = overlap
        width = head_dim * (2 if overlap else 1)
        self.wkv = nn.Linear(args.hidden_size, width, bias=False)
        self.wgate = nn.Linear(args.hidden_size, width, bias=False)
        self.ape = mx.zeros((compress_ratio, width), dtype=mx.float32)
        self.norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, state: dict[str, mx.array], rope: RoPE) -> mx.array:
        """Adds the entries of the windows `x` completes to `state`; returns them all."""
        B, _, _ = x.shape
        ratio, D = self.compress_ratio, self.head_dim
        kv, gate = self.wkv(x), self.wgate(x)
        if "buffer_kv" in state:
            kv = mx.concatenate([state["buffer_kv"], kv], axis=1)
            gate = mx.concatenate([state["buffer_gate"], gate], axis=1)
        W = kv.shape[1] // ratio
        state["buffer_kv"], state["buffer_gate"] = kv[:, W * ratio :], gate[:, W * ratio :]
        pooled = state.get("pooled", mx.zeros((B, 0, D), dtype=x.dtype))
        if W == 0:
            state["pooled"] = pooled
            return pooled

        kv = kv[:, : W * ratio].reshape(B, W, ratio, -1)
        gate = gate[:, : W * ratio].reshape(B, W, ratio, -1) + self.ape.astype(gate.dtype)
        if self.overlap:
            previous_kv = state.get("overlap_kv", mx.zeros((B, ratio, D), dtype=kv.dtype))
            previous_gate = state.get("overlap_gate", mx.full((B, ratio, D), -mx.inf, dtype=gate.dtype))
            state["overlap_kv"], state["overlap_gate"] = kv[:, -1, :, :D], gate[:, -1, :, :D]
            kv = mx.concatenate(
                [mx.concatenate([previous_kv[:, None], kv[:, :-1, :, :D]], axis=1), kv[..., D:]], axis=2
            )
            gate = mx.concatenate(
                [mx.concatenate([previous_gate[:, None], gate[:, :-1, :, :D]], axis=1), gate[..., D:]], axis=2
            )
        weights = mx.softmax(gate.astype(mx.float32), axis=2, precise=True).astype(kv.dtype)
        new = self.norm((kv * weights).sum(axis=2))
        first_position = pooled.shape[1] * ratio
        positions = mx.arange(W) * ratio + first_position
        new = rope(new, positions)
        pooled = mx.concatenate([pooled, new.astype(pooled.dtype)], axis=1)
        state["pooled"] = pooled
        return pooled


def visible_entries(positions: mx.array, n_entries: int, compress_ratio: int) -> mx.array:
    """[L, T]: a query sees an entry once the entry's whole window is at or before it."""
    return mx.arange(n_entries)[None, :] < ((positions + 1) // compress_ratio)[:, None]


class Indexer(nn.Module):
    """Lightning indexer: scores each query against its own compressed keys,
    sum_h w_h * relu(q_h . k), and keeps the `index_topk` best visible entries."""

    def __init__(self, args: ModelArgs, compress_ratio: int):
        super().__init__()
        self.n_heads = args.index_n_heads
        self.head_dim = args.index_head_dim
        self.index_topk = args.index_topk
        self.compress_ratio = compress_ratio
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(args.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(args, compress_ratio, self.head_dim, overlap=True)

    def __call__(
        self, x: mx.array, q_residual: mx.array, positions: mx.array, state: dict[str, mx.array], rope: RoPE
    ) -> mx.array:
        """[B, L, T] boolean: the entries each query attends to."""
        B, L, _ = x.shape
        keys = self.compressor(x, state, rope)
        T = keys.shape[1]
        q = self.wq_b(q_residual).reshape(B, L, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        q = rope(q, positions)
        scores = mx.maximum(q.astype(mx.float32) @ keys[:, None].swapaxes(-1, -2).astype(mx.float32), 0)
        scores = scores * self.head_dim**-0.5
        weights = self.weights_proj(x).astype(mx.float32) * self.n_heads**-0.5
        scores = (scores * weights.transpose(0, 2, 1)[..., None]).sum(axis=1)
        visible = visible_entries(positions, T, self.compress_ratio)
        k = min(self.index_topk, T)
        if k == T:
            return mx.broadcast_to(visible, (B, L, T))
        scores = mx.where(visible, scores, -mx.inf)
        top = mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]
        chosen = mx.put_along_axis(mx.zeros((B, L, T), dtype=mx.bool_), top, mx.array(True), axis=-1)
        return chosen & visible


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.head_dim = args.head_dim
        self.o_groups = args.o_groups
        self.o_lora_rank = args.o_lora_rank
        self.eps = args.rms_norm_eps
        assert args.compress_ratios is not None and args.qk_rope_head_dim is not None, "set by __post_init__"
        self.compress_ratio = args.compress_ratios[layer_idx]
        self.sliding_window = args.sliding_window
        self.scale = self.head_dim**-0.5
        self.wq_a = nn.Linear(args.hidden_size, args.q_lora_rank, bias=False)
        self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=args.rms_norm_eps)
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(args.hidden_size, self.head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.wo_a = nn.Linear(
            self.n_heads * self.head_dim // self.o_groups, self.o_groups * self.o_lora_rank, bias=False
        )
        self.wo_b = nn.Linear(self.o_groups * self.o_lora_rank, args.hidden_size, bias=args.attention_bias)
        self.attn_sink = mx.zeros((self.n_heads,), dtype=mx.float32)
        if self.compress_ratio:
            # Compressed layers, their compressor and indexer share the YaRN "compress" rope.
            self.rope = RoPE(args.qk_rope_head_dim, args.compress_rope_theta, args.rope_scaling)
            self.compressor = Compressor(args, self.compress_ratio, self.head_dim, overlap=self.compress_ratio == 4)
            if self.compress_ratio == 4:
                self.indexer = Indexer(args, self.compress_ratio)
        else:
            self.rope = RoPE(args.qk_rope_head_dim, args.rope_theta)
        self.sharding_group: mx.distributed.Group | None = None

    def grouped_output(self, out: mx.array) -> mx.array:
        """wo_a applied per group of heads: [B, L, heads * head_dim] -> [B, L, groups * rank]."""
        B, L, _ = out.shape
        out = out.reshape(B, L, self.o_groups, -1)
        if isinstance(self.wo_a, nn.QuantizedLinear):
            w = self.wo_a
            biases = w.get("biases")
            shape = (self.o_groups, 1, self.o_lora_rank, -1)
            out = mx.quantized_matmul(
                out.transpose(2, 0, 1, 3),
                w.weight.reshape(shape),
                scales=w.scales.reshape(shape),
                biases=None if biases is None else biases.reshape(shape),
                transpose=True,
                group_size=w.group_size,
                bits=w.bits,
                mode=w.mode,
            )
            return out.transpose(1, 2, 0, 3).reshape(B, L, -1)
        weight = self.wo_a.weight.reshape(self.o_groups, self.o_lora_rank, -1)
        return mx.einsum("blgd,grd->blgr", out, weight).reshape(B, L, -1)

    def __call__(self, x: mx.array, cache: DeepseekV4Cache) -> mx.array:
        B, L, _ = x.shape
        positions = mx.arange(L) + cache.offset

        q_residual = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_residual).reshape(B, L, -1, self.head_dim).transpose(0, 2, 1, 3)
        q = self.rope(unweighted_rms_norm(q, self.eps), positions)
        kv = self.kv_norm(self.wkv(x)).reshape(B, 1, L, self.head_dim)
        kv = self.rope(kv, positions)

        # Local branch: the kept keys are the last (window - 1) positions before this step.
        keys = cache.update_local(kv)
        key_positions = mx.arange(keys.shape[2]) + (positions[-1] + 1 - keys.shape[2])
        distance = positions[:, None] - key_positions[None, :]
        visible = (distance >= 0) & (distance < self.sliding_window)
        if self.compress_ratio:
            pooled = self.compressor(x, cache.branch("compressor"), self.rope)
            if hasattr(self, "indexer"):
                chosen = self.indexer(x, q_residual, positions, cache.branch("indexer"), self.rope)
            else:
                chosen = mx.broadcast_to(
                    visible_entries(positions, pooled.shape[1], self.compress_ratio), (B, L, pooled.shape[1])
                )
            keys = mx.concatenate([keys, pooled[:, None].astype(keys.dtype)], axis=2)
            visible = mx.concatenate([mx.broadcast_to(visible, (B, L, visible.shape[1])), chosen], axis=-1)[:, None]
        mask = mx.where(visible, mx.array(0.0, dtype=q.dtype), mx.array(-mx.inf, dtype=q.dtype))

        out = mx.fast.scaled_dot_product_attention(
            q, keys, keys, scale=self.scale, mask=mask, sinks=self.attn_sink.astype(q.dtype)
        )
        # Values carry the keys' rotation; rotating back at the query position leaves each
        # entry's contribution a function of the relative distance only.
        out = self.rope(out, positions, inverse=True)
        out = self.grouped_output(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
        if self.sharding_group is not None:
            out = mx.distributed.all_sum(out, group=self.sharding_group)
        return self.wo_b(out)


def hyper_weights(
    x: mx.array, fn: mx.array, base: mx.array, scale: mx.array, args: ModelArgs
) -> tuple[mx.array, mx.array, mx.array]:
    """From the streams [B, L, N, D]: collapse weights `pre` [B, L, N], expand weights
    `post` [B, L, N] and the stream mixing `comb` [B, L, N, N], made doubly stochastic by
    Sinkhorn-Knopp."""
    B, L, N, D = x.shape
    flat = unweighted_rms_norm(x.reshape(B, L, N * D).astype(mx.float32), args.rms_norm_eps)
    mixes = flat @ fn.astype(mx.float32).T
    eps = args.hc_eps
    pre = mx.sigmoid(mixes[..., :N] * scale[0] + base[:N]) + eps
    post = 2 * mx.sigmoid(mixes[..., N : 2 * N] * scale[1] + base[N : 2 * N])
    comb = mixes[..., 2 * N :].reshape(B, L, N, N) * scale[2] + base[2 * N :].reshape(N, N)
    comb = mx.softmax(comb, axis=-1, precise=True) + eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(args.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    return pre, post, comb


class HyperConnection(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        mix = (2 + args.hc_mult) * args.hc_mult
        self.fn = mx.zeros((mix, args.hc_mult * args.hidden_size), dtype=mx.float32)
        self.base = mx.zeros((mix,), dtype=mx.float32)
        self.scale = mx.ones((3,), dtype=mx.float32)

    def __call__(self, streams: mx.array, block) -> mx.array:
        """Collapses the streams into the block's input and expands its output back."""
        pre, post, comb = hyper_weights(streams, self.fn, self.base, self.scale, self.args)
        dtype = streams.dtype
        out = block((pre[..., None] * streams).sum(axis=2).astype(dtype))
        return post.astype(dtype)[..., None] * out[:, :, None, :] + comb.astype(dtype).swapaxes(-1, -2) @ streams


class HyperHead(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.fn = mx.zeros((args.hc_mult, args.hc_mult * args.hidden_size), dtype=mx.float32)
        self.base = mx.zeros((args.hc_mult,), dtype=mx.float32)
        self.scale = mx.ones((1,), dtype=mx.float32)

    def __call__(self, streams: mx.array) -> mx.array:
        B, L, N, D = streams.shape
        flat = unweighted_rms_norm(streams.reshape(B, L, N * D).astype(mx.float32), self.args.rms_norm_eps)
        pre = mx.sigmoid((flat @ self.fn.astype(mx.float32).T) * self.scale + self.base) + self.args.hc_eps
        return (pre[..., None] * streams).sum(axis=2).astype(streams.dtype)


class LimitedSwiGLU(SwiGLU):
    """SwiGLU with the gate clipped from above and the up projection on both sides."""

    def __init__(self, limit: float):
        super().__init__()
        self.limit = limit

    def __call__(self, up: mx.array, gate: mx.array) -> mx.array:
        if self.limit:
            gate, up = mx.minimum(gate, self.limit), mx.clip(up, -self.limit, self.limit)
        return nn.silu(gate) * up


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.activation = LimitedSwiGLU(swiglu_limit)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.activation(self.up_proj(x), self.gate_proj(x)))


class MoEGate(nn.Module):
    """Picks experts by the learned scores plus a correction bias, or, on hash layers, by
    the token id; either way weights them by the scores, normalised and scaled."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.scoring_func = args.scoring_func
        self.routed_scaling_factor = args.routed_scaling_factor
        self.weight = mx.zeros((args.n_routed_experts, args.hidden_size))
        assert args.mlp_layer_types is not None, "set by __post_init__"
        if args.mlp_layer_types[layer_idx] == "hash_moe":
            # Checkpoints bring the table; spread tokens over experts until then.
            ids = mx.arange(args.vocab_size)[:, None] * self.top_k + mx.arange(self.top_k)
            self.tid2eid = (ids % args.n_routed_experts).astype(mx.int32)
        else:
            self.e_score_correction_bias = mx.zeros((args.n_routed_experts,), dtype=mx.float32)

    def __call__(self, x: mx.array, input_ids: mx.array) -> tuple[mx.array, mx.array]:
        scores = router_scores((x @ self.weight.T).astype(mx.float32), self.scoring_func)
        if "tid2eid" in self:
            inds = self.tid2eid[input_ids].astype(mx.int32)
        else:
            biased = scores + self.e_score_correction_bias
            inds = mx.argpartition(-biased, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        weights = mx.take_along_axis(scores, inds, axis=-1)
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return inds, weights * self.routed_scaling_factor


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.gate = MoEGate(args, layer_idx)
        self.switch_mlp = SwitchGLU(
            args.hidden_size,
            args.moe_intermediate_size,
            args.n_routed_experts,
            activation=LimitedSwiGLU(args.swiglu_limit),
        )
        self.shared_experts = MLP(
            args.hidden_size, args.moe_intermediate_size * args.n_shared_experts, args.swiglu_limit
        )
        self.sharding_group: mx.distributed.Group | None = None

    def __call__(self, x: mx.array, input_ids: mx.array) -> mx.array:
        inds, weights = self.gate(x, input_ids)
        y = self.switch_mlp(x, inds)
        y = (y * weights[..., None].astype(y.dtype)).sum(axis=-2) + self.shared_experts(x)
        if self.sharding_group is not None:
            y = mx.distributed.all_sum(y, group=self.sharding_group)
        return y


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.attn = Attention(args, layer_idx)
        self.attn_hc = HyperConnection(args)
        self.ffn_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.ffn = MoE(args, layer_idx)
        self.ffn_hc = HyperConnection(args)

    def __call__(self, streams: mx.array, cache: DeepseekV4Cache, input_ids: mx.array) -> mx.array:
        streams = self.attn_hc(streams, lambda x: self.attn(self.attn_norm(x), cache))
        return self.ffn_hc(streams, lambda x: self.ffn(self.ffn_norm(x), input_ids))


class DeepseekV4Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.hc_head = HyperHead(args)

    def __call__(
        self, inputs: mx.array, cache: list[DeepseekV4Cache] | None = None, input_embeddings: mx.array | None = None
    ) -> mx.array:
        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
        B, L, D = h.shape
        streams = mx.broadcast_to(h[:, :, None, :], (B, L, self.args.hc_mult, D))
        if cache is None:
            cache = [DeepseekV4Cache(self.args.sliding_window) for _ in self.layers]
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            streams = layer(streams, layer_cache, inputs)
        return self.norm(self.hc_head(streams))


def shard_heads(attn: Attention, group: mx.distributed.Group) -> None:
    """Keeps this rank's share of every output group's heads, in group order."""
    N, rank = group.size(), group.rank()
    per_group = attn.n_heads // attn.o_groups
    if per_group % N:
        raise ValueError(f"{per_group} heads per output group do not split over {N} ranks")
    local = per_group // N

    def own(w: mx.array, width: int) -> mx.array:
        w = w.reshape(attn.o_groups, per_group, width, *w.shape[1:])
        return mx.contiguous(w[:, rank * local : (rank + 1) * local].reshape(-1, *w.shape[3:]))

    attn.wq_b.update(tree_map(lambda w: own(w, attn.head_dim), attn.wq_b.parameters()))
    attn.attn_sink = own(attn.attn_sink, 1)
    attn.n_heads = attn.o_groups * local
    shard_inplace(attn.wo_a, "sharded-to-all", group=group)
    attn.sharding_group = group


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = DeepseekV4Model(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(
        self, inputs: mx.array, cache: list[DeepseekV4Cache] | None = None, input_embeddings: mx.array | None = None
    ) -> mx.array:
        return self.lm_head(self.model(inputs, cache, input_embeddings))

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    def make_cache(self) -> list[DeepseekV4Cache]:
        return [DeepseekV4Cache(self.args.sliding_window) for _ in self.layers]

    @property
    def cast_predicate(self):
        # Kept in float32 as the reference keeps them: stream mixing, sinks, router bias.
        kept = ("attn_sink", "e_score_correction_bias", "_hc.", "hc_head.", "tid2eid")
        return lambda name: not any(part in name for part in kept)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """DeepSeek's layout (`layers.N.attn.wq_a`, `embed`, `head`, `hc_attn_fn`, experts
        one by one as w1/w2/w3, FP8 / FP4 with block scales), also as transformers saves
        it under `model.`, onto the mlx-community names; mlx-community checkpoints pass
        through unchanged."""
        n_layers = self.args.num_hidden_layers
        # DeepSeek's own checkpoints ship FP8 weights and FP4 routed experts, each with a
        # `.scale` beside it; mlx works on the dequantized (bfloat16) weights.
        dequantized: dict[str, mx.array] = {}
        for name, value in weights.items():
            if name.endswith(".scale") and name.removesuffix("scale") + "weight" in weights:
                continue
            scale = weights.get(name.removesuffix("weight") + "scale") if name.endswith(".weight") else None
            if scale is not None and value.dtype in (mx.uint8, mx.int8):
                fp4 = ".experts." in name and scale.shape[-1] * 16 == value.shape[-1]
                value = dequantize_fp4(value, scale) if fp4 else dequantize_fp8(value, scale)
            dequantized[name] = value

        renamed: dict[str, mx.array] = {}
        for name, value in dequantized.items():
            name = name.removeprefix("model.")
            parts = name.split(".")
            if parts[0] == "mtp" or (parts[0] == "layers" and int(parts[1]) >= n_layers):
                continue  # multi-token prediction layers are not used
            name = {"embed.weight": "embed_tokens.weight", "head.weight": "lm_head.weight"}.get(name, name)
            for short, full in (("hc_head_", "hc_head."), ("hc_head.hc_", "hc_head.")):
                if name.startswith(short):
                    name = full + name.removeprefix(short)
            for block in ("attn", "ffn"):
                for param in ("fn", "base", "scale"):
                    name = name.replace(f".hc_{block}_{param}", f".{block}_hc.{param}")
            name = name.replace(".attn.norm.", ".attn.kv_norm.").replace(".gate.bias", ".gate.e_score_correction_bias")
            for short, full in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
                name = name.replace(f".shared_experts.{short}.", f".shared_experts.{full}.")
            if name.endswith("tid2eid"):
                value = value.astype(mx.int32)
            # lm_head stays outside `model.`, with its quantization scales and biases.
            renamed[name if name.startswith("lm_head.") else f"model.{name}"] = value

        for i in range(n_layers):
            prefix = f"model.layers.{i}.ffn"
            for short, full in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
                if f"{prefix}.experts.0.{short}.weight" in renamed:
                    experts = [
                        renamed.pop(f"{prefix}.experts.{e}.{short}.weight") for e in range(self.args.n_routed_experts)
                    ]
                    renamed[f"{prefix}.switch_mlp.{full}.weight"] = mx.stack(experts)
        return renamed

    def shard(self, group: mx.distributed.Group | None = None) -> None:
        """Tensor parallelism. Each rank keeps an equal share of the heads of every output
        group, so its heads still form `o_groups` groups for wo_a (whose input columns
        are split to match); the partial wo_a outputs are summed once before wo_b. The
        single key/value head, compressors and indexer stay whole. MoE and shared
        experts split their intermediate size and sum once; routing (by learned scores
        or token id) is the same on every rank."""
        group = group or mx.distributed.init()
        for layer in self.layers:
            shard_heads(layer.attn, group)
            ffn = layer.ffn
            for mlp in (ffn.switch_mlp, ffn.shared_experts):
                shard_inplace(mlp.gate_proj, "all-to-sharded", group=group)
                shard_inplace(mlp.up_proj, "all-to-sharded", group=group)
                shard_inplace(mlp.down_proj, "sharded-to-all", group=group)
            ffn.sharding_group = group
