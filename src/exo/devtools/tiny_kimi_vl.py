"""A tiny random Kimi-VL (model_type kimi_vl): the MoonViT vision tower (native-resolution
patches, a learnable 2-D position table interpolated to the image's grid, 2-D rotary
attention, 2x2 patch merging), the projector into the text width, and a DeepSeek V3
language model (MLA without a query LoRA, as Kimi-VL-A3B's, a dense first layer, then
sigmoid-routed experts beside a shared one).

transformers has no Kimi-VL model class (Kimi ships its own as remote code, which we do
not fetch), so the weights are drawn here (sharp: every matrix N(0, 0.08), a little noise
on every constant vector) for mlx-vlm's kimi_vl module, and saved under the names the
hub's checkpoint uses (`vision_tower.encoder.blocks.N.wqkv`, torch's conv layout, one
tensor per expert), which mlx-vlm's and exo's loaders rename. The reference numbers are
mlx-vlm's own whole kimi_vl model (`kimi_vl_reference`); the config keeps the hub's
field names for the tower (num_hidden_layers, num_attention_heads, hidden_size), which
mlx-vlm's config calls depth, num_heads and embed_dim."""

import json
from pathlib import Path
from typing import Any, cast

import numpy as np

from exo.devtools.tiny_vlm_tokenizer import user_turn, write_vlm_tokenizer
from exo.shared.models.vision import moonvit_fields

KIMI_VL_TOKENS = {
    "image_token": "<|media_pad|>",
    "media_start": "<|media_start|>",
    "media_content": "<|media_content|>",
    "media_end": "<|media_end|>",
}
# What Kimi-VL's chat template writes for an image; the processor repeats the pad token
# once per merged patch.
KIMI_VL_PLACEHOLDER = "<|media_start|>image<|media_content|><|media_pad|><|media_end|>"

# Patches of 4 pixels: a 96x96 image is 24x24 patches, 144 tokens after merging 2x2. The
# position table is 16x16, so it is interpolated (bicubic) to the grid, as the real
# 64x64 one is for most images.
KIMI_VL_VISION = {
    "model_type": "moonvit",
    "patch_size": 4,
    "init_pos_emb_height": 16,
    "init_pos_emb_width": 16,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "merge_kernel_size": [2, 2],
}
KIMI_VL_TEXT = {
    "model_type": "deepseek_v3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 2.446,
    "kv_lora_rank": 32,
    "q_lora_rank": None,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "qk_nope_head_dim": 16,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 800000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
KIMI_VL_PROCESSOR = {
    "image_processor_type": "KimiVLImageProcessor",
    "patch_size": KIMI_VL_VISION["patch_size"],
    "merge_kernel_size": KIMI_VL_VISION["merge_kernel_size"],
    "in_token_limit": 1024,
    "pad_input": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def _model_config(config: dict[str, Any]) -> Any:
    from mlx_vlm.models.kimi_vl.config import ModelConfig, TextConfig, VisionConfig

    return ModelConfig(
        text_config=TextConfig.from_dict(config["text_config"]),
        vision_config=VisionConfig.from_dict(moonvit_fields(config["vision_config"])),
        model_type="kimi_vl",
        media_placeholder_token_id=config["media_placeholder_token_id"],
    )


def _sharp(shape: tuple[int, ...], base: np.ndarray, rng: np.random.Generator, std: float) -> np.ndarray:
    noise = rng.standard_normal(shape).astype(np.float32)
    if len(shape) >= 2:
        return std * noise
    return base + 0.1 * max(float(np.abs(base).mean()), 0.2) * noise


def _hub_name(name: str) -> str:
    """mlx-vlm's parameter name as the hub's checkpoint writes it."""
    if name.startswith("vision_tower.blocks."):
        name = name.replace("vision_tower.blocks.", "vision_tower.encoder.blocks.").replace(".attn.", ".")
    return name.replace("vision_tower.final_layernorm.", "vision_tower.encoder.final_layernorm.")


def _hub_tensors(name: str, value: np.ndarray) -> dict[str, np.ndarray]:
    if name == "vision_tower.patch_embed.proj.weight":
        return {name: value.transpose(0, 3, 1, 2)}  # MLX's (out, kh, kw, in) as torch's (out, in, kh, kw)
    if ".mlp.switch_mlp." in name:
        head, tail = name.split(".switch_mlp.")
        return {f"{head}.experts.{e}.{tail}": value[e] for e in range(value.shape[0])}
    return {_hub_name(name): value}


def make_tiny_kimi_vl(path: Path, seed: int = 0, init_std: float = 0.08) -> Path:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models.kimi_vl.kimi_vl import Model

    path = Path(path)
    ids = write_vlm_tokenizer(path, KIMI_VL_TOKENS, KIMI_VL_PLACEHOLDER)
    config = {
        "architectures": ["KimiVLForConditionalGeneration"],
        "model_type": "kimi_vl",
        "media_placeholder_token_id": ids["image_token"],
        "pad_token_id": 0,
        "vocab_size": ids["vocab_size"],
        "text_config": {**KIMI_VL_TEXT, "vocab_size": ids["vocab_size"]},
        "vision_config": dict(KIMI_VL_VISION),
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    model = Model(_model_config(config))
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for name, value in sorted(cast(list[tuple[str, Any]], tree_flatten(model.parameters()))):
        base = np.array(value.astype(mx.float32))
        tensors |= _hub_tensors(name, _sharp(tuple(value.shape), base, rng, init_std))
    mx.save_safetensors(str(path / "model.safetensors"), {k: mx.array(v) for k, v in tensors.items()})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "preprocessor_config.json").write_text(json.dumps(KIMI_VL_PROCESSOR, indent=2))
    return path


def kimi_vl_reference(path: Path, question: str, image: Any, steps: int = 1) -> tuple[list[int], list[list[float]]]:
    """mlx-vlm's own processing and whole kimi_vl model for one user turn of an image then
    `question`: its image processor, the pad token repeated once per merged patch as its
    KimiVLProcessor does, and its forward (its own DeepSeek V3, with the full kv_b_proj
    attention) for each of `steps` greedy steps, full forwards without a cache."""
    import mlx.core as mx
    from mlx_vlm.models.kimi_vl.kimi_vl import Model
    from mlx_vlm.models.kimi_vl.processing_kimi_vl import KimiVLImageProcessor
    from transformers import AutoTokenizer

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    processor = KimiVLImageProcessor(**json.loads((path / "preprocessor_config.json").read_text()))
    batch = processor(images=[image])
    merge = int(np.prod(processor.merge_kernel_size))
    count = int(np.prod(np.array(batch["image_grid_hws"][0]))) // merge
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = user_turn(tokenizer, question)
    text = text.replace(KIMI_VL_TOKENS["image_token"], KIMI_VL_TOKENS["image_token"] * count)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    model = Model(_model_config(config))
    weights = model.sanitize(cast(dict[str, Any], mx.load(str(path / "model.safetensors"))))
    weights = model.vision_tower.sanitize(weights)
    weights = model.language_model.sanitize(weights)
    model.load_weights(list(weights.items()))
    tokens, logprobs = list(ids), []
    for _ in range(steps):
        out = model(
            mx.array(tokens)[None],
            batch["pixel_values"],
            image_grid_hws=batch["image_grid_hws"],
            _grid_shapes=batch["_grid_shapes"],
        )
        last = out.logits[0, -1].astype(mx.float32)
        step = last - mx.logsumexp(last)
        logprobs.append(step.tolist())
        tokens.append(cast(int, mx.argmax(step).item()))
    return ids, logprobs
