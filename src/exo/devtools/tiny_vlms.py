"""Tiny vision-language models made with transformers, for numerical tests of exo's image
path against transformers' own forward: real config structures shrunk to width 64 (a
vision tower of width 32), sharp random weights (N(0, 0.08) for every matrix, a little
noise on every constant vector), saved in HF layout with the image processor's config
beside them. AutoProcessor is never used: it wants torchvision for the video processor.

Kimi-VL, which transformers has no class for, is made with mlx-vlm instead
(devtools/tiny_kimi_vl.py).

`make_tiny_vlm(path, name)` writes one; `TINY_VLMS` lists the names."""

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing

from exo.devtools.tiny_configs import TINY_CONFIGS
from exo.devtools.tiny_kimi_vl import kimi_vl_reference, make_tiny_kimi_vl
from exo.devtools.tiny_vlm_tokenizer import user_turn, write_vlm_tokenizer

INIT_STD = 0.08


# Gemma 4's tokens for images. Its config also names audio and video tokens; they get ids
# outside the vocabulary, since transformers embeds those tokens as padding wherever they
# occur, and a random model may well sample them.
GEMMA4_TOKENS = {
    "image_token": "<|image|>",
    "boi_token": "<|boi|>",
    "eoi_token": "<|eoi|>",
}

# A vision tower of the real structure (ViT blocks, 2-D rotary, pooling 3x3 patches to a
# soft token), patches of 4 pixels: a 96x96 image is 24x24 patches, 64 soft tokens.
GEMMA4_VISION = {
    "model_type": "gemma4_vision",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "patch_size": 4,
    "pooling_kernel_size": 3,
    "position_embedding_size": 64,
    "initializer_range": INIT_STD,
}
# The smallest budget transformers' Gemma 4 processors accept.
GEMMA4_MAX_SOFT_TOKENS = 70

# Qwen2.5-VL's tokens for images (the placeholder the template writes is the pad token,
# between vision_start and vision_end; the processor repeats it per merged patch).
QWEN_VL_TOKENS = {
    "image_token": "<|image_pad|>",
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
    "video_token": "<|video_pad|>",
}
# The tower's structure (window attention blocks, one full-attention block, a 2x2 patch
# merger into the text width), patches of 4 pixels: a 96x96 image is 24x24 patches,
# 144 tokens after merging.
QWEN_VL_VISION = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 4,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 32,
    "fullatt_block_indexes": [1],
    "out_hidden_size": 64,
    "initializer_range": INIT_STD,
}
QWEN_VL_TEXT = {
    "model_type": "qwen2_5_vl_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "initializer_range": INIT_STD,
    "tie_word_embeddings": False,
}
# head_dim 16: 8 rotary frequencies, split between time, height and width.
QWEN_VL_ROPE = {"type": "mrope", "mrope_section": [2, 3, 3]}
QWEN_VL_ROPE_THETA = 10000.0

# Qwen3-VL: the same grid family with a Qwen3 language model (q/k norms, head_dim of its
# own), interleaved M-RoPE sections, and DeepStack: the tower's blocks 0-2 each give
# features (through their own merger) that are added to the hidden states after decoder
# layers 0-2 at the image's positions. With 4 decoder layers a 2-rank pipeline puts
# layer 2, and so a DeepStack level, on rank 1.
QWEN3_VL_VISION = {
    "depth": 3,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 4,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 64,
    "num_position_embeddings": 64,
    "deepstack_visual_indexes": [0, 1, 2],
    "initializer_range": INIT_STD,
}
QWEN3_VL_TEXT = {
    "model_type": "qwen3_vl_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "initializer_range": INIT_STD,
    "tie_word_embeddings": False,
}
# 8 rotary frequencies, interleaved: height takes 1 and 4, width 2 and 5, time the rest
# (as the real [24, 20, 20] leaves time the tail).
QWEN3_VL_ROPE = {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True}

TINY_VLMS = ("gemma4_vlm", "gemma4_moe_vlm", "qwen2_5_vl", "qwen3_vl", "kimi_vl", "gemma4_vlm_4bit")
# The quantized one: every linear and embedding (vision tower and projector included)
# 4-bit in groups of 32.
QUANTIZED_BITS, QUANTIZED_GROUP = 4, 32


def _sharpen(model: Any, seed: int) -> None:
    """Every matrix from N(0, INIT_STD); every vector gets noise of its own, so a constant
    (a norm's ones, a zero bias) mixed up somewhere cannot go unnoticed."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if param.ndim >= 2:
                param.copy_(INIT_STD * noise)
            else:
                scale = 0.1 * max(float(param.abs().mean()), 0.2)
                param.add_(scale * noise)


def _update_config(path: Path, **fields: Any) -> None:
    config_path = path / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **fields}, indent=2))


def _gemma4_moe_text() -> dict[str, Any]:
    """The 26B-A4B layout (tiny_configs' gemma4_moe) as a VLM's text config: image tokens
    attend to each other both ways on the sliding layers."""
    text = {k: v for k, v in TINY_CONFIGS["gemma4_moe"].items() if k != "architectures"}
    return {**text, "use_bidirectional_attention": "vision"}


def make_tiny_gemma4_vlm(
    path: Path, seed: int = 0, layout: str = "e2b", tokens: dict[str, str] = GEMMA4_TOKENS
) -> Path:
    """Gemma 4 with its vision tower and projector, of the E2B/E4B layout (per-layer
    inputs, KV-shared layers, causal attention over image tokens) or, with layout
    "26b", the 26B-A4B one (MoE, k_eq_v, bidirectional image attention on sliding layers).
    `tokens`: the tokenizer's special tokens (image, boi and eoi among them)."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    path = Path(path)
    ids = write_vlm_tokenizer(path, tokens, tokens["image_token"])
    text = copy.deepcopy(TINY_CONFIGS["gemma4"]["text_config"]) if layout == "e2b" else _gemma4_moe_text()
    text.update(vocab_size=ids["vocab_size"], pad_token_id=0)
    if text.get("hidden_size_per_layer_input"):
        text["vocab_size_per_layer_input"] = ids["vocab_size"]
    config = Gemma4Config(
        text_config=text,
        vision_config=dict(GEMMA4_VISION),
        audio_config=None,
        image_token_id=ids["image_token"],
        boi_token_id=ids["boi_token"],
        eoi_token_id=ids["eoi_token"],
        audio_token_id=ids["vocab_size"] + 1,
        video_token_id=ids["vocab_size"] + 2,
        initializer_range=INIT_STD,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config)
    _sharpen(model, seed)
    model.save_pretrained(path)
    # The config as the hub's checkpoints write it: transformers 5 saves the full layers'
    # head size as per_layer_config, mlx-lm reads global_head_dim; and mlx-lm reads the
    # vocabulary size at the top level (its default is the real 262144).
    saved = json.loads((path / "config.json").read_text())["text_config"]
    saved.pop("per_layer_config", None)
    _update_config(path, vocab_size=ids["vocab_size"], text_config={**saved, **text})
    processor = {
        "image_processor_type": "Gemma4ImageProcessor",
        "processor_class": "Gemma4Processor",
        "patch_size": GEMMA4_VISION["patch_size"],
        "pooling_kernel_size": GEMMA4_VISION["pooling_kernel_size"],
        "max_soft_tokens": GEMMA4_MAX_SOFT_TOKENS,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": False,
        "do_convert_rgb": True,
        "resample": 3,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    return path


# Gemma 4's image and audio tokens and turn markers as the hub's tokenizers name them
# (Gemma4Processor wants the audio ones named even for images). config.json's audio id
# stays outside the vocabulary, as make_tiny_gemma4_vlm sets it.
GEMMA4_HUB_TOKENS = {
    "image_token": "<|image|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
    "sot_token": "<|turn>",
    "eot_token": "<turn|>",
}


# The tokens of Gemma 4's thinking switch and reasoning channel; a vocabulary with the
# channel's pair is one mlx-lm's tokenizer finds think markers in.
GEMMA4_HUB_THINKING_TOKENS = {"soc_token": "<|channel>", "eoc_token": "<channel|>", "think_token": "<|think|>"}

# The 26B-A4B/31B template's thinking switch: off unless the caller turns it on, the
# system turn opening with <|think|> when on, and when off the generation prompt closing
# an empty thought channel.
GEMMA4_THINKING_ON = (
    "{%- if enable_thinking | default(false) -%}{{- '<|turn>system\\n<|think|><turn|>\\n' -}}{%- endif -%}"
)
GEMMA4_THINKING_OFF = (
    "{%- if not enable_thinking | default(false) -%}{{- '<|channel>thought\\n<channel|>' -}}{%- endif -%}"
)


def gemma4_hub_template(image: str = "<|image|>", bos: bool = True, thinking: bool = False) -> str:
    """The user and model turns of the hub's Gemma 4 chat template: `image` is what it
    writes for an image part (the 26B-A4B/31B template's bare token, or earlier ones'
    with blank lines around it); `bos`: whether it writes the BOS itself; `thinking`: with
    the 26B-A4B/31B template's thinking switch."""
    return (
        ("{{- bos_token -}}" if bos else "")
        + (GEMMA4_THINKING_ON if thinking else "")
        + "{%- for message in messages -%}"
        "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
        "{{- '<|turn>' + role + '\\n' -}}"
        "{%- if message['content'] is string -%}{{- message['content'] | trim -}}{%- else -%}"
        "{%- for item in message['content'] -%}"
        "{%- if item['type'] == 'text' -%}{{- item['text'] | trim -}}"
        "{%- elif item['type'] == 'image' -%}{{- " + repr(image) + " -}}{%- endif -%}"
        "{%- endfor -%}{%- endif -%}"
        "{{- '<turn|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}"
        + (GEMMA4_THINKING_OFF if thinking else "")
        + "{%- endif -%}"
    )


def make_tiny_gemma4_hub_vlm(
    path: Path,
    image: str = "<|image|>",
    bos: bool = True,
    max_soft_tokens: int = 280,
    template_file: str = "chat_template.jinja",
    tokenizer_adds_bos: bool = False,
    config_markers: bool = True,
    thinking: bool = False,
    seed: int = 0,
) -> Path:
    """The 26B-A4B-layout Gemma 4 VLM with its processor's files as the hub's checkpoints
    lay them out: processor_config.json with the image processor's fields nested (no
    preprocessor_config.json), the chat template in chat_template.jinja or, with
    `template_file` "processor_config.json" or "chat_template.json", the processor's
    alone while the tokenizer keeps a template of its own. `tokenizer_adds_bos`: the tokenizer adds a
    BOS (as one whose template writes none does); `config_markers`: config.json names the
    begin/end-of-image ids (else only the tokenizer names those tokens); `thinking`: the
    vocabulary has the reasoning channel's tokens and the template the 31B's thinking
    switch."""
    tokens = {**GEMMA4_HUB_TOKENS, **(GEMMA4_HUB_THINKING_TOKENS if thinking else {})}
    path = make_tiny_gemma4_vlm(Path(path), seed, layout="26b", tokens=tokens)
    saved = json.loads((path / "preprocessor_config.json").read_text())
    (path / "preprocessor_config.json").unlink()
    image_processor = {**saved, "max_soft_tokens": max_soft_tokens, "image_seq_length": max_soft_tokens}
    image_processor.pop("processor_class")
    processor: dict[str, Any] = {
        "image_processor": image_processor,
        "image_seq_length": max_soft_tokens,
        "processor_class": "Gemma4Processor",
    }
    template = gemma4_hub_template(image, bos, thinking)
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    if template_file == "processor_config.json":
        processor["chat_template"] = template
    elif template_file == "chat_template.json":
        # The processor's legacy file.
        (path / template_file).write_text(json.dumps({"chat_template": template}))
    else:
        tokenizer_config.pop("chat_template")
        (path / template_file).write_text(template)
    tokenizer_config["processor_class"] = "Gemma4Processor"
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (path / "processor_config.json").write_text(json.dumps(processor, indent=2))
    if tokenizer_adds_bos:
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        bos_id = tokenizer.token_to_id("<|bos|>")
        tokenizer.post_processor = TemplateProcessing(  # pyright: ignore[reportAttributeAccessIssue]
            single="<|bos|> $A", pair="<|bos|> $A $B", special_tokens=[("<|bos|>", bos_id)]
        )
        tokenizer.save(str(path / "tokenizer.json"))
    if not config_markers:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "boi_token_id": None, "eoi_token_id": None}, indent=2))
    return path


def processor_inputs(path: Path, question: str, image: Any, **template_kwargs: Any) -> Any:
    """transformers' own processor of the model dir's family (Gemma4Processor,
    Qwen2_5_VLProcessor, Qwen3VLProcessor), loaded as from_pretrained loads it (its chat
    template, tokenizer and image processor), on one user turn of an image then
    `question`: apply_chat_template's tokenized inputs (torch tensors), `template_kwargs`
    passed to the template (enable_thinking). The video
    processor is not loaded: it needs torchvision, which exo does not install; an
    image-only prompt never reaches it (an image processor stands in its place)."""
    from transformers import Gemma4Processor, Qwen2_5_VLProcessor, Qwen3VLProcessor
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    model_type = json.loads((Path(path) / "config.json").read_text())["model_type"]
    family: Any = {"gemma4": Gemma4Processor, "qwen2_5_vl": Qwen2_5_VLProcessor, "qwen3_vl": Qwen3VLProcessor}[
        model_type
    ]

    class ImageOnlyProcessor(family):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    parts: dict[str, Any] = {"video_processor": Gemma4ImageProcessorPil()}
    if model_type == "gemma4":
        parts["feature_extractor"] = Gemma4AudioFeatureExtractor()
    processor = ImageOnlyProcessor.from_pretrained(str(path), **parts)
    content = [{"type": "image", "image": image}, {"type": "text", "text": question}]
    return processor.apply_chat_template(
        [{"role": "user", "content": content}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        **template_kwargs,
    )


def gemma4_processor_reference(path: Path, question: str, image: Any) -> tuple[list[int], list[float]]:
    """Gemma4Processor's input_ids for an image then `question` (processor_inputs), and
    transformers' model's first-token log-probabilities over them."""
    import torch
    from transformers import Gemma4ForConditionalGeneration

    inputs = processor_inputs(path, question, image)
    model = Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(
            input_ids=inputs["input_ids"],
            mm_token_type_ids=inputs["mm_token_type_ids"],
            pixel_values=inputs["pixel_values"],
            image_position_ids=inputs["image_position_ids"],
        ).logits
    return inputs["input_ids"][0].tolist(), torch.log_softmax(logits[0, -1].float(), dim=-1).tolist()


def make_tiny_qwen2_5_vl(path: Path, seed: int = 0) -> Path:
    """Qwen2.5-VL: a Qwen2 language model with 3-D rotary positions (M-RoPE) and the
    window-attention vision tower whose merger projects into the text width."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    rope = {"rope_type": "default", "mrope_section": QWEN_VL_ROPE["mrope_section"]}
    text = {**QWEN_VL_TEXT, "bos_token_id": 0, "eos_token_id": 1}
    classes = (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration)
    _make_tiny_qwen_vl(path, seed, classes, text, QWEN_VL_VISION, (rope, QWEN_VL_ROPE))
    bounds = {"min_pixels": 16 * 16, "max_pixels": 128 * 128}
    clip = {"image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}
    _write_qwen_processor(path, "Qwen2_5_VLProcessor", QWEN_VL_VISION, {**bounds, **clip})
    return path


def make_tiny_qwen3_vl(path: Path, seed: int = 0) -> Path:
    """Qwen3-VL: a Qwen3 language model with interleaved M-RoPE, and a tower whose
    early blocks feed DeepStack features to the first decoder layers."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    classes = (Qwen3VLConfig, Qwen3VLForConditionalGeneration)
    _make_tiny_qwen_vl(path, seed, classes, QWEN3_VL_TEXT, QWEN3_VL_VISION, (QWEN3_VL_ROPE, QWEN3_VL_ROPE))
    # Qwen3-VL's processor configs give the pixel bounds as `size`.
    bounds = {"size": {"shortest_edge": 16 * 16, "longest_edge": 128 * 128}}
    _write_qwen_processor(
        path, "Qwen3VLProcessor", QWEN3_VL_VISION, {**bounds, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    )
    return path


def _make_tiny_qwen_vl(
    path: Path,
    seed: int,
    classes: tuple[Any, Any],
    text_config: dict[str, Any],
    vision_config: dict[str, Any],
    ropes: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    """A Qwen-VL grid model: `ropes` is its rope as transformers takes it, and as the
    hub's checkpoints write it (rope_scaling, which mlx-lm reads, beside rope_theta)."""
    import torch

    config_class, model_class = classes
    path = Path(path)
    ids = write_vlm_tokenizer(path, QWEN_VL_TOKENS, "<|vision_start|><|image_pad|><|vision_end|>")
    rope = {**ropes[0], "rope_theta": QWEN_VL_ROPE_THETA}
    config = config_class(
        text_config={**text_config, "vocab_size": ids["vocab_size"], "rope_parameters": rope},
        vision_config=dict(vision_config),
        image_token_id=ids["image_token"],
        video_token_id=ids["video_token"],
        vision_start_token_id=ids["vision_start_token"],
        vision_end_token_id=ids["vision_end_token"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = model_class(config)
    _sharpen(model, seed)
    model.save_pretrained(path)
    saved = json.loads((path / "config.json").read_text())
    text_saved = {**saved["text_config"], "rope_theta": QWEN_VL_ROPE_THETA, "rope_scaling": dict(ropes[1])}
    _update_config(path, vocab_size=ids["vocab_size"], text_config=text_saved)


def _write_qwen_processor(path: Path, processor_class: str, vision: dict[str, Any], fields: dict[str, Any]) -> None:
    processor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": processor_class,
        "patch_size": vision["patch_size"],
        "merge_size": vision["spatial_merge_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
        **fields,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,
    }
    (Path(path) / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))


def make_tiny_quantized_gemma4_vlm(path: Path, seed: int = 0) -> Path:
    """The E2B/E4B-layout Gemma 4 VLM quantized by mlx-vlm's own convert, the vision
    tower and projector too (its default leaves them float), in mlx-vlm's layout
    (language_model.model., vision_tower., embed_vision.)."""
    import tempfile

    import mlx.nn as nn
    from mlx_vlm.convert import convert

    def every_linear(_path: str, module: Any) -> bool:
        linear = isinstance(module, (nn.Linear, nn.Embedding))
        return linear and module.weight.shape[-1] % QUANTIZED_GROUP == 0

    with tempfile.TemporaryDirectory() as scratch:
        source = make_tiny_gemma4_vlm(Path(scratch) / "float", seed)
        convert(
            str(source),
            mlx_path=str(path),
            quantize=True,
            q_group_size=QUANTIZED_GROUP,
            q_bits=QUANTIZED_BITS,
            quant_predicate=every_linear,  # pyright: ignore[reportArgumentType]
        )
    # convert writes its processor's defaults (the real patch size and budget) as
    # processor_config.json, which would override the tiny preprocessor_config.json.
    (Path(path) / "processor_config.json").unlink(missing_ok=True)
    return Path(path)


def mlx_vlm_reference(path: Path, question: str, image: Any) -> tuple[list[int], list[float]]:
    """For a checkpoint transformers cannot read (MLX-quantized): the prompt ids as
    gemma4_reference builds them and mlx-vlm's whole model's first-token logprobs."""
    import mlx.core as mx
    import numpy as np
    from mlx_vlm.models.gemma4.processing_gemma4 import Gemma4ImageProcessor
    from mlx_vlm.utils import load
    from transformers import AutoTokenizer

    processor = Gemma4ImageProcessor.from_pretrained(str(path))
    batch, counts = processor(images=[image], return_tensors="np")
    tokenizer = AutoTokenizer.from_pretrained(path)
    run = GEMMA4_TOKENS["image_token"] * int(counts[0])
    text = user_turn(tokenizer, question).replace(
        GEMMA4_TOKENS["image_token"], GEMMA4_TOKENS["boi_token"] + run + GEMMA4_TOKENS["eoi_token"]
    )
    ids = tokenizer(text, add_special_tokens=False).input_ids
    model, _ = load(str(path))
    logits = model(mx.array(ids)[None], pixel_values=mx.array(np.asarray(batch["pixel_values"]))).logits
    last = logits[0, -1].astype(mx.float32)
    return ids, (last - mx.logsumexp(last)).tolist()


def make_tiny_vlm(path: Path, name: str, seed: int = 0) -> Path:
    if name == "gemma4_vlm_4bit":
        return make_tiny_quantized_gemma4_vlm(path, seed)
    if name == "gemma4_moe_vlm":
        return make_tiny_gemma4_vlm(path, seed, layout="26b")
    makers = {
        "gemma4_vlm": make_tiny_gemma4_vlm,
        "qwen2_5_vl": make_tiny_qwen2_5_vl,
        "qwen3_vl": make_tiny_qwen3_vl,
        "kimi_vl": make_tiny_kimi_vl,
    }
    return makers[name](path, seed)


def gemma4_reference(path: Path, question: str, image: Any, steps: int = 1) -> tuple[list[int], list[list[float]]]:
    """transformers' own processing and forward for one user turn of an image then
    `question`: the prompt token ids, and the log-probabilities at each of `steps` greedy
    steps (full forwards, no cache). Processing: transformers' Gemma 4 image processor
    (the PIL one) and the placeholder expanded as Gemma4Processor expands it."""
    import torch
    from transformers import AutoTokenizer, Gemma4ForConditionalGeneration
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    saved = json.loads((Path(path) / "preprocessor_config.json").read_text())
    processor = Gemma4ImageProcessorPil(
        patch_size=saved["patch_size"],
        pooling_kernel_size=saved["pooling_kernel_size"],
        max_soft_tokens=saved["max_soft_tokens"],
    )
    pixels = processor(images=[image], return_tensors="pt")
    tokenizer = AutoTokenizer.from_pretrained(path)
    content = [{"type": "image"}, {"type": "text", "text": question}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    run = GEMMA4_TOKENS["image_token"] * int(pixels["num_soft_tokens_per_image"][0])
    text = text.replace(GEMMA4_TOKENS["image_token"], GEMMA4_TOKENS["boi_token"] + run + GEMMA4_TOKENS["eoi_token"])
    ids = tokenizer(text, add_special_tokens=False).input_ids
    model = Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    inputs = {"pixel_values": pixels["pixel_values"], "image_position_ids": pixels["image_position_ids"]}
    image_token = model.config.image_token_id

    def forward(input_ids: Any) -> Any:
        # mm_token_type_ids marks the image tokens: the 26B/31B layouts' bidirectional
        # image attention is built from it.
        return model(input_ids=input_ids, mm_token_type_ids=(input_ids == image_token).int(), **inputs).logits

    return ids, _greedy_logprobs(forward, ids, steps)


def _greedy_logprobs(forward: Callable[[Any], Any], ids: list[int], steps: int) -> list[list[float]]:
    """Log-probabilities at each greedy step, by full forwards (no cache)."""
    import torch

    tokens, steps_logprobs = list(ids), []
    with torch.no_grad():
        for _ in range(steps):
            logprobs = torch.log_softmax(forward(torch.tensor([tokens]))[0, -1].float(), dim=-1)
            steps_logprobs.append(logprobs.tolist())
            tokens.append(int(logprobs.argmax()))
    return steps_logprobs


def qwen_vl_reference(path: Path, question: str, image: Any, steps: int = 1) -> tuple[list[int], list[list[float]]]:
    """As gemma4_reference, for the Qwen-VL grid family (Qwen2.5-VL, Qwen3-VL):
    transformers' Qwen2-VL image processor (the PIL one, which both use), the pad token
    repeated once per merged patch, M-RoPE positions (and Qwen3-VL's DeepStack) by
    transformers' own model."""
    import torch
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    saved = json.loads((Path(path) / "preprocessor_config.json").read_text())
    keys = ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels", "size")
    processor = Qwen2VLImageProcessorPil(
        **{key: saved[key] for key in (*keys, "image_mean", "image_std") if key in saved}
    )
    pixels = processor(images=[image], return_tensors="pt")
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = user_turn(tokenizer, question)
    count = int(pixels["image_grid_thw"][0].prod()) // saved["merge_size"] ** 2
    text = text.replace(QWEN_VL_TOKENS["image_token"], QWEN_VL_TOKENS["image_token"] * count)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    model_type = json.loads((Path(path) / "config.json").read_text())["model_type"]
    model_class = Qwen3VLForConditionalGeneration if model_type == "qwen3_vl" else Qwen2_5_VLForConditionalGeneration
    model = model_class.from_pretrained(path, dtype=torch.float32).eval()
    image_token = model.config.image_token_id
    inputs = {"pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"]}

    def forward(input_ids: Any) -> Any:
        return model(input_ids=input_ids, mm_token_type_ids=(input_ids == image_token).int(), **inputs).logits

    return ids, _greedy_logprobs(forward, ids, steps)


def vlm_reference(path: Path, question: str, image: Any, steps: int = 1) -> tuple[list[int], list[list[float]]]:
    """The reference numbers for a tiny VLM: transformers' forward, or for Kimi-VL, which
    transformers has no class for, mlx-vlm's (devtools/tiny_kimi_vl.py)."""
    model_type = json.loads((Path(path) / "config.json").read_text())["model_type"]
    references = {
        "gemma4": gemma4_reference,
        "qwen2_5_vl": qwen_vl_reference,
        "qwen3_vl": qwen_vl_reference,
        "kimi_vl": kimi_vl_reference,
    }
    return references[model_type](path, question, image, steps)
