"""Checks a model architecture in our MLX engine against its transformers reference.

    python -m exo.devtools.onboard MODEL_TYPE_OR_CONFIG.json [--prompt-len 64] [--decode-steps 32]

Takes a named tiny config (`TINY_CONFIGS`) or a real config.json (shrunk to a few narrow
layers with the same structure), builds a random model of it in transformers (float32),
saves it in Hugging Face layout with a tiny tokenizer, loads that directory through the
engine's loading path (mlx-lm plus `exo.engine.mlx.models`, so `sanitize` is exercised),
and prints the largest |logit difference| over the prompt and over greedy decode steps
taken through the cache, for the prompt prefilled at once and in chunks."""

import argparse
import copy
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

import exo.engine.mlx.models  # noqa: F401  (architectures mlx-lm lacks)
from exo.devtools.hub_layouts import (
    TEXT_PART_REFERENCE,
    as_published,
    has_own_layout,
    reference_model,
    to_hub_layout,
)
from exo.devtools.tiny_configs import TINY_CONFIGS
from exo.devtools.tiny_models import write_tokenizer

# Sizes a shrunk config gets; list-valued per-layer keys are cut to the layer count.
_SHRUNK = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_attention_heads": 8,
    "head_dim": 16,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "o_lora_rank": 16,
    "index_head_dim": 16,
    "index_n_heads": 8,
    "vocab_size": 512,
}
_CAPPED = {
    "num_hidden_layers": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "num_experts": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "o_groups": 2,
    "sliding_window": 16,
    "index_topk": 8,
}
_PER_LAYER = ("layer_types", "mlp_layer_types", "compress_ratios")
# Random weights this sharp (the tiny configs' initializer_range too) make attention
# far from uniform, so which keys a sparse or windowed layer keeps changes the answer.
SHARP_INIT_STD = 0.08


def shrink_config(config: dict) -> dict:
    """A real config.json cut down to the tiny sizes above; its structure (layer
    pattern, routing, attention variant) stays."""
    config = copy.deepcopy(config)
    for key, value in _SHRUNK.items():
        if key in config:
            config[key] = value
    for key, cap in _CAPPED.items():
        if isinstance(config.get(key), int):
            config[key] = min(config[key], cap)
    if "qk_rope_head_dim" in config:
        config["qk_rope_head_dim"] = 8
    for target in (config, config.get("text_config")):
        if isinstance(target, dict):
            target["initializer_range"] = SHARP_INIT_STD
    for key in _PER_LAYER:
        if isinstance(config.get(key), list):
            config[key] = config[key][: config["num_hidden_layers"]]
    return config


def resolve_config(name_or_path: str) -> dict:
    if name_or_path in TINY_CONFIGS:
        return copy.deepcopy(TINY_CONFIGS[name_or_path])
    return shrink_config(json.loads(Path(name_or_path).read_text()))


def _randomise(model, seed: int) -> None:
    """Every matrix drawn from N(0, initializer_range) (tiny configs ask for a sharp
    SHARP_INIT_STD, so attention and the sparse indexer's choices are far from uniform
    and a wrong pick shows); every constant tensor (norm weights, sinks, biases,
    stream-mixing scales) gets noise of its own, so a wrong mapping shows; and integer
    lookup tables (hash routing) get distinct random entries per row."""
    import torch

    std = float(model.config.get_text_config().initializer_range)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if not tensor.is_floating_point():
                if tensor.ndim == 2 and tensor.numel():
                    n_choices = int(getattr(model.config, "num_local_experts", tensor.shape[1]))
                    order = torch.rand(tensor.shape[0], n_choices, generator=generator).argsort(dim=-1)
                    tensor.copy_(order[:, : tensor.shape[1]])
                continue
            if tensor.numel() and bool((tensor == tensor.flatten()[0]).all()):
                value = float(tensor.flatten()[0])
                noise = torch.randn(tensor.shape, generator=generator)
                tensor.add_(0.1 * max(abs(value), 0.2) * noise.to(tensor.dtype))
            elif tensor.ndim >= 2:
                tensor.normal_(0.0, std, generator=generator)


def _with_vocab_size(config: dict, vocab_size: int) -> dict:
    """`config` with the tokenizer's vocabulary size, also in its text_config (multimodal
    configs such as Gemma 4's), and in per-layer input tables sized like the vocabulary."""
    config = {**config, "vocab_size": vocab_size}
    if isinstance(config.get("text_config"), dict):
        config["text_config"] = _with_vocab_size(config["text_config"], vocab_size)
    if "vocab_size_per_layer_input" in config:
        config["vocab_size_per_layer_input"] = vocab_size
    return config


def write_reference_model(path: Path, config: dict, seed: int = 0):
    """Saves a random transformers model of `config` (float32) with a tokenizer at
    `path`, in the layout the family's Hugging Face checkpoints use (hub_layouts.py);
    returns the transformers model."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    write_tokenizer(path, config.get("vocab_size", 512), pad_to_multiple_of=64)
    config = _with_vocab_size(config, Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size())
    torch.manual_seed(seed)
    model_type = config["model_type"]
    model = reference_model(model_type, transformers.AutoConfig.for_model(**config))
    _randomise(model, seed)
    published = as_published(model_type, model)
    if isinstance(model, transformers.PreTrainedModel):
        model.save_pretrained(path)
        # transformers writes its own spelling of some keys (rope_parameters, ...); the
        # checkpoints people download carry the original config, so keep its keys too.
        # A text-part reference saved its text config, which the original nests.
        saved = {} if model_type in TEXT_PART_REFERENCE else json.loads((path / "config.json").read_text())
    else:
        _save_state_dict(path, model.state_dict())
        saved = {}
    if has_own_layout(model_type):
        from safetensors.torch import load_file

        _save_state_dict(path, to_hub_layout(model_type, load_file(path / "model.safetensors")))
    (path / "config.json").write_text(json.dumps({**saved, **config, **published}, indent=2))
    return model


def _save_state_dict(path: Path, tensors: dict) -> None:
    from safetensors.torch import save_file

    # A tiny model is one file; save_pretrained names it so too.
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors", metadata={"format": "pt"})


def _reference_prompt_kwargs(config) -> dict:
    """Gemma 4 in transformers 5.24 slices `per_layer_inputs` before its KV-shared layers
    without checking for None, so a multi-token forward fails for KV-shared models
    without per-layer inputs (the MoE layouts); asking for hidden states turns that
    slicing (a no-op for full logits) off."""
    text = config.get_text_config()
    if getattr(text, "num_kv_shared_layers", 0) and not getattr(text, "hidden_size_per_layer_input", 1):
        return {"output_hidden_states": True}
    return {}


def reference_run(model, prompt: list[int], decode_steps: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Prompt logits [L, V], then greedy decode through transformers' cache: the logits
    [decode_steps, V] of each step and the tokens chosen."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True, **_reference_prompt_kwargs(model.config))
        prompt_logits, cache = out.logits[0].float().numpy(), out.cache
        tokens, step_logits = [], []
        last = prompt_logits[-1]
        for _ in range(decode_steps):
            tokens.append(int(last.argmax()))
            out = model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
            cache, last = out.cache, out.logits[0, -1].float().numpy()
            step_logits.append(last)
    return prompt_logits, np.stack(step_logits) if step_logits else np.zeros((0,)), tokens


def load_engine_model(path: Path):
    """The model as the engine loads it (mlx-lm's load_model, our model modules)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    return model


def engine_run(model, prompt: list[int], tokens: list[int], chunks: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Prompt logits with the prompt prefilled in `chunks` calls, then the logits of
    each decode step feeding the reference's tokens one at a time through the cache."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    bounds = np.linspace(0, len(prompt), chunks + 1).astype(int)
    prompt_logits = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        logits = model(mx.array(prompt[start:end])[None], cache=cache)[0]
        mx.eval(logits)
        prompt_logits.append(np.array(logits.astype(mx.float32)))
    step_logits = []
    for token in tokens:
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
        mx.eval(logits)
        step_logits.append(np.array(logits.astype(mx.float32)))
    return np.concatenate(prompt_logits), np.stack(step_logits) if step_logits else np.zeros((0,))


@dataclass
class Comparison:
    chunks: int
    prompt_diff: float
    decode_diff: float
    tokens_agree: bool


def compare_engine_model(
    model, prompt: list[int], ref_prompt: np.ndarray, ref_steps: np.ndarray, tokens: list[int], chunks: int = 1
) -> Comparison:
    """The engine model's logits against the reference's (from `reference_run`), with the
    prompt prefilled in `chunks` calls."""
    prompt_logits, step_logits = engine_run(model, prompt, tokens, chunks)
    greedy = [int(row.argmax()) for row in [prompt_logits[-1], *step_logits[:-1]]]
    return Comparison(
        chunks=chunks,
        prompt_diff=float(np.abs(prompt_logits - ref_prompt).max()),
        decode_diff=float(np.abs(step_logits - ref_steps).max()) if tokens else 0.0,
        tokens_agree=greedy == tokens,
    )


def random_prompt(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab_size, length)]


def compare(
    config: dict, prompt_len: int = 64, decode_steps: int = 32, chunk_counts: tuple[int, ...] = (1, 3), seed: int = 0
) -> list[Comparison]:
    with tempfile.TemporaryDirectory(prefix="exo-onboard-") as tmp:
        path = Path(tmp)
        reference = write_reference_model(path, config, seed)
        prompt = random_prompt(reference.config.get_text_config().vocab_size, prompt_len, seed)
        ref_prompt, ref_steps, tokens = reference_run(reference, prompt, decode_steps)
        model = load_engine_model(path)
        return [compare_engine_model(model, prompt, ref_prompt, ref_steps, tokens, chunks) for chunks in chunk_counts]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("model", help="a TINY_CONFIGS name or a config.json path")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--chunks", default="1,3", help="prefill chunk counts to try, comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = resolve_config(args.model)
    chunk_counts = tuple(int(c) for c in args.chunks.split(","))
    for result in compare(config, args.prompt_len, args.decode_steps, chunk_counts, args.seed):
        print(
            f"{config['model_type']}: prefill in {result.chunks} chunk(s): "
            f"max |logit diff| prompt {result.prompt_diff:.2e}, "
            f"{args.decode_steps} decode steps {result.decode_diff:.2e}, "
            f"greedy tokens {'agree' if result.tokens_agree else 'DIFFER'}"
        )


if __name__ == "__main__":
    main()
