"""An HF-layout model dir (transformers' or MLX's safetensors) as a GGUF llama.cpp loads,
converted once and cached, at the checkpoint's own precision: f32 stays F32, bf16 BF16,
f16 F16; MLX affine 4-bit keeps its codes, as Q4_K (scales and mins rounded to 6 bits
per 256-block; llama.cpp's fast kernels) where its rows allow, else as Q4_1 (codes,
scales and biases exactly: gguf_tensors.py); MLX 8-bit becomes Q8_0, the nearest ggml
type. Norms,
biases and rope factors are F32, as llama.cpp's own converter writes them.

Facts taken from llama.cpp's convert_hf_to_gguf.py (not its code): llama.cpp's LLAMA
architecture rotates q and k by interleaved pairs, so their rows are permuted from HF's
half-split order; Llama 3's rope scaling is a `rope_freqs` tensor of per-frequency
factors; Qwen rotates by halves (no permutation). No MLX and no torch here: numpy,
the gguf package and the tokenizers library."""

import fcntl
import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGML_QUANT_VERSION,
    MODEL_ARCH,
    MODEL_ARCH_NAMES,
    MODEL_TENSOR,
    TENSOR_NAMES,
    ExpertGatingFuncType,
    GGMLQuantizationType,
    GGUFWriter,
    LlamaFileType,
    RopeScalingType,
    TensorNameMap,
    get_tensor_name_map,
)

from exo.engine.llamacpp.gguf_tensors import (
    Affine,
    Tensor,
    dequantize_affine,
    ggml_quantized,
    q4_k_fits,
    read_safetensors,
)
from exo.engine.llamacpp.gguf_vocab import TOKENIZER_FILES, vocab_refusal, write_vocab

# Bumped whenever the converter writes different bytes for the same checkpoint, so
# caches made by an older one are converted again.
CONVERTER_VERSION = 3

_ARCHS = {
    "llama": MODEL_ARCH.LLAMA,
    "qwen2": MODEL_ARCH.QWEN2,
    "qwen3": MODEL_ARCH.QWEN3,
    "qwen3_moe": MODEL_ARCH.QWEN3MOE,
    "glm4_moe": MODEL_ARCH.GLM4_MOE,
    "minimax_m2": MODEL_ARCH.MINIMAXM2,
    # DeepSeek's MLA with MoE: V3, Kimi K2 and GLM-4.7-Flash are the same model to llama.cpp.
    "deepseek_v3": MODEL_ARCH.DEEPSEEK2,
    "kimi_k2": MODEL_ARCH.DEEPSEEK2,
    "glm4_moe_lite": MODEL_ARCH.DEEPSEEK2,
}
_MLA = {"deepseek_v3", "kimi_k2", "glm4_moe_lite"}
# Families exo serves that stay on MLX, and why.
_NOT_CONVERTED = {
    # transformers follows the reference (rope_scaling truncate: false); in gpt-oss-20b
    # one rotary pair turns 3% off, 0.2 rad by position 1000.
    "gpt_oss": "llama.cpp rounds YaRN's correction range to whole dims, gpt-oss' reference does not",
    "deepseek_v32": "llama.cpp's deepseek32 architecture is newer than the gguf writer here (gguf 0.19)",
    "deepseek_v4": "llama.cpp's deepseek4 architecture is newer than the gguf writer here (gguf 0.19)",
    "gemma4": "Gemma 4's conversion is not built (its published checkpoints take images, which need MLX)",
}
_ROPE_TYPES = {None, "default", "linear", "yarn", "llama3"}
_FLOAT_TYPES = {
    "F32": GGMLQuantizationType.F32,
    "F16": GGMLQuantizationType.F16,
    "BF16": GGMLQuantizationType.BF16,
}
_FILE_TYPES = {
    GGMLQuantizationType.Q4_K: LlamaFileType.MOSTLY_Q4_K_M,
    GGMLQuantizationType.Q4_1: LlamaFileType.MOSTLY_Q4_1,
    GGMLQuantizationType.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    GGMLQuantizationType.BF16: LlamaFileType.MOSTLY_BF16,
    GGMLQuantizationType.F16: LlamaFileType.MOSTLY_F16,
}
_SKIPPED_SUFFIXES = (".scales", ".biases", "rotary_emb.inv_freq")

Progress = Callable[[int, int], None]


# --- what can be converted -------------------------------------------------------------


_QUANTIZED = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)


def exact_q4() -> bool:
    """EXO_GGUF_EXACT_Q4=1 writes MLX 4-bit as Q4_1 (bit for bit) even where Q4_K
    (6-bit scales, llama.cpp's fast kernels) holds it."""
    return os.environ.get("EXO_GGUF_EXACT_Q4", "0") == "1"


def _rope_scaling(config: dict) -> dict:
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    return scaling if scaling.get("rope_type", scaling.get("type")) not in (None, "default") else {}


def _rope_type(config: dict) -> str | None:
    scaling = _rope_scaling(config)
    return scaling.get("rope_type", scaling.get("type")) if scaling else None


def _quantization_reason(quantization: dict) -> str | None:
    entries = [quantization] + [v for v in quantization.values() if isinstance(v, dict)]
    for entry in entries:
        mode, bits, group = entry.get("mode", "affine"), entry.get("bits"), entry.get("group_size")
        if mode != "affine":
            return f"MLX {mode} quantization has no ggml mapping here (affine 4 and 8 bits do)"
        if bits == 4 and isinstance(group, int) and group % 32 == 0:
            continue
        if bits == 8:
            continue
        return f"MLX affine {bits}-bit with groups of {group} has no ggml mapping (4-bit in groups of 32k, or 8-bit)"
    return None


def supports(config: dict) -> str | None:
    """None when gguf_for can convert a checkpoint of this config.json, else why not."""
    model_type = config.get("model_type")
    if model_type in _NOT_CONVERTED:
        return f"{model_type} is not converted: {_NOT_CONVERTED[model_type]}"
    if model_type not in _ARCHS:
        return f"GGUF conversion covers {', '.join(_ARCHS)}, not {model_type}"
    if "quantization" in config:
        if (reason := _quantization_reason(config["quantization"])) is not None:
            return reason
    elif "quantization_config" in config:
        method = config["quantization_config"].get("quant_method", "unknown")
        return f"a {method}-quantized checkpoint cannot be converted (only float and MLX affine ones)"
    if (rope := _rope_type(config)) not in _ROPE_TYPES:
        return f"rope scaling {rope} is not converted"
    if config.get("use_sliding_window"):
        return "sliding-window attention is not converted"
    if model_type == "qwen3_moe":
        # Refused only when the config says so: a card's partial config does not carry it.
        if config.get("norm_topk_prob") is False:
            return "llama.cpp's qwen3moe always renormalizes the top-k router weights; this config does not"
        if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
            return "llama.cpp's qwen3moe wants every layer MoE"
    if model_type in _MLA and "quantization" in config:
        # mlx-lm splits kv_b_proj into its own embed_q / unembed_out, quantized per head.
        return "an MLX-quantized MLA checkpoint (DeepSeek V3, Kimi K2) is not converted; float ones are"
    if model_type == "minimax_m2" and config.get("scoring_func", "sigmoid") not in ("sigmoid", "softmax"):
        return f"llama.cpp's minimax-m2 routes by sigmoid or softmax, not {config['scoring_func']}"
    if model_type == "glm4_moe" and config.get("n_group", 1) > 1 and config.get("topk_group", 1) < config["n_group"]:
        return "llama.cpp's glm4moe routes without expert groups; this config limits them"
    return None


# --- the GGUF's keys -------------------------------------------------------------------


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _write_hparams(writer: GGUFWriter, config: dict) -> None:
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    # MLA caches one latent per token, which llama.cpp models as a single KV head.
    mla = config["model_type"] in _MLA
    writer.add_head_count_kv(1 if mla else config.get("num_key_value_heads") or config["num_attention_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    theta = config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    writer.add_rope_freq_base(float(theta))
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if config["model_type"] == "qwen3_moe":
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config["model_type"] == "glm4_moe":
        _write_glm4_moe(writer, config)
    if config["model_type"] == "minimax_m2":
        _write_minimax_m2(writer, config)
    if mla:
        _write_mla(writer, config)
    if config["model_type"] == "llama":
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(_head_dim(config))
    scaling = _rope_scaling(config)
    rope = _rope_type(config)
    if rope == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    elif rope == "yarn":
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        if "beta_fast" in scaling:
            writer.add_rope_scaling_yarn_beta_fast(float(scaling["beta_fast"]))
        if "beta_slow" in scaling:
            writer.add_rope_scaling_yarn_beta_slow(float(scaling["beta_slow"]))


def _write_glm4_moe(writer: GGUFWriter, config: dict) -> None:
    # The MTP layers (num_nextn_predict_layers) are left out: exo does not draft with them.
    writer.add_rope_dimension_count(int(_head_dim(config) * config.get("partial_rotary_factor", 0.5)))
    writer.add_expert_count(config["n_routed_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_count(config.get("n_shared_experts", 0))
    writer.add_leading_dense_block_count(config.get("first_k_dense_replace", 0))
    writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_scale(float(config.get("routed_scaling_factor", 1.0)))
    writer.add_expert_weights_norm(bool(config.get("norm_topk_prob", True)))


def _write_minimax_m2(writer: GGUFWriter, config: dict) -> None:
    # Every layer is MoE, its experts intermediate_size wide; rope covers rotary_dim of
    # each head; q and k are normed over all heads at once (q_norm is heads * head_dim).
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    writer.add_rope_dimension_count(config["rotary_dim"])
    sigmoid = config.get("scoring_func", "sigmoid") == "sigmoid"
    writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID if sigmoid else ExpertGatingFuncType.SOFTMAX)


def _write_mla(writer: GGUFWriter, config: dict) -> None:
    """DeepSeek's attention: keys are the latent and the rope part, values the latent;
    the per-head sizes (the _mla keys) are for decompressing them."""
    kv_lora, rope, nope = config["kv_lora_rank"], config["qk_rope_head_dim"], config["qk_nope_head_dim"]
    writer.add_vocab_size(config["vocab_size"])
    if config.get("q_lora_rank"):
        writer.add_q_lora_rank(config["q_lora_rank"])
    writer.add_kv_lora_rank(kv_lora)
    writer.add_key_length(kv_lora + rope)
    writer.add_value_length(kv_lora)
    writer.add_key_length_mla(nope + rope)
    writer.add_value_length_mla(config["v_head_dim"])
    writer.add_rope_dimension_count(rope)
    writer.add_leading_dense_block_count(config.get("first_k_dense_replace", 0))
    writer.add_expert_count(config["n_routed_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_count(config.get("n_shared_experts") or 0)
    writer.add_expert_weights_scale(float(config.get("routed_scaling_factor", 1.0)))
    if config.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    sigmoid = config.get("scoring_func", "softmax") == "sigmoid"
    writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID if sigmoid else ExpertGatingFuncType.SOFTMAX)
    if (groups := config.get("n_group") or 1) > 1:
        writer.add_expert_group_count(groups)
        writer.add_expert_group_used_count(config["topk_group"])
    if (mscale_all_dim := _rope_scaling(config).get("mscale_all_dim")) is not None:
        writer.add_rope_scaling_yarn_log_mul(0.1 * mscale_all_dim)


def _llama3_rope_factors(config: dict) -> np.ndarray:
    """Llama 3's per-frequency rope divisors (transformers' _compute_llama3_parameters)."""
    scaling = _rope_scaling(config)
    dim = _head_dim(config)
    theta = config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = scaling["factor"], scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


# --- the tensors -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Planned:
    """One GGUF tensor: its name, type, shape as the writer takes it, and its bytes later."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    nbytes: int
    make: Callable[[], np.ndarray]


def _permute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotate-half order per head to llama.cpp's interleaved pairs (rows only)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _row_fix(config: dict, name: str) -> Callable[[np.ndarray], np.ndarray]:
    if config["model_type"] != "llama":
        return lambda rows: rows
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return lambda rows: _permute_rows(rows, config["num_attention_heads"])
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        heads = config.get("num_key_value_heads") or config["num_attention_heads"]
        return lambda rows: _permute_rows(rows, heads)
    return lambda rows: rows


def _quantization_of(config: dict, name: str) -> tuple[int, int]:
    quantization = config["quantization"]
    entry = quantization.get(name.removesuffix(".weight"))
    entry = entry if isinstance(entry, dict) else quantization
    return entry["bits"], entry["group_size"]


def _plan_quantized(config: dict, name: str, tensors: dict[str, Tensor], gguf_name: str, widen: bool) -> _Planned:
    base = name.removesuffix(".weight")
    bits, group = _quantization_of(config, name)
    weight, scales, biases = tensors[name], tensors[base + ".scales"], tensors[base + ".biases"]
    fix = _row_fix(config, name)
    in_features = weight.shape[-1] * 32 // bits

    def affine() -> Affine:
        return Affine(fix(weight.raw()), fix(scales.as_float32()), fix(biases.as_float32()), bits, group)

    if widen or gguf_name.endswith("ffn_gate_inp.weight"):
        # A router picks experts: widened exactly to F32 (it is small), not requantized.
        shape = (*weight.shape[:-1], in_features)
        return _Planned(gguf_name, GGMLQuantizationType.F32, shape, 4 * math.prod(shape),
                        lambda: dequantize_affine(affine()))  # fmt: skip

    exact = exact_q4()
    if bits == 8:
        ggml_type = GGMLQuantizationType.Q8_0
    elif not exact and q4_k_fits(scales.as_float32(), biases.as_float32(), group):
        ggml_type = GGMLQuantizationType.Q4_K
    else:
        ggml_type = GGMLQuantizationType.Q4_1

    def make() -> np.ndarray:
        data, made = ggml_quantized(affine(), exact)
        assert made == ggml_type, f"{gguf_name}: planned {ggml_type.name}, made {made.name}"
        return data

    block, size = GGML_QUANT_SIZES[ggml_type]
    shape = (*weight.shape[:-1], in_features // block * size)
    return _Planned(gguf_name, ggml_type, shape, math.prod(shape), make)


def _plan_float(config: dict, name: str, tensor: Tensor, gguf_name: str) -> _Planned:
    fix = _row_fix(config, name)
    # A router in F32 too: ggml would round the activations to bf16 for a bf16 one, and
    # that is enough to pick other experts.
    if len(tensor.shape) == 1 or tensor.dtype not in _FLOAT_TYPES or gguf_name.endswith("ffn_gate_inp.weight"):
        return _Planned(
            gguf_name,
            GGMLQuantizationType.F32,
            tensor.shape,
            4 * math.prod(tensor.shape),
            lambda: fix(tensor.as_float32()),
        )
    ggml_type = _FLOAT_TYPES[tensor.dtype]
    itemsize = 4 if ggml_type == GGMLQuantizationType.F32 else 2
    return _Planned(gguf_name, ggml_type, tensor.shape, itemsize * math.prod(tensor.shape), lambda: fix(tensor.raw()))


_EXPERT = re.compile(r"(.*)\.experts\.(\d+)\.(\w+\.weight)$")


def _plan_stacked(name: str, experts: list[Tensor], gguf_name: str) -> _Planned:
    """One expert tensor per expert (transformers' layout) as one stacked GGUF tensor."""
    first = experts[0]
    shape = (len(experts), *first.shape)
    if first.dtype not in _FLOAT_TYPES or any(e.shape != first.shape or e.dtype != first.dtype for e in experts):
        raise ValueError(f"{name}: experts of different shapes or types")
    ggml_type = _FLOAT_TYPES[first.dtype]
    itemsize = 4 if ggml_type == GGMLQuantizationType.F32 else 2
    return _Planned(gguf_name, ggml_type, shape, itemsize * math.prod(shape),
                    lambda: np.stack([e.raw() for e in experts]))  # fmt: skip


def _stack_experts(tensors: dict[str, Tensor]) -> dict[str, list[Tensor]]:
    """Per-expert names (mlp.experts.E.gate_proj.weight, MiniMax's block_sparse_moe.experts.E.w1.weight)
    grouped under the stacked name (mlp.experts.gate_proj.weight)."""
    groups: dict[str, dict[int, Tensor]] = {}
    for name, tensor in tensors.items():
        if match := _EXPERT.match(name):
            groups.setdefault(f"{match[1]}.experts.{match[3]}", {})[int(match[2])] = tensor
    return {name: [by_id[i] for i in sorted(by_id)] for name, by_id in groups.items()}


def _plan_kv_b(config: dict, tensor: Tensor, name: str, names: TensorNameMap) -> Iterator[_Planned]:
    """MLA's kv_b_proj as llama.cpp's two halves: k_b (per head, latent x nope, for
    absorbing into the query) and v_b (per head, v x latent)."""
    heads, nope, v = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
    kv_lora = tensor.shape[-1]
    ggml_type = _FLOAT_TYPES.get(tensor.dtype, GGMLQuantizationType.F32)
    itemsize = 4 if ggml_type == GGMLQuantizationType.F32 else 2

    def per_head() -> np.ndarray:
        rows = tensor.raw() if tensor.dtype in _FLOAT_TYPES else tensor.as_float32()
        return rows.reshape(heads, nope + v, kv_lora)

    for part, shape, make in (
        ("k_b_proj", (heads, kv_lora, nope), lambda: per_head()[:, :nope, :].transpose(0, 2, 1)),
        ("v_b_proj", (heads, v, kv_lora), lambda: per_head()[:, nope:, :]),
    ):
        gguf_name = _gguf_name(names, name.replace("kv_b_proj", part), config)
        yield _Planned(gguf_name, ggml_type, shape, itemsize * math.prod(shape), make)


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _beyond_the_stack(config: dict, name: str) -> bool:
    """A layer past num_hidden_layers: GLM's MTP layer, which the GGUF leaves out."""
    match = _LAYER.match(name)
    return match is not None and int(match[1]) >= config["num_hidden_layers"]


def _plan(config: dict, tensors: dict[str, Tensor], widen: bool) -> Iterator[_Planned]:
    arch = _ARCHS[config["model_type"]]
    names = get_tensor_name_map(arch, config["num_hidden_layers"])
    tied = config.get("tie_word_embeddings", False)
    tensors = {name: tensor for name, tensor in tensors.items() if not _beyond_the_stack(config, name)}
    for name, experts in _stack_experts(tensors).items():
        yield _plan_stacked(name, experts, _gguf_name(names, name, config))
    for name in tensors:
        if name.endswith(_SKIPPED_SUFFIXES) or (tied and name.startswith("lm_head.")) or _EXPERT.match(name):
            continue
        if name.endswith("kv_b_proj.weight") and config["model_type"] in _MLA:
            yield from _plan_kv_b(config, tensors[name], name, names)
            continue
        gguf_name = _gguf_name(names, name, config)
        if name.endswith(".weight") and name.removesuffix(".weight") + ".scales" in tensors:
            yield _plan_quantized(config, name, tensors, gguf_name, widen)
        else:
            yield _plan_float(config, name, tensors[name], gguf_name)
    if _rope_type(config) == "llama3":
        factors = _llama3_rope_factors(config)
        yield _Planned(
            TENSOR_NAMES[MODEL_TENSOR.ROPE_FREQS] + ".weight",
            GGMLQuantizationType.F32,
            factors.shape,
            factors.nbytes,
            lambda: factors,
        )


# mlx-lm's names for MiniMax's stacked experts, and the checkpoint's.
_MINIMAX_EXPERTS = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def _gguf_name(names: TensorNameMap, name: str, config: dict) -> str:
    # mlx-lm stacks experts as mlp.switch_mlp.*; transformers' stacked name is mlp.experts.*.
    # The router's correction bias is named as a bias for the name map.
    name = name.replace(".mlp.switch_mlp.", ".mlp.experts.")
    name = name.replace("e_score_correction_bias", "e_score_correction.bias")
    # mlx-lm's MLA halves are already llama.cpp's k_b and v_b (per head, same layout).
    name = name.replace(".self_attn.embed_q.", ".self_attn.k_b_proj.")
    name = name.replace(".self_attn.unembed_out.", ".self_attn.v_b_proj.")
    for mlx_name, hf_name in _MINIMAX_EXPERTS.items():
        name = name.replace(f".block_sparse_moe.switch_mlp.{mlx_name}.", f".block_sparse_moe.experts.{hf_name}.")
    gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
    if gguf_name is None:
        raise ValueError(f"tensor {name} has no GGUF name for {config['model_type']}")
    return gguf_name


def _file_type(plan: list[_Planned]) -> LlamaFileType:
    kinds = {p.ggml_type for p in plan}
    return next((_FILE_TYPES[k] for k in _FILE_TYPES if k in kinds), LlamaFileType.ALL_F32)


# --- conversion and cache --------------------------------------------------------------


def _weight_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no .safetensors files")
    return files


def convert(model_dir: Path, out: Path, on_progress: Progress | None = None, *, widen: bool = False) -> None:
    """Write the GGUF of `model_dir` at `out`. With `widen`, MLX-quantized weights are
    written as F32, exactly dequantized: for checks, since llama.cpp's quantized CPU
    matmuls also round the activations to 8 bits (Q8_0 / Q8_1 blocks)."""
    config = json.loads((model_dir / "config.json").read_text())
    if (reason := supports(config) or vocab_refusal(model_dir)) is not None:
        raise ValueError(f"{model_dir.name}: {reason}")
    plan = list(_plan(config, read_safetensors(_weight_files(model_dir)), widen))
    writer = GGUFWriter(out, MODEL_ARCH_NAMES[_ARCHS[config["model_type"]]])
    writer.add_name(model_dir.name)
    _write_hparams(writer, config)
    file_type = _file_type(plan)
    writer.add_file_type(file_type)
    if file_type in (LlamaFileType.MOSTLY_Q4_K_M, LlamaFileType.MOSTLY_Q4_1, LlamaFileType.MOSTLY_Q8_0):
        writer.add_quantization_version(GGML_QUANT_VERSION)
    write_vocab(writer, model_dir, config["vocab_size"])
    for p in plan:
        dtype = np.uint8 if p.ggml_type in _QUANTIZED else np.float32
        writer.add_tensor_info(p.name, p.shape, np.dtype(dtype), p.nbytes, raw_dtype=p.ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    total, done = sum(p.nbytes for p in plan), 0
    for p in plan:
        data = np.ascontiguousarray(p.make())
        if data.nbytes != p.nbytes:
            raise AssertionError(f"{p.name}: made {data.nbytes} bytes, planned {p.nbytes}")
        writer.write_tensor_data(data)
        done += p.nbytes
        if on_progress is not None:
            on_progress(done, total)
    writer.close()


def _cache_key(model_dir: Path) -> str:
    """The converter's version and the name, size and mtime of every file it reads."""
    files = _weight_files(model_dir) + [model_dir / n for n in ("config.json", *TOKENIZER_FILES)]
    digest = hashlib.sha256(f"exo-gguf-{CONVERTER_VERSION}-exact-q4={exact_q4()}".encode())
    for path in files:
        if path.is_file():
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return digest.hexdigest()[:16]


def cache_prefix(model_dir: Path) -> str:
    """What every cached file of `model_dir` is named from: its name and a hash of its path."""
    model_dir = model_dir.resolve()
    return f"{model_dir.name}-{hashlib.sha256(str(model_dir).encode()).hexdigest()[:8]}-"


def cache_stem(model_dir: Path) -> str:
    """The name of `model_dir`'s cached GGUF without its suffix: it changes with the
    converter's version and the dir's files."""
    return cache_prefix(model_dir) + _cache_key(model_dir.resolve())


def gguf_for(model_dir: Path, cache_dir: Path, on_progress: Progress | None = None) -> Path:
    """The GGUF of `model_dir`, converted on first use into `cache_dir` and reused while
    the dir's files are unchanged. Other conversions of the same dir are removed once a
    new one is complete; two processes asking at once convert once (a file lock)."""
    model_dir = model_dir.resolve()
    cache_dir.mkdir(parents=True, exist_ok=True)
    prefix = cache_prefix(model_dir)
    path = cache_dir / f"{cache_stem(model_dir)}.gguf"
    with (cache_dir / f"{prefix}lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.is_file():
            partial = path.with_suffix(".partial")
            convert(model_dir, partial, on_progress)
            os.replace(partial, path)
            # Older GGUFs, and llama.cpp's refusals of older files (support.py's records).
            for old in [*cache_dir.glob(f"{prefix}*.gguf"), *cache_dir.glob(f"{prefix}*.refused")]:
                if old != path:
                    old.unlink()
    return path
