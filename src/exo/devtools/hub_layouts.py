"""Reference models and checkpoints in the layout a family's Hugging Face checkpoints use.

`save_pretrained` writes what transformers' own loader reads back, which for some
families is not what the published checkpoints hold (and so not what mlx-lm's `sanitize`
reads). `to_hub_layout` rewrites the tensors transformers saved into the published
layout; the numbers are the transformers model's, only names and shapes change (gpt-oss'
experts are MXFP4 as published: `as_published` first rounds them to it in the
transformers model too).
`reference_model` builds the transformers model of a config, also for the two families
transformers has no causal-LM class of their own model_type for (Kimi K2.5, Step 3.5):
each says below why what it builds is transformers' computation of that model."""

from types import SimpleNamespace

import torch

# transformers builds Kimi K2.5's language model as AutoModel.from_config(text_config)
# with text_config's model_type kimi_k2 read as deepseek_v3 (Kimi_K25Config,
# Kimi_K25Model): the reference of a text prompt is DeepseekV3ForCausalLM of the text part.
TEXT_PART_REFERENCE = frozenset({"kimi_k25"})


class Step3p5ForCausalLM(torch.nn.Module):
    """Step 3.5 as transformers computes it: transformers has no causal-LM class for
    model_type step3p5, but its Step 3.7 Flash language model is that architecture
    (Step3p7TextConfig's model_type is step3p5, and it reads Step 3.5's config keys:
    attention_other_setting, moe_layers_enum, per-layer rope_theta and
    partial_rotary_factors, swiglu_limits). Step3p7ForConditionalGeneration runs a text
    prompt through Step3p7TextModel and a linear head; so does this."""

    def __init__(self, config):
        from transformers.models.step3p7.modeling_step3p7 import Step3p7TextModel

        super().__init__()
        self.config = config
        self.model = Step3p7TextModel(config)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, cache=None, use_cache: bool = False, **_) -> SimpleNamespace:
        out = self.model(input_ids=input_ids, cache=cache, use_cache=use_cache)
        return SimpleNamespace(logits=self.lm_head(out.last_hidden_state), cache=out.cache)


def reference_model(model_type: str, hf_config):
    """A float32 transformers model of `hf_config`, for the family `model_type`."""
    import transformers

    if model_type == "step3p5":
        return Step3p5ForCausalLM(hf_config).float().eval()
    if model_type in TEXT_PART_REFERENCE:
        hf_config = hf_config.get_text_config()
    return transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()


_MXFP4_GROUP = 32
# openai/gpt-oss' quantization_config: only the experts are MXFP4.
_GPT_OSS_QUANTIZATION = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}


def _mxfp4_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] float as MXFP4: blocks [..., out, in/32, 16] (two 4-bit E2M1 codes
    a byte, the even element in the low nibble) and E8M0 scales [..., out, in/32]. MLX's
    quantizer makes the codes (its packing and scales are the format's); which codes it
    picks does not matter, both sides read the same ones."""
    import mlx.core as mx
    import numpy as np

    codes, scales = mx.quantize(mx.array(weight.numpy()), group_size=_MXFP4_GROUP, bits=4, mode="mxfp4")[:2]
    blocks = np.array(codes).view(np.uint8).reshape(*weight.shape[:-1], weight.shape[-1] // _MXFP4_GROUP, 16)
    return torch.from_numpy(blocks.copy()), torch.from_numpy(np.array(scales))


def _gpt_oss_experts_as_mxfp4(model) -> None:
    """Rounds every expert matrix to what its MXFP4 blocks hold, dequantized by
    transformers' own gpt-oss loader (`convert_moe_packed_tensors`), so the reference
    computes with exactly the published checkpoint's numbers."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    with torch.no_grad():
        for layer in model.model.layers:
            for param in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                blocks, scales = _mxfp4_blocks(param.transpose(1, 2).contiguous())
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))


def _gpt_oss(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """openai/gpt-oss stores each expert's matrices as [out, in] MXFP4 blocks
    (`experts.gate_up_proj_blocks` [E, 2I, H/32, 16] with gate and up rows interleaved,
    `experts.gate_up_proj_scales` [E, 2I, H/32], the same for `down_proj` [E, H, I]);
    transformers computes x @ W with them as [in, out]. Biases and everything else as
    published, in float."""
    out = {}
    for key, value in tensors.items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[f"{key}_blocks"], out[f"{key}_scales"] = _mxfp4_blocks(value.transpose(1, 2).contiguous())
        else:
            out[key] = value.contiguous()
    return out


def _qwen3_5_moe(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen3.5 MoE checkpoints keep every layer's experts fused (`experts.gate_up_proj`
    [E, 2I, H], gate rows then up rows; `experts.down_proj` [E, H, I]) under
    `model.language_model.`; transformers saves them split per expert under `model.`."""
    out, per_expert = {}, {}
    for key, value in tensors.items():
        if ".mlp.experts." in key:
            prefix, _, rest = key.partition(".mlp.experts.")
            index, _, name = rest.partition(".")
            per_expert.setdefault(prefix, {}).setdefault(name, {})[int(index)] = value
            continue
        out[key.replace("model.", "model.language_model.", 1) if key.startswith("model.") else key] = value
    for prefix, names in per_expert.items():
        stacked = {name: torch.stack([experts[i] for i in sorted(experts)]) for name, experts in names.items()}
        target = prefix.replace("model.", "model.language_model.", 1) + ".mlp.experts."
        out[target + "gate_up_proj"] = torch.cat([stacked["gate_proj.weight"], stacked["up_proj.weight"]], dim=1)
        out[target + "down_proj"] = stacked["down_proj.weight"]
    return out


def _kimi_k25(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Kimi K2.5 checkpoints hold the DeepSeek V3 text model under `language_model.`
    (experts split per expert, as transformers saves DeepSeek V3), beside the vision
    tower and projector, which a text reference has none of."""
    return {f"language_model.{key}": value for key, value in tensors.items()}


_STEP3P5_NAMES = (
    (".mlp.gate.e_score_correction_bias", ".moe.router_bias"),
    (".mlp.gate.", ".moe.gate."),
    (".mlp.experts.down_proj", ".moe.down_proj.weight"),
    (".mlp.shared_experts.", ".share_expert."),
)


def _step3p5(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Step 3.5 checkpoints hold each MoE layer's experts stacked but not fused
    (`moe.gate_proj.weight`, `moe.up_proj.weight` [E, I, H], `moe.down_proj.weight`
    [E, H, I]), the router as `moe.gate` and `moe.router_bias`, the shared expert as
    `share_expert` beside `moe` (transformers' own renames, reversed); norms stay
    zero-centred, as published."""
    out = {}
    for key, value in tensors.items():
        if key.endswith(".mlp.experts.gate_up_proj"):
            prefix = key.removesuffix(".mlp.experts.gate_up_proj")
            gate, up = value.chunk(2, dim=1)
            out[f"{prefix}.moe.gate_proj.weight"], out[f"{prefix}.moe.up_proj.weight"] = gate, up
            continue
        for old, new in _STEP3P5_NAMES:
            if old in key:
                key = key.replace(old, new)
                break
        out[key] = value
    return {key: value.contiguous() for key, value in out.items()}


_LAYOUTS = {"gpt_oss": _gpt_oss, "qwen3_5_moe": _qwen3_5_moe, "kimi_k25": _kimi_k25, "step3p5": _step3p5}


def has_own_layout(model_type: str) -> bool:
    return model_type in _LAYOUTS


def as_published(model_type: str, model) -> dict:
    """Rounds `model`'s weights to what the published format can hold (gpt-oss' MXFP4
    experts); returns what the published config.json says of that format."""
    if model_type == "gpt_oss":
        _gpt_oss_experts_as_mxfp4(model)
        return {"quantization_config": _GPT_OSS_QUANTIZATION}
    return {}


def to_hub_layout(model_type: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors transformers saved for `model_type`, in its published layout."""
    return _LAYOUTS[model_type](tensors)
