"""Images into a model's prompt: mlx-vlm's vision tower, projector and image processor
beside exo's (mlx-lm's) language model.

A prompt with images is expanded the way the family's processor expands it (each image's
placeholder becomes its run of soft tokens), the tower encodes each image apart (images of
different sizes make different runs), and prefill feeds the language model embeddings in
which each run's positions carry the image's features instead of the token's embedding.
Only prefill sees image positions: the chat template ends with the generation prompt.

Gemma 4 needs three things mlx-vlm's whole model does and a bare language model does not:
the features divided by the text embedding scale (the language model multiplies its input
by it), image positions looked up as the pad token in the per-layer embedding table
(E2B/E4B), and the projector (`embed_vision`) applied to the pooled tower output.

Qwen3-VL's tower also gives DeepStack features, added after the first decoder layers
(engine/mlx/deepstack.py); they travel with the prompt to every rank."""

import io
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_vlm.models.gemma4.config import VisionConfig as Gemma4VisionConfig
from mlx_vlm.models.gemma4.gemma4 import MultimodalEmbedder
from mlx_vlm.models.gemma4.processing_gemma4 import Gemma4ImageProcessor
from mlx_vlm.models.gemma4.vision import VisionModel as Gemma4VisionModel
from mlx_vlm.models.kimi_vl.config import VisionConfig as KimiVisionConfig
from mlx_vlm.models.kimi_vl.kimi_vl import KimiVLMultiModalProjector
from mlx_vlm.models.kimi_vl.processing_kimi_vl import KimiVLImageProcessor
from mlx_vlm.models.kimi_vl.vision import VisionModel as KimiVisionModel
from mlx_vlm.models.qwen2_5_vl.config import VisionConfig as QwenVisionConfig
from mlx_vlm.models.qwen2_5_vl.vision import VisionModel as QwenVisionModel
from mlx_vlm.models.qwen3_vl.config import VisionConfig as Qwen3VisionConfig
from mlx_vlm.models.qwen3_vl.vision import VisionModel as Qwen3VisionModel
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from exo.engine.mlx.deepstack import DeepStack, DeepStackRun, attach_deepstack, install_deepstack
from exo.engine.mlx.image_attention import attach_image_spans, install_image_overlay
from exo.engine.mlx.mrope import RopePositions, attach_positions, image_positions, install_mrope
from exo.engine.mlx.parallel import broadcast_bytes
from exo.shared.models.vision import (
    PROJECTOR_PREFIXES,
    TOWER_PREFIXES,
    bidirectional_images,
    image_token_id,
    moonvit_fields,
    vision_runs,
)
from exo.shared.types.text_generation import ImageInput, TextGenerationTaskParams, image_hashes_in_order


@dataclass
class Encoded:
    """One image through the tower and projector."""

    features: mx.array  # (tokens, text hidden)
    grid: tuple[int, int] | None = None  # merged (rows, columns), for the grid families
    deepstack: mx.array | None = None  # (levels, tokens, text hidden), Qwen3-VL


Encode = Callable[[Image.Image], Encoded]


@dataclass
class ImageRun:
    """One image's soft tokens: where they start in the prompt and what they carry."""

    start: int
    features: mx.array  # (tokens, hidden), ready to stand in for token embeddings
    sha256: str
    grid: tuple[int, int] | None = None
    deepstack: mx.array | None = None  # (levels, tokens, hidden)

    @property
    def end(self) -> int:
        return self.start + self.features.shape[0]


@dataclass
class VisionPrompt:
    tokens: list[int]
    runs: list[ImageRun]
    # The prompt as the prefix cache keys it: each image's run holds a number drawn
    # from the image's hash instead of the image token, so a different image is a miss.
    key: list[int]
    image_token_id: int
    # What image positions read in the per-layer embedding table (Gemma 4 E2B/E4B).
    pad_token_id: int
    # 3-D rotary positions (Qwen2.5-VL), where the family has them.
    positions: RopePositions | None = None
    # Image tokens attend to later ones of their image (Gemma 4 26B-A4B, 31B): a prefill
    # chunk must hold an image's whole run.
    whole_runs: bool = False

    @property
    def deepstack(self) -> DeepStack | None:
        runs = [DeepStackRun(run.start, run.deepstack) for run in self.runs if run.deepstack is not None]
        return DeepStack(runs) if runs else None

    @property
    def spans(self) -> list[tuple[int, int]]:
        return [(run.start, run.end) for run in self.runs]

    def chunk_end(self, start: int, end: int) -> int:
        """`end`, or where the chunk from `start` must end instead so that no image run
        is cut: before the run, or after it when the chunk starts at it."""
        if not self.whole_runs:
            return end
        for run in self.runs:
            if run.start < end < run.end:
                return run.start if run.start > start else run.end
        return end

    def chunk_inputs(self, inner: Any, start: int, end: int) -> dict[str, mx.array]:
        """The language model's inputs for prompt positions [start, end): token ids with
        image positions as the pad token, and embeddings with each image's features
        spliced in where its run overlaps the chunk."""
        ids = [self.pad_token_id if t == self.image_token_id else t for t in self.tokens[start:end]]
        id_array = mx.array(ids)[None]
        text = inner.embed_tokens(id_array)
        pieces: list[mx.array] = []
        at = start
        for run in self.runs:
            lo, hi = max(run.start, start), min(run.end, end)
            if lo >= hi:
                continue
            pieces.append(text[:, at - start : lo - start])
            pieces.append(run.features[lo - run.start : hi - run.start][None].astype(text.dtype))
            at = hi
        pieces.append(text[:, at - start :])
        return {"inputs": id_array, "input_embeddings": mx.concatenate(pieces, axis=1)}


def share_prompt(
    prompt: VisionPrompt | None, group: mx.distributed.Group, stream: Any, failure: str | None = None
) -> VisionPrompt:
    """Rank 0's prompt (it alone runs the tower) on every rank of a pipeline: each rank
    embeds its own inputs, Gemma 4's per-layer inputs are projected from the
    embeddings, image features included, and Qwen3-VL's DeepStack levels are added by
    whichever rank holds their layers. The layout goes as JSON, the features (each
    image's, then its DeepStack levels) in one all-sum to which the other ranks add zeros.
    Rank 0's `failure` (its images would not prepare) goes instead, and every rank
    raises it, so none is left waiting in a collective the others skipped."""
    layout = json.dumps({"failure": failure}).encode() if failure is not None else None
    if prompt is not None and failure is None:
        runs = [{"start": r.start, "tokens": r.features.shape[0], "sha256": r.sha256} for r in prompt.runs]
        fields = {"tokens": prompt.tokens, "key": prompt.key, "runs": runs}
        fields |= {"image_token_id": prompt.image_token_id, "pad_token_id": prompt.pad_token_id}
        fields["hidden"] = prompt.runs[0].features.shape[1] if prompt.runs else 0
        fields["levels"] = _levels(prompt.runs[0]) if prompt.runs else 0
        fields["positions"] = None if prompt.positions is None else prompt.positions.table.tolist()
        fields["whole_runs"] = prompt.whole_runs
        layout = json.dumps(fields).encode()
    shared = json.loads(broadcast_bytes(layout, group, stream))
    if "failure" in shared:
        raise ValueError(shared["failure"])
    total, levels = sum(run["tokens"] for run in shared["runs"]), shared["levels"]
    features = (
        mx.concatenate([_stacked_features(run) for run in prompt.runs], axis=1)
        if prompt is not None and prompt.runs
        else mx.zeros((1 + levels, total, shared["hidden"]), dtype=mx.float32)
    )
    features = mx.distributed.all_sum(features, group=group, stream=stream)
    # Now, not inside prefill's graph: there it could run after a rank's send, before the
    # other's receive, and the two ranks would wait on each other.
    mx.eval(features)
    runs, at = [], 0
    for run in shared["runs"]:
        mine = features[:, at : at + run["tokens"]]
        deepstack = mine[1:] if levels else None
        runs.append(ImageRun(start=run["start"], features=mine[0], sha256=run["sha256"], deepstack=deepstack))
        at += run["tokens"]
    return VisionPrompt(
        tokens=shared["tokens"],
        runs=runs,
        key=shared["key"],
        image_token_id=shared["image_token_id"],
        pad_token_id=shared["pad_token_id"],
        positions=None if shared["positions"] is None else RopePositions(np.array(shared["positions"])),
        whole_runs=shared["whole_runs"],
    )


def _levels(run: ImageRun) -> int:
    return 0 if run.deepstack is None else run.deepstack.shape[0]


def _stacked_features(run: ImageRun) -> mx.array:
    """(1 + levels, tokens, hidden): the run's features, then its DeepStack levels."""
    features = run.features.astype(mx.float32)[None]
    if run.deepstack is None:
        return features
    return mx.concatenate([features, run.deepstack.astype(mx.float32)])


def _text_positions(start: int, count: int) -> np.ndarray:
    return np.tile(np.arange(start, start + count), (3, 1))


def _rope_positions(length: int, runs: list[ImageRun]) -> RopePositions:
    """Text counts on along all three axes; an image's run spans its rows and columns
    from where it starts, and the text after it resumes one past its largest."""
    pieces, at, position = [], 0, 0
    for run in runs:
        assert run.grid is not None
        pieces.append(_text_positions(position, run.start - at))
        position += run.start - at
        pieces.append(image_positions(position, *run.grid))
        position = int(pieces[-1].max()) + 1
        at = run.end
    pieces.append(_text_positions(position, length - at))
    return RopePositions(np.concatenate(pieces, axis=1))


class VisionEncoder:
    """The vision side of one loaded model."""

    def __init__(
        self, config: dict[str, Any], encode: Encode, rope_positions: bool = False, placeholder_text: str | None = None
    ) -> None:
        self.whole_runs = bidirectional_images(config)
        self.image_token_id = cast(int, image_token_id(config))
        self.boi_token_id = config.get("boi_token_id")
        self.eoi_token_id = config.get("eoi_token_id")
        self.pad_token_id = int(config.get("text_config", {}).get("pad_token_id") or 0)
        self._encode = encode
        self.rope_positions = rope_positions
        self.embed_scale = 1.0
        # What a chat template writes for an image (the Qwen family wraps its pad token).
        start, end = config.get("vision_start_token_id"), config.get("vision_end_token_id")
        self.placeholder = [self.image_token_id]
        if start is not None and end is not None:
            self.placeholder = [int(start), self.image_token_id, int(end)]
        # Or as text the tokenizer reads (Kimi-VL's has a word inside its markers).
        self.placeholder_text = placeholder_text

    def bind(self, inner: Any, tokenizer: Any) -> None:
        """Takes the language model's embedding scale (Gemma multiplies its inputs by it),
        and the begin and end-of-image markers from the tokenizer where it names them:
        Gemma4Processor writes the tokenizer's boi/eoi tokens around each run, whatever
        config.json's ids say."""
        self.embed_scale = float(getattr(inner, "embed_scale", 1.0))
        for marker in ("boi", "eoi"):
            token = getattr(tokenizer, f"{marker}_token", None)
            token_id = tokenizer.convert_tokens_to_ids(token) if isinstance(token, str) and token else None
            if isinstance(token_id, int):
                setattr(self, f"{marker}_token_id", token_id)

    def raw_prompt(
        self, tokenizer: Any, text: str, images: list[tuple[str, bytes]]
    ) -> tuple[list[int], list[tuple[str, bytes]]]:
        """A raw prompt's tokens with each image's placeholder where Ollama's `[img-N]`
        tag names it (images no tag names go first, as a message's do), and the images
        in the order their placeholders come."""
        pieces = _IMAGE_TAG.split(text)
        tagged = [int(number) for number in pieces[1::2]]
        if any(number >= len(images) for number in tagged) or len(set(tagged)) < len(tagged):
            raise ValueError(f"the prompt's image tags {tagged} do not name each of its {len(images)} images once")
        untagged = [number for number in range(len(images)) if number not in tagged]
        placeholder = self.placeholder
        if self.placeholder_text is not None:
            placeholder = tokenizer.encode(self.placeholder_text, add_special_tokens=False)
        tokens = placeholder * len(untagged)
        for index, piece in enumerate(pieces):
            if index % 2:
                tokens += placeholder
            elif piece:
                tokens += tokenizer.encode(piece, add_special_tokens=False)
        return tokens, [images[number] for number in [*untagged, *tagged]]

    def prepare(self, prompt: list[int], images: list[tuple[str, bytes]]) -> VisionPrompt:
        """Expands each image placeholder of `prompt` (in order) into its run of soft tokens."""
        places = [i for i, token in enumerate(prompt) if token == self.image_token_id]
        if len(places) != len(images):
            raise ValueError(f"the chat template placed {len(places)} images, the request has {len(images)}")
        tokens: list[int] = []
        key: list[int] = []
        runs: list[ImageRun] = []
        last = 0
        for place, (sha256, data) in zip(places, images, strict=True):
            tokens += prompt[last:place]
            key += prompt[last:place]
            encoded = self._encode(Image.open(io.BytesIO(data)))
            features = encoded.features / self.embed_scale
            if self.boi_token_id is not None:
                tokens.append(int(self.boi_token_id))
                key.append(int(self.boi_token_id))
            runs.append(
                ImageRun(
                    start=len(tokens), features=features, sha256=sha256, grid=encoded.grid, deepstack=encoded.deepstack
                )
            )
            count = features.shape[0]
            tokens += [self.image_token_id] * count
            key += [_hash_token(sha256)] * count
            if self.eoi_token_id is not None:
                tokens.append(int(self.eoi_token_id))
                key.append(int(self.eoi_token_id))
            last = place + 1
        tokens += prompt[last:]
        key += prompt[last:]
        return VisionPrompt(
            tokens=tokens,
            runs=runs,
            key=key,
            image_token_id=self.image_token_id,
            pad_token_id=self.pad_token_id,
            positions=_rope_positions(len(tokens), runs) if self.rope_positions else None,
            whole_runs=self.whole_runs,
        )


# Ollama's mark of where image N goes in a raw prompt.
_IMAGE_TAG = re.compile(r"\[img-(\d+)\]")


def _hash_token(sha256: str) -> int:
    # Negative, so it is never a real token id.
    return -1 - int(sha256[:15], 16)


def images_of(params: TextGenerationTaskParams, held: list[ImageInput]) -> list[tuple[str, bytes]]:
    """The request's images in the order its messages show them, as (sha256, bytes);
    `held` are the bytes rank 0 kept back from the other ranks."""
    by_hash = {image.sha256: image for image in [*params.images, *held] if image.data_base64}
    return [(sha, by_hash[sha].data) for sha in image_hashes_in_order(params)]


def _weights(model_dir: Path, prefixes: tuple[str, ...]) -> dict[str, mx.array]:
    found: dict[str, mx.array] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        loaded = cast(dict[str, mx.array], mx.load(str(file)))
        for name, value in loaded.items():
            for prefix in prefixes:
                if name.startswith(prefix):
                    found[name[len(prefix) :]] = value
                    break
    return found


def _load_into(module: nn.Module, weights: dict[str, mx.array], config: dict[str, Any]) -> None:
    """Quantised checkpoints ship linears as packed weights with scales and biases."""
    quantization = config.get("quantization")
    if quantization and any(name.endswith(".scales") for name in weights):
        nn.quantize(
            module,
            group_size=int(quantization.get("group_size", 64)),
            bits=int(quantization.get("bits", 4)),
            class_predicate=lambda path, _m: f"{path}.scales" in weights,
        )
    module.load_weights(list(weights.items()))
    mx.eval(module.parameters())


def _gemma4(model_dir: Path, config: dict[str, Any]) -> VisionEncoder:
    vision_config = Gemma4VisionConfig.from_dict(config["vision_config"])
    tower = Gemma4VisionModel(vision_config)
    projector = MultimodalEmbedder(
        embedding_dim=vision_config.hidden_size,
        text_hidden_size=int(config["text_config"]["hidden_size"]),
        eps=vision_config.rms_norm_eps,
    )
    tower_weights = _weights(model_dir, TOWER_PREFIXES["gemma4"])
    if not vision_config.use_clipped_linears:
        tower_weights = {k: v for k, v in tower_weights.items() if not k.endswith(("_min", "_max"))}
    _load_into(tower, tower_weights, config)
    dtype = tower.patch_embedder.input_proj.weight.dtype
    _load_into(projector, _weights(model_dir, PROJECTOR_PREFIXES["gemma4"]), config)
    processor = Gemma4ImageProcessor.from_pretrained(str(model_dir))

    def encode(image: Image.Image) -> Encoded:
        # One image per tower run: each has its own size and soft-token count.
        batch, counts = processor(images=[image], return_tensors="np")
        pixels = mx.array(np.asarray(batch["pixel_values"][0]))[None]
        projected = projector(tower(pixels.astype(dtype)))
        features = projected.reshape(-1, projected.shape[-1])
        if features.shape[0] != counts[0]:
            raise ValueError(f"the vision tower gave {features.shape[0]} soft tokens, the processor {counts[0]}")
        return Encoded(features)

    return VisionEncoder(config, encode)


def _qwen_vl(model_dir: Path, config: dict[str, Any]) -> VisionEncoder:
    """The grid family's tower: Qwen2.5-VL's (window attention), or Qwen3-VL's, which
    also gives, per DeepStack level, the features of one of its early blocks through
    that level's own merger."""
    qwen3 = config["model_type"] == "qwen3_vl"
    # The tower checks its model_type is the family's; HF names it by the vision part.
    fields = {**config["vision_config"], "model_type": config["model_type"]}
    if qwen3:
        vision_config = Qwen3VisionConfig.from_dict(fields)
        tower: Any = Qwen3VisionModel(vision_config)
    else:
        vision_config = QwenVisionConfig.from_dict(fields)
        tower = QwenVisionModel(vision_config)
    _load_into(tower, tower.sanitize(_weights(model_dir, TOWER_PREFIXES[config["model_type"]])), config)
    dtype = tower.patch_embed.proj.weight.dtype
    # transformers' image processor of the PIL kind (both families use it): no torchvision.
    processor = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
    merge = vision_config.spatial_merge_size

    def encode(image: Image.Image) -> Encoded:
        batch = processor(images=[image], return_tensors="np")
        grid = np.asarray(batch["image_grid_thw"])
        out = tower(mx.array(np.asarray(batch["pixel_values"])).astype(dtype), mx.array(grid))
        features, levels = cast(tuple[mx.array, list[mx.array]], out) if qwen3 else (out, [])
        _, rows, columns = (int(n) for n in grid[0])
        return Encoded(features, (rows // merge, columns // merge), mx.stack(levels) if levels else None)

    return VisionEncoder(config, encode, rope_positions=True)


class _KimiImageProcessor(KimiVLImageProcessor):
    """mlx-vlm's Kimi-VL processor (torch-free), reading the pixels through numpy: its own
    goes through a Python list of every pixel."""

    def to_mlx(self, image: Image.Image) -> mx.array:
        pixels = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
        return mx.array(pixels.transpose(2, 0, 1))


# What Kimi-VL's chat template writes for an image.
KIMI_PLACEHOLDER = "<|media_start|>image<|media_content|><|media_pad|><|media_end|>"


def _kimi_vl(model_dir: Path, config: dict[str, Any]) -> VisionEncoder:
    """MoonViT (a position table interpolated to each image's grid, 2-D rotary attention,
    2x2 patches merged) and the projector into the text width."""
    vision_config = KimiVisionConfig.from_dict(moonvit_fields(config["vision_config"]))
    tower = KimiVisionModel(vision_config)
    # The hub's names (vision_tower.encoder.blocks.N.wqkv, torch's conv layout) as
    # mlx-vlm's sanitize renames them, given the full names it expects.
    found = _weights(model_dir, TOWER_PREFIXES["kimi_vl"])
    named = {"vision_tower." + name.replace("encoder.", "", 1): value for name, value in found.items()}
    tower_weights = {name.removeprefix("vision_tower."): value for name, value in tower.sanitize(named).items()}
    _load_into(tower, tower_weights, config)
    text_hidden = int(config["text_config"]["hidden_size"])
    shapes = SimpleNamespace(vision_config=vision_config, text_config=SimpleNamespace(hidden_size=text_hidden))
    projector = KimiVLMultiModalProjector(cast(Any, shapes))
    _load_into(projector, _weights(model_dir, PROJECTOR_PREFIXES["kimi_vl"]), config)
    dtype = tower.patch_embed.proj.weight.dtype
    processor = _KimiImageProcessor.from_pretrained(str(model_dir))

    def encode(image: Image.Image) -> Encoded:
        batch = processor(images=[image])
        pixels = cast(mx.array, batch["pixel_values"]).transpose(0, 2, 3, 1).astype(dtype)
        # One (tokens, merged patches, width) piece per image.
        merged = cast(list[mx.array], tower(pixels, batch["image_grid_hws"], grid_shapes=batch["_grid_shapes"]))
        return Encoded(projector(merged))

    return VisionEncoder(config, encode, placeholder_text=KIMI_PLACEHOLDER)


# Per config model_type (shared/models/vision.py lists them): how to build the vision side.
_FAMILIES: dict[str, Callable[[Path, dict[str, Any]], VisionEncoder]] = {
    "gemma4": _gemma4,
    "qwen2_5_vl": _qwen_vl,
    "qwen3_vl": _qwen_vl,
    "kimi_vl": _kimi_vl,
}


def install_image_attention(model_dir: Path, inner: Any, first_layer: int = 0) -> bool:
    """What a family's language model needs to attend to images as the family does, on
    every rank: 3-D rotary positions (Qwen2.5-VL and Qwen3-VL, engine/mlx/mrope.py),
    DeepStack (Qwen3-VL, engine/mlx/deepstack.py; `first_layer` is this rank's first
    layer in the model) or bidirectional image attention on sliding layers (Gemma 4
    26B-A4B/31B, engine/mlx/image_attention.py). True where installed: then each
    request's cache must say its images (attach_prompt_images)."""
    config = json.loads((model_dir / "config.json").read_text())
    if not vision_runs(config):
        return False
    if config["model_type"] == "qwen3_vl":
        install_deepstack(inner, first_layer, len(config["vision_config"].get("deepstack_visual_indexes") or []))
    if config["model_type"] in ("qwen2_5_vl", "qwen3_vl"):
        return install_mrope(inner, config.get("text_config", config))
    if bidirectional_images(config):
        install_image_overlay(inner)
        return True
    return False


def attach_prompt_images(cache: list[Any], prompt: VisionPrompt | None) -> None:
    """The request's image positions and spans on its cache entries (None clears what a
    cache from the prefix cache may still carry)."""
    attach_positions(cache, prompt.positions if prompt is not None else None)
    attach_deepstack(cache, prompt.deepstack if prompt is not None else None)
    attach_image_spans(cache, prompt.spans if prompt is not None and prompt.whole_runs else None)


def load_vision(model_dir: Path) -> VisionEncoder | None:
    """The model's vision side, or None for a model without one (or one exo cannot run)."""
    config = json.loads((model_dir / "config.json").read_text())
    if not vision_runs(config):
        return None
    return _FAMILIES[config["model_type"]](model_dir, config)
