"""Small HF-layout models made on the spot, for tests and benchmarks on machines with
no model hub: a BPE tokenizer trained on a few generated sentences, a chat template,
and a model of any mlx-lm architecture with random weights.

`TINY_CONFIGS` (in tiny_configs.py) holds, per architecture, the structure of a real config.json (same keys,
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

import exo.engine.mlx.models  # noqa: F401  (exo's own architectures, DeepSeek V4, join mlx-lm's)
from exo.devtools.tiny_configs import TINY_CONFIGS

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


def _random_weights(model, seed: int, perturb_constants: bool, init_std: float | None = None) -> dict[str, mx.array]:
    """Random weights: with `init_std` (the config's initializer_range), every matrix
    drawn from N(0, init_std) as transformers initialises, and vectors (norms, biases)
    left as the model sets them; without it, the model's own random init, halved.

    mlx initialises norms to ones and biases such as attention sinks or router
    correction biases to zeros; a wrong split of a constant goes unnoticed, so with
    `perturb_constants` every constant tensor gets a little noise of its own."""
    if init_std is None:
        params = tree_map(lambda p: p * 0.5 if isinstance(p, mx.array) and _is_float(p) else p, model.parameters())
    else:
        key = mx.random.key(seed)
        flat = []
        for name, p in tree_flatten(model.parameters()):
            if isinstance(p, mx.array) and _is_float(p) and p.ndim >= 2:
                key, sub = mx.random.split(key)
                p = (init_std * mx.random.normal(p.shape, key=sub)).astype(p.dtype)
            flat.append((name, p))
        params = tree_unflatten(flat)
    if perturb_constants:
        key = mx.random.key(seed + 1)
        flat = []
        for name, p in tree_flatten(params):
            if isinstance(p, mx.array) and _is_float(p) and p.size > 0 and bool(mx.all(p == p.reshape(-1)[0])):
                key, sub = mx.random.split(key)
                scale = 0.1 * max(abs(float(p.reshape(-1)[0])), 0.2)
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
    init_std = config.get("initializer_range") or config.get("text_config", {}).get("initializer_range")
    weights = _random_weights(model, seed, perturb_constants, init_std)
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
    max_position_embeddings: int = 4096,
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
        "max_position_embeddings": max_position_embeddings,
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
