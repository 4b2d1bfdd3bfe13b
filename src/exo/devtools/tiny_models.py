"""Small HF-layout models made on the spot, for tests and benchmarks on machines with
no model hub: a BPE tokenizer trained on a few generated sentences, a chat template,
and a model of any mlx-lm architecture with random weights.

`TINY_CONFIGS` holds, per architecture, the structure of a real config.json (same keys,
same layer pattern, MoE routing, attention variant) shrunk to a few layers of width 64,
with head, expert and vocabulary sizes divisible by 4, so the model splits 1, 2 or 4 ways
by pipeline and, where mlx-lm has a Model.shard for the architecture, by tensor
parallelism. `make_tiny(path, name)` writes one."""

import copy
import json
import random
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from mlx_lm.utils import _get_classes
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]


def _training_sentences(count: int = 400) -> list[str]:
    rng = random.Random(0)
    words = "the a cat dog sun moon runs sleeps bright quiet over under cluster node model token fast slow".split()
    return [" ".join(rng.choice(words) for _ in range(12)) for _ in range(count)]


def write_tokenizer(path: Path, vocab_size: int = 512, pad_to_multiple_of: int = 1) -> None:
    """A byte-level BPE tokenizer trained on a few sentences. The small corpus yields fewer
    merges than `vocab_size` asks for; `pad_to_multiple_of` fills the vocabulary up with
    reserved special tokens, as real models do, so it splits evenly across ranks."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_training_sentences(), trainer)
    missing = -tokenizer.get_vocab_size() % pad_to_multiple_of
    tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|end|>",
        "pad_token": "<|end|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 4096,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _is_float(array: mx.array) -> bool:
    return mx.issubdtype(array.dtype, mx.floating)


def _random_weights(model, seed: int, perturb_constants: bool) -> dict[str, mx.array]:
    """The model's own random init, halved so logits stay well spread but small.

    mlx initialises norms to ones and biases such as attention sinks or router
    correction biases to zeros; a wrong split of a constant goes unnoticed, so with
    `perturb_constants` every constant tensor gets a little noise of its own."""
    params = tree_map(lambda p: p * 0.5 if isinstance(p, mx.array) and _is_float(p) else p, model.parameters())
    if perturb_constants:
        key = mx.random.key(seed + 1)
        flat = []
        for name, p in tree_flatten(params):
            if isinstance(p, mx.array) and _is_float(p) and p.size > 0 and bool(mx.all(p == p.reshape(-1)[0])):
                key, sub = mx.random.split(key)
                scale = 0.1 * max(abs(float(p.reshape(-1)[0].item())), 0.2)
                p = p + scale * mx.random.normal(p.shape, key=sub).astype(p.dtype)
            flat.append((name, p))
        params = tree_unflatten(flat)
    model.update(params)
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    return weights


def _set_vocab_size(config: dict, vocab_size: int) -> None:
    config["vocab_size"] = vocab_size
    if isinstance(config.get("text_config"), dict):
        config["text_config"]["vocab_size"] = vocab_size


def make_tiny_model(
    path: Path,
    model_type: str,
    config: dict,
    dtype: mx.Dtype = mx.float32,
    seed: int = 0,
    *,
    perturb_constants: bool = True,
    pad_vocab_to_multiple_of: int = 64,
) -> Path:
    """Writes a random model of mlx-lm architecture `model_type` at `path` (config.json,
    model.safetensors in mlx layout, tokenizer) and returns it. `config` is a real
    config.json's structure; its vocab_size becomes the tokenizer's actual size."""
    path = Path(path)
    config = copy.deepcopy(config)
    config["model_type"] = model_type
    wanted_vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or 512
    write_tokenizer(path, wanted_vocab, pad_vocab_to_multiple_of)
    _set_vocab_size(config, Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size())
    config["torch_dtype"] = "float32" if dtype == mx.float32 else "bfloat16"
    if isinstance(config.get("text_config"), dict):
        config["text_config"]["torch_dtype"] = config["torch_dtype"]

    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(copy.deepcopy(config)))
    model.set_dtype(dtype)
    weights = _random_weights(model, seed, perturb_constants)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def make_tiny_llama(
    path: Path,
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    dtype: mx.Dtype = mx.float32,
    seed: int = 0,
) -> Path:
    """Writes a random Llama model dir at `path` and returns it."""
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    # Constants and vocabulary left as they are: the same files as before make_tiny_model.
    return make_tiny_model(
        path, "llama", config, dtype=dtype, seed=seed, perturb_constants=False, pad_vocab_to_multiple_of=1
    )


def make_tiny(path: Path, name: str, dtype: mx.Dtype = mx.float32, seed: int = 0) -> Path:
    """The tiny model `TINY_CONFIGS[name]` written at `path`."""
    config = TINY_CONFIGS[name]
    model_type = config["model_type"]
    return make_tiny_model(path, model_type, config, dtype=dtype, seed=seed)


# --- tiny configs ------------------------------------------------------------------------
# Each is the named model's config.json with the sizes cut down; keys mlx-lm ignores are
# kept, so the files look like the real ones. vocab_size is replaced by the tokenizer's.

_VOCAB = 512

TINY_CONFIGS: dict[str, dict] = {
    # Llama 3.2 1B.
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "num_attention_heads": 8,
        "num_hidden_layers": 4,
        "num_key_value_heads": 4,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "use_cache": True,
        "vocab_size": _VOCAB,
    },
    # Qwen2.5 0.5B: q/k/v biases, tied embeddings.
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 32768,
        "max_window_layers": 4,
        "num_attention_heads": 8,
        "num_hidden_layers": 4,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": _VOCAB,
    },
    # Qwen3 0.6B: per-head q/k norms, explicit head_dim.
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 40960,
        "max_window_layers": 4,
        "num_attention_heads": 8,
        "num_hidden_layers": 4,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": _VOCAB,
    },
    # Qwen3 30B-A3B: every layer MoE, softmax top-k routing, no shared expert.
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "decoder_sparse_step": 1,
        "eos_token_id": 1,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 40960,
        "max_window_layers": 4,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "num_attention_heads": 8,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 4,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": _VOCAB,
    },
    # DeepSeek V3: MLA (q and kv LoRA, decoupled rope), first layer dense, then sigmoid
    # group-limited routing over routed experts plus a shared expert, YaRN rope.
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "kv_lora_rank": 32,
        "max_position_embeddings": 163840,
        "moe_intermediate_size": 32,
        "moe_layer_freq": 1,
        "n_group": 2,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 4,
        "num_key_value_heads": 4,
        "num_nextn_predict_layers": 1,
        "q_lora_rank": 48,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "use_cache": True,
        "v_head_dim": 16,
        "vocab_size": _VOCAB,
    },
    # DeepSeek V3.2: DeepSeek V3 plus the lightning indexer picking the top-k keys per
    # query (top-k below the prompt length, so attention is really sparse).
    "deepseek_v32": {
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 64,
        "index_head_dim": 16,
        "index_n_heads": 4,
        "index_topk": 16,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "kv_lora_rank": 32,
        "max_position_embeddings": 163840,
        "moe_intermediate_size": 32,
        "moe_layer_freq": 1,
        "n_group": 2,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 4,
        "num_key_value_heads": 4,
        "num_nextn_predict_layers": 1,
        "q_lora_rank": 48,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "use_cache": True,
        "v_head_dim": 16,
        "vocab_size": _VOCAB,
    },
    # GLM 5: the DeepSeek V3.2 design (MLA + indexer + MoE) with GLM's sizes and rope.
    "glm_moe_dsa": {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "eos_token_id": [1],
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 64,
        "index_head_dim": 16,
        "index_n_heads": 4,
        "index_topk": 16,
        "indexer_rope_interleave": True,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "kv_lora_rank": 32,
        "max_position_embeddings": 202752,
        "moe_intermediate_size": 32,
        "moe_layer_freq": 1,
        "n_group": 1,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 4,
        "num_key_value_heads": 4,
        "num_nextn_predict_layers": 1,
        "pad_token_id": 1,
        "q_lora_rank": 48,
        "qk_nope_head_dim": 24,
        "qk_rope_head_dim": 8,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "use_cache": True,
        "v_head_dim": 32,
        "vocab_size": _VOCAB,
    },
    # GLM 4.7 Flash: MLA with wide value heads, first layer dense, then MoE.
    "glm4_moe_lite": {
        "architectures": ["Glm4MoeLiteForCausalLM"],
        "model_type": "glm4_moe_lite",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "eos_token_id": [1],
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "kv_lora_rank": 32,
        "max_position_embeddings": 202752,
        "moe_intermediate_size": 32,
        "moe_layer_freq": 1,
        "n_group": 1,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 4,
        "num_key_value_heads": 4,
        "num_nextn_predict_layers": 1,
        "pad_token_id": 1,
        "partial_rotary_factor": 1.0,
        "q_lora_rank": 48,
        "qk_nope_head_dim": 24,
        "qk_rope_head_dim": 8,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "routed_scaling_factor": 1.8,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "use_cache": True,
        "v_head_dim": 32,
        "vocab_size": _VOCAB,
    },
    # GLM 4.5: GQA with q/k norms and partial rope, first layer dense, sigmoid routing
    # with a shared expert.
    "glm4_moe": {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": [1],
        "first_k_dense_replace": 1,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 131072,
        "moe_intermediate_size": 32,
        "n_group": 1,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 4,
        "num_key_value_heads": 4,
        "num_nextn_predict_layers": 1,
        "pad_token_id": 1,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "routed_scaling_factor": 2.5,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "use_cache": True,
        "use_qk_norm": True,
        "vocab_size": _VOCAB,
    },
    # MiniMax M2: q/k norms over all heads at once (sharded norm under tensor
    # parallelism), partial rope, sigmoid routing with a correction bias, no shared expert.
    "minimax": {
        "architectures": ["MiniMaxM2ForCausalLM"],
        "model_type": "minimax_m2",
        "attn_type_list": [1, 1, 1, 1],
        "bos_token_id": 0,
        "eos_token_id": 1,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 32,
        "max_position_embeddings": 196608,
        "num_attention_heads": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 4,
        "num_key_value_heads": 4,
        "num_local_experts": 8,
        "qk_norm_type": "per_layer",
        "rms_norm_eps": 1e-06,
        "rope_theta": 5000000,
        "rotary_dim": 8,
        "router_aux_loss_coef": 0.001,
        "scoring_func": "sigmoid",
        "shared_intermediate_size": 0,
        "tie_word_embeddings": False,
        "use_qk_norm": True,
        "use_routing_bias": True,
        "vocab_size": _VOCAB,
    },
    # gpt-oss 20b: alternating sliding / full attention with sinks, biased experts with a
    # clamped SwiGLU, YaRN rope.
    "gpt_oss": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 1,
        "experts_per_token": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 32,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "max_position_embeddings": 131072,
        "num_attention_heads": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 4,
        "num_key_value_heads": 4,
        "num_local_experts": 8,
        "output_router_logits": False,
        "pad_token_id": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 16,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": _VOCAB,
    },
    # Ministral 3 (text model): YaRN rope with Llama 4 attention temperature scaling.
    "ministral3": {
        "architectures": ["Ministral3ForCausalLM"],
        "model_type": "ministral3",
        "attention_dropout": 0.0,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 262144,
        "num_attention_heads": 8,
        "num_hidden_layers": 4,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 16.0,
            "llama_4_scaling_beta": 0.1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 16384,
            "rope_theta": 1000000.0,
            "rope_type": "yarn",
        },
        "sliding_window": None,
        "tie_word_embeddings": True,
        "use_cache": True,
        "vocab_size": _VOCAB,
    },
    # Qwen3 Next 80B-A3B: Gated DeltaNet / gated attention hybrid with MoE. mlx-lm has no
    # tensor-parallel shard() for it, so only pipeline applies.
    "qwen3_next": {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "decoder_sparse_step": 1,
        "eos_token_id": 1,
        "full_attention_interval": 4,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_value_head_dim": 16,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "num_attention_heads": 8,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 4,
        "num_key_value_heads": 4,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000000,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 32,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": _VOCAB,
    },
    # Qwen3.5 (dense): three Gated DeltaNet layers then one gated full-attention layer,
    # untied lm_head (split by vocabulary under tensor parallelism).
    "qwen3_5": {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "image_token_id": 500,
        "text_config": {
            "model_type": "qwen3_5_text",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "attn_output_gate": True,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "full_attention_interval": 4,
            "head_dim": 16,
            "hidden_act": "silu",
            "hidden_size": 64,
            "initializer_range": 0.02,
            "intermediate_size": 128,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 16,
            "linear_num_key_heads": 4,
            "linear_num_value_heads": 8,
            "linear_value_head_dim": 16,
            "max_position_embeddings": 262144,
            "mtp_num_hidden_layers": 1,
            "num_attention_heads": 8,
            "num_hidden_layers": 4,
            "num_key_value_heads": 4,
            "rms_norm_eps": 1e-06,
            "rope_parameters": {
                "mrope_interleaved": True,
                "mrope_section": [1, 1, 0],
                "partial_rotary_factor": 0.25,
                "rope_theta": 10000000,
                "rope_type": "default",
            },
            "tie_word_embeddings": False,
            "use_cache": True,
            "vocab_size": _VOCAB,
        },
        "tie_word_embeddings": False,
        "vocab_size": _VOCAB,
    },
    # Qwen3.5 MoE: as Qwen3.5, with routed experts plus a gated shared expert.
    "qwen3_5_moe": {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "image_token_id": 500,
        "text_config": {
            "model_type": "qwen3_5_moe_text",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "attn_output_gate": True,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "full_attention_interval": 4,
            "head_dim": 16,
            "hidden_act": "silu",
            "hidden_size": 64,
            "initializer_range": 0.02,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 16,
            "linear_num_key_heads": 4,
            "linear_num_value_heads": 8,
            "linear_value_head_dim": 16,
            "max_position_embeddings": 262144,
            "moe_intermediate_size": 32,
            "mtp_num_hidden_layers": 1,
            "num_attention_heads": 8,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 4,
            "num_key_value_heads": 4,
            "rms_norm_eps": 1e-06,
            "rope_parameters": {
                "mrope_interleaved": True,
                "mrope_section": [1, 1, 0],
                "partial_rotary_factor": 0.25,
                "rope_theta": 10000000,
                "rope_type": "default",
            },
            "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": 32,
            "tie_word_embeddings": False,
            "use_cache": True,
            "vocab_size": _VOCAB,
        },
        "tie_word_embeddings": False,
        "vocab_size": _VOCAB,
    },
    # Step 3.5 Flash: sliding / full layers with different head counts, per-layer rope
    # theta and partial rope, head-wise attention gate, zero-centred norms, dense first
    # layer then MoE with a shared expert and clamped SwiGLU.
    "step3p5": {
        "architectures": ["Step3p5ForCausalLM"],
        "model_type": "step3p5",
        "attention_other_setting": {
            "attention_type": "sliding_attention",
            "num_attention_heads": 8,
            "num_attention_groups": 4,
            "head_dim": 16,
            "true_head_dim": 16,
        },
        "bos_token_id": 0,
        "eos_token_id": 1,
        "head_dim": 16,
        "hidden_size": 64,
        "intermediate_size": 128,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        "max_position_embeddings": 262144,
        "moe_intermediate_size": 32,
        "moe_layers_enum": "1,2,3",
        "moe_num_experts": 8,
        "moe_router_activation": "sigmoid",
        "moe_router_scaling_factor": 3.0,
        "moe_top_k": 2,
        "need_fp32_gate": True,
        "norm_expert_weight": True,
        "num_attention_groups": 4,
        "num_attention_heads": 4,
        "num_hidden_layers": 4,
        "partial_rotary_factors": [0.5, 1.0, 1.0, 0.5],
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 2.0,
            "high_freq_factor": 32.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 131072,
            "rope_type": "llama3",
        },
        "rope_theta": [5000000.0, 10000.0, 10000.0, 5000000.0],
        "share_expert_dim": 32,
        "sliding_window": 16,
        "swiglu_limits": [0.0, 0.0, 0.0, 7.0],
        "swiglu_limits_shared": [0.0, 0.0, 0.0, 16.0],
        "tie_word_embeddings": False,
        "use_head_wise_attn_gate": True,
        "use_moe_router_bias": True,
        "yarn_only_types": ["full_attention"],
        "vocab_size": _VOCAB,
    },
    # Kimi K2.5: a DeepSeek V3 text model (model_type kimi_k2) inside a multimodal wrapper.
    "kimi_k25": {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "media_placeholder_token_id": 500,
        "pad_token_id": 1,
        "text_config": {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "kimi_k2",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "first_k_dense_replace": 1,
            "hidden_act": "silu",
            "hidden_size": 64,
            "initializer_range": 0.02,
            "intermediate_size": 128,
            "kv_lora_rank": 32,
            "max_position_embeddings": 262144,
            "moe_intermediate_size": 32,
            "moe_layer_freq": 1,
            "n_group": 1,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "norm_topk_prob": True,
            "num_attention_heads": 4,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 4,
            "num_key_value_heads": 4,
            "num_nextn_predict_layers": 0,
            "q_lora_rank": 48,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "beta_fast": 1.0,
                "beta_slow": 1.0,
                "factor": 64.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096,
                "type": "yarn",
            },
            "rope_theta": 50000.0,
            "routed_scaling_factor": 2.827,
            "scoring_func": "sigmoid",
            "tie_word_embeddings": False,
            "topk_group": 1,
            "topk_method": "noaux_tc",
            "use_cache": True,
            "v_head_dim": 16,
            "vocab_size": _VOCAB,
        },
        "tie_word_embeddings": False,
        "vocab_size": _VOCAB,
    },
}
