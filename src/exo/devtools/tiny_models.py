"""Small HF-layout models made on the spot, for tests and benchmarks on machines with
no model hub: a BPE tokenizer trained on a few generated sentences, a chat template,
and a Llama-architecture model with random weights."""

import json
import random
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama
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


def write_tokenizer(path: Path, vocab_size: int = 512) -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_training_sentences(), trainer)
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
    write_tokenizer(path, vocab_size)
    actual_vocab = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "intermediate_size": intermediate_size,
        "vocab_size": actual_vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "float32" if dtype == mx.float32 else "bfloat16",
    }
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(dtype)
    # Small weights keep logits well spread, so sampling and greedy decoding differ.
    model.update(nn.utils.tree_map(lambda p: p * 0.5 if isinstance(p, mx.array) else p, model.parameters()))
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
