"""The GGUF converter (engine/llamacpp/gguf_convert.py) gives llama.cpp the checkpoint's
own numbers.

Float: for llama, qwen2, qwen3, qwen3_moe, glm4_moe, minimax_m2, deepseek_v3 and
glm4_moe_lite a random float32 transformers model with sharp weights
(N(0, 0.08), devtools/onboard.py's write_reference_model) is converted to an F32 GGUF and
loaded by llama-cpp-python; its logprobs over a 64-token prompt must equal transformers'
full forward within 1e-4 (llama's q/k row permutation and Llama 3's rope factors
included: without either llama is far off; DeepSeek V3's YaRN, expert groups and MLA
split). mlx-lm's float layout of DeepSeek V3 (kv_b_proj split as embed_q /
unembed_out) gives mlx-lm's logprobs within 1e-4.

MLX 4-bit with rows of whole 256-blocks (a llama of width 256) becomes Q4_K, llama.cpp's
fast 4-bit type: every code kept, each 32-weight sub-block's scale and min rounded to 6
bits of its block's; each weight is within a small fraction of its group's step of
mx.dequantize, and its logprobs are as far from the float model's as mlx-lm's forward
of the 4-bit weights (within 15%; measured 2% further on the demo model).

MLX 4-bit: the tiny llama (width 64, no whole 256-blocks) quantized by mlx-lm (affine,
groups of 64, bf16 scales, the embedding too) becomes Q4_1 without requantizing: gguf's dequantize of every weight
equals mx.dequantize bit for bit. Against mlx-lm's forward of that 4-bit model (in
float32, its scales widened exactly): the same weights widened to F32 in the GGUF give
its logprobs within 1e-4 (measured 1.6e-6); served as Q4_1 they are 4.6e-2 off, not
within 1e-3, because llama.cpp's CPU Q4_1 matmul rounds each activation row to Q8_1
blocks first (a kernel property, not the conversion's: the weights are exact). mlx-lm's
qwen3_moe, glm4_moe and minimax_m2 (experts stacked as switch_mlp) widened: 1.4e-6 to 1.8e-6.

The cache: a second call converts nothing; a changed weight file converts again."""

import copy
import json
import os
from pathlib import Path

import llama_cpp
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFReader, dequantize
from mlx.utils import tree_map
from mlx_lm import convert as mlx_convert
from mlx_lm.utils import load_model

from exo.devtools.onboard import random_prompt, write_reference_model
from exo.devtools.tiny_configs import TINY_CONFIGS
from exo.engine.llamacpp.gguf_convert import convert, gguf_for, supports
from exo.engine.llamacpp.native import extra_buffer_types

PROMPT_LEN = 64
FLOAT_TOLERANCE = 1e-4
# llama.cpp's Q8_1 activations on these sharp tiny weights cost 4.6e-2 (see above).
Q4_ACTIVATION_TOLERANCE = 0.1


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _as_the_engine_loads() -> llama_cpp.llama_model_params:
    """llama.cpp's default model params with the engine's extra buffer types (repacked
    layouts; on unless EXO_LLAMACPP_EXTRA_BUFTS=0, for a build whose AMX faults)."""
    params = _default_model_params()
    params.use_extra_bufts = extra_buffer_types()
    return params


_default_model_params = llama_cpp.llama_cpp.llama_model_default_params
llama_cpp.llama_cpp.llama_model_default_params = _as_the_engine_loads


def _llama_cpp_logprobs(path: Path, prompt: list[int]) -> np.ndarray:
    # An f32 KV cache: llama.cpp's default f16 one alone is ~1e-3 off at full precision.
    llm = llama_cpp.Llama(
        str(path), logits_all=True, n_ctx=2 * PROMPT_LEN, n_threads=2, verbose=False,
        type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
    )  # fmt: skip
    llm.eval(prompt)
    return _log_softmax(np.array(llm.scores[: len(prompt)]))


def _progress_calls(model_dir: Path, cache: Path) -> tuple[Path, int]:
    calls = []
    path = gguf_for(model_dir, cache, lambda done, total: calls.append((done, total)))
    return path, len(calls)


@pytest.mark.parametrize(
    "family", ["llama", "qwen2", "qwen3", "qwen3_moe", "glm4_moe", "minimax", "deepseek_v3", "glm4_moe_lite"]
)
def test_float_gguf_matches_transformers(family: str, tmp_path: Path) -> None:
    import torch

    model = write_reference_model(tmp_path / "model", copy.deepcopy(TINY_CONFIGS[family]))
    prompt = random_prompt(model.config.vocab_size, PROMPT_LEN)
    with torch.no_grad():
        reference = _log_softmax(model(torch.tensor([prompt])).logits[0].float().numpy())
    path = gguf_for(tmp_path / "model", tmp_path / "cache")
    assert {t.tensor_type.name for t in GGUFReader(path).tensors} == {"F32"}
    diff = float(np.abs(_llama_cpp_logprobs(path, prompt) - reference).max())
    print(f"{family} F32: max |logprob diff| {diff:.2e}")
    assert diff <= FLOAT_TOLERANCE


@pytest.fixture(scope="module")
def mlx_4bit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("q4")
    write_reference_model(root / "float", copy.deepcopy(TINY_CONFIGS["llama"]))
    mlx_convert(str(root / "float"), str(root / "q4"), quantize=True, q_bits=4, q_group_size=64, dtype="bfloat16")
    return root / "q4"


def _as_hf_rows(rows: np.ndarray, name: str, config: dict) -> np.ndarray:
    """Undo llama.cpp's interleaved q/k row order, back to the checkpoint's."""
    if not name.endswith(("attn_q.weight", "attn_k.weight")):
        return rows
    heads = config["num_attention_heads"] if "attn_q" in name else config["num_key_value_heads"]
    return rows.reshape(heads, rows.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(rows.shape)


def test_mlx_4bit_is_q4_1_bit_for_bit(mlx_4bit: Path, tmp_path: Path) -> None:
    config = json.loads((mlx_4bit / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 64
    weights = mx.load(str(mlx_4bit / "model.safetensors"))
    assert weights["model.embed_tokens.scales"].dtype == mx.bfloat16
    tensors = {t.name: t for t in GGUFReader(gguf_for(mlx_4bit, tmp_path)).tensors}
    quantized = [name.removesuffix(".scales") for name in weights if name.endswith(".scales")]
    assert "model.embed_tokens" in quantized and len(quantized) == 1 + 7 * config["num_hidden_layers"]
    gguf_names = {
        "model.embed_tokens": "token_embd.weight",
        "self_attn.q_proj": "attn_q.weight", "self_attn.k_proj": "attn_k.weight",
        "self_attn.v_proj": "attn_v.weight", "self_attn.o_proj": "attn_output.weight",
        "mlp.gate_proj": "ffn_gate.weight", "mlp.up_proj": "ffn_up.weight", "mlp.down_proj": "ffn_down.weight",
    }  # fmt: skip
    for base in quantized:
        layer, _, part = base.removeprefix("model.layers.").partition(".")
        name = gguf_names[base] if base in gguf_names else f"blk.{layer}.{gguf_names[part]}"
        expected = np.array(
            mx.dequantize(
                weights[base + ".weight"],
                weights[base + ".scales"].astype(mx.float32),
                weights[base + ".biases"].astype(mx.float32),
                group_size=64,
                bits=4,
            )
        )
        tensor = tensors[name]
        assert tensor.tensor_type.name == "Q4_1"
        got = _as_hf_rows(dequantize(tensor.data, tensor.tensor_type).reshape(expected.shape), name, config)
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), base


def _mlx_lm_logprobs(model_dir: Path, prompt: list[int]) -> np.ndarray:
    model, _ = load_model(model_dir)
    # float32 activations; bf16 -> f32 scales and biases are exact, so the weights are the same
    model.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype == mx.bfloat16 else a, model.parameters()))
    return _log_softmax(np.array(model(mx.array([prompt]))[0].astype(mx.float32)))


def _widened_and_q4_1(model_dir: Path, tmp_path: Path) -> tuple[float, float]:
    prompt = random_prompt(json.loads((model_dir / "config.json").read_text())["vocab_size"], PROMPT_LEN)
    reference = _mlx_lm_logprobs(model_dir, prompt)
    convert(model_dir, tmp_path / "widened.gguf", widen=True)
    widened = float(np.abs(_llama_cpp_logprobs(tmp_path / "widened.gguf", prompt) - reference).max())
    q4_1 = float(np.abs(_llama_cpp_logprobs(gguf_for(model_dir, tmp_path), prompt) - reference).max())
    print(f"{model_dir.name} against mlx-lm: widened to F32 {widened:.2e}, as Q4_1 {q4_1:.2e}")
    return widened, q4_1


def test_mlx_4bit_logprobs_match_mlx_lm(mlx_4bit: Path, tmp_path: Path) -> None:
    widened, q4_1 = _widened_and_q4_1(mlx_4bit, tmp_path)
    assert widened <= FLOAT_TOLERANCE
    assert q4_1 <= Q4_ACTIVATION_TOLERANCE


def test_mlx_4bit_with_256_blocks_is_q4_k_within_a_fraction_of_a_step(tmp_path: Path) -> None:
    config = copy.deepcopy(TINY_CONFIGS["llama"])
    config.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    write_reference_model(tmp_path / "float", config)
    model_dir = tmp_path / "q4"
    mlx_convert(str(tmp_path / "float"), str(model_dir), quantize=True, q_bits=4, q_group_size=64, dtype="bfloat16")
    weights = mx.load(str(model_dir / "model.safetensors"))
    tensors = {t.name: t for t in GGUFReader(gguf_for(model_dir, tmp_path / "cache")).tensors}
    assert {t.tensor_type.name for t in tensors.values() if len(t.shape) == 2} == {"Q4_K"}
    base = "model.layers.1.mlp.down_proj"
    scales = weights[base + ".scales"].astype(mx.float32)
    expected = np.array(
        mx.dequantize(weights[base + ".weight"], scales, weights[base + ".biases"].astype(mx.float32), group_size=64)
    )
    tensor = tensors["blk.1.ffn_down.weight"]
    got = dequantize(tensor.data, tensor.tensor_type).reshape(expected.shape)
    step = np.repeat(np.abs(np.array(scales)), 64, axis=-1)
    off = np.abs(got - expected) / step
    print(f"Q4_K vs mx.dequantize, in steps of each group: max {off.max():.3f}, mean {off.mean():.4f}")
    assert off.max() < 0.5 and off.mean() < 0.05  # a wrong code or packing is a whole step off
    # As far from the float model as mlx-lm's own forward of the 4-bit weights.
    prompt = random_prompt(json.loads((model_dir / "config.json").read_text())["vocab_size"], PROMPT_LEN)
    original = _llama_cpp_logprobs(gguf_for(tmp_path / "float", tmp_path / "cache"), prompt)
    mlx_off = float(np.abs(_mlx_lm_logprobs(model_dir, prompt) - original).mean())
    q4_k_off = float(np.abs(_llama_cpp_logprobs(gguf_for(model_dir, tmp_path / "cache"), prompt) - original).mean())
    print(f"mean |logprob diff| from the float model: mlx-lm 4-bit {mlx_off:.3f}, Q4_K {q4_k_off:.3f}")
    assert q4_k_off <= 1.15 * mlx_off


def test_exact_q4_keeps_q4_1_where_q4_k_fits(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = copy.deepcopy(TINY_CONFIGS["llama"])
    config.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    write_reference_model(tmp_path / "float", config)
    mlx_convert(str(tmp_path / "float"), str(tmp_path / "q4"), quantize=True, q_bits=4, q_group_size=64)
    monkeypatch.setenv("EXO_GGUF_EXACT_Q4", "1")
    kinds = {t.tensor_type.name for t in GGUFReader(gguf_for(tmp_path / "q4", tmp_path / "cache")).tensors}
    assert kinds == {"Q4_1", "F32"}


@pytest.mark.parametrize(("family", "moe_layer"), [("qwen3_moe", 0), ("glm4_moe", 1), ("minimax", 0)])
def test_mlx_4bit_moe_maps_stacked_experts(family: str, moe_layer: int, tmp_path: Path) -> None:
    """mlx-lm's MoE checkpoints: experts stacked as switch_mlp (Q4_1, groups of 32), the
    router F32, exactly: qwen3_moe's 8-bit one widened, not requantized, GLM's bf16 one
    (mlx-lm does not quantize it) widened; GLM's and MiniMax's router correction bias
    (MiniMax's experts renamed from mlx-lm's gate/down/up_proj back to w1/w2/w3), and
    GLM's shared expert, after its dense first layer."""
    write_reference_model(tmp_path / "float", copy.deepcopy(TINY_CONFIGS[family]))
    model_dir = tmp_path / "moe-q4"
    mlx_convert(str(tmp_path / "float"), str(model_dir), quantize=True, q_bits=4, q_group_size=32, dtype="bfloat16")
    kinds = {t.name: t.tensor_type.name for t in GGUFReader(gguf_for(model_dir, tmp_path)).tensors}
    layer = f"blk.{moe_layer}"
    assert kinds[f"{layer}.ffn_gate_exps.weight"] == "Q4_1" and kinds[f"{layer}.ffn_gate_inp.weight"] == "F32"
    if family != "qwen3_moe":
        assert kinds[f"{layer}.exp_probs_b.bias"] == "F32"
    assert (f"{layer}.ffn_gate_shexp.weight" in kinds) == (family == "glm4_moe")
    widened, _ = _widened_and_q4_1(model_dir, tmp_path)  # as Q4_1 0.23 off: Q8_1 activations flip experts
    assert widened <= FLOAT_TOLERANCE


def test_mlx_layout_mla_maps_its_split_kv_b(tmp_path: Path) -> None:
    """mlx-lm saves DeepSeek V3's kv_b_proj split per head as embed_q and unembed_out:
    llama.cpp's k_b and v_b. A float32 mlx-lm checkpoint gives mlx-lm's logprobs."""
    write_reference_model(tmp_path / "float", copy.deepcopy(TINY_CONFIGS["deepseek_v3"]))
    model_dir = tmp_path / "mlx"
    mlx_convert(str(tmp_path / "float"), str(model_dir), dtype="float32")
    assert any("embed_q" in name for name in mx.load(str(model_dir / "model.safetensors")))
    kinds = {t.name: t.tensor_type.name for t in GGUFReader(gguf_for(model_dir, tmp_path / "cache")).tensors}
    assert kinds["blk.0.attn_k_b.weight"] == kinds["blk.0.attn_v_b.weight"] == "F32"
    prompt = random_prompt(json.loads((model_dir / "config.json").read_text())["vocab_size"], PROMPT_LEN)
    diff = float(np.abs(_llama_cpp_logprobs(gguf_for(model_dir, tmp_path / "cache"), prompt)
                        - _mlx_lm_logprobs(model_dir, prompt)).max())  # fmt: skip
    print(f"deepseek_v3 in mlx-lm's layout against mlx-lm: {diff:.2e}")
    assert diff <= FLOAT_TOLERANCE


def test_cache_converts_once_and_again_when_weights_change(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    write_reference_model(model_dir, copy.deepcopy(TINY_CONFIGS["qwen3"]))
    cache = tmp_path / "cache"
    first, calls = _progress_calls(model_dir, cache)
    assert calls > 0
    stamp = first.stat().st_mtime_ns
    again, calls = _progress_calls(model_dir, cache)
    assert (again, calls, again.stat().st_mtime_ns) == (first, 0, stamp)

    weights = model_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4:] = np.float32(0.5).tobytes()  # the last tensor's last value
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stamp + 10**9, stamp + 10**9))
    changed, calls = _progress_calls(model_dir, cache)
    assert changed != first and calls > 0
    assert sorted(p.name for p in cache.glob("*.gguf")) == [changed.name]


def test_supports_says_why_not() -> None:
    for family in ("llama", "qwen2", "qwen3", "qwen3_moe", "glm4_moe", "minimax", "deepseek_v3", "glm4_moe_lite"):
        assert supports(TINY_CONFIGS[family]) is None
    assert supports({"model_type": "qwen3_moe", "quantization": {"bits": 4, "group_size": 64}}) is None
    assert supports({**TINY_CONFIGS["llama"], "quantization": {"group_size": 64, "bits": 4}}) is None
    assert supports({**TINY_CONFIGS["llama"], "quantization": {"group_size": 32, "bits": 8}}) is None
    reasons = [
        supports(TINY_CONFIGS["gpt_oss"]),
        supports({**TINY_CONFIGS["llama"], "quantization": {"group_size": 64, "bits": 3}}),
        supports({**TINY_CONFIGS["llama"], "quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}),
        supports({**TINY_CONFIGS["llama"], "quantization": {"group_size": 16, "bits": 4}}),
        supports({**TINY_CONFIGS["llama"], "quantization_config": {"quant_method": "gptq"}}),
        supports({**TINY_CONFIGS["qwen3_moe"], "norm_topk_prob": False}),
        supports({**TINY_CONFIGS["glm4_moe"], "n_group": 4, "topk_group": 2}),
        supports({**TINY_CONFIGS["deepseek_v3"], "quantization": {"group_size": 64, "bits": 4}}),
    ]
    print(reasons)
    assert all(isinstance(r, str) and r for r in reasons)
