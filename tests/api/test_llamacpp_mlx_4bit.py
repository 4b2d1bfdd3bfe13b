"""An MLX-format 4-bit model serves through the llama.cpp engine at the same bits.

A tiny llama quantized by mlx-lm (affine 4-bit, groups of 64, bf16 scales, the layout of
mlx-community's 4-bit repos) sits in a node's models dir under an mlx-community id. A
real node with --engine llamacpp places it on llama.cpp (its card says 4bit), converts it
once to a cached GGUF whose matrices are all Q4_1 (the same codes and scales, no
requantizing: tests/unit/test_gguf_convert.py checks them bit for bit), and answers
/v1/completions with the greedy tokens and logprobs llama-cpp-python gives on that GGUF
in this process with the engine's settings (f16 KV cache and flash attention, as it runs a
quantized model): measured 1.5e-7 (with flash attention off in the direct run, 1.3e-2)."""

import copy
import json
from pathlib import Path

import httpx
import llama_cpp
import numpy as np
from gguf import GGUFReader
from mlx_lm import convert as mlx_convert

from exo.devtools.onboard import random_prompt, write_reference_model
from exo.devtools.tiny_configs import TINY_CONFIGS
from exo.engine.llamacpp.native import extra_buffer_types, flash_attention
from tests.support.node import running_node

MODEL_ID = "mlx-community/tiny-llama-4bit"
PROMPT_LEN = 24
STEPS = 6


def _direct(gguf: Path, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from llama-cpp-python on the node's GGUF."""
    params = llama_cpp.llama_cpp.llama_model_default_params
    llama_cpp.llama_cpp.llama_model_default_params = lambda: _as_the_engine_loads(params())
    try:
        llm = llama_cpp.Llama(
            str(gguf), n_ctx=128, n_threads=2, verbose=False, logits_all=True, flash_attn=flash_attention()
        )
    finally:
        llama_cpp.llama_cpp.llama_model_default_params = params
    tokens, logprobs = list(prompt), []
    llm.eval(tokens)
    for _ in range(STEPS):
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        row = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        tokens.append(int(row.argmax()))
        logprobs.append(float(row[tokens[-1]]))
        llm.eval([tokens[-1]])
    return tokens[len(prompt) :], logprobs


def _as_the_engine_loads(params: llama_cpp.llama_model_params) -> llama_cpp.llama_model_params:
    # Its extra buffer types (repacked layouts) on unless EXO_LLAMACPP_EXTRA_BUFTS=0.
    params.use_extra_bufts = extra_buffer_types()
    return params


def test_an_mlx_4bit_model_serves_on_llamacpp_at_4_bits(tmp_path: Path) -> None:
    models = tmp_path / "models"
    write_reference_model(tmp_path / "float", copy.deepcopy(TINY_CONFIGS["llama"]))
    model_dir = models / MODEL_ID.replace("/", "--")
    mlx_convert(str(tmp_path / "float"), str(model_dir), quantize=True, q_bits=4, q_group_size=64, dtype="bfloat16")
    prompt = random_prompt(json.loads((model_dir / "config.json").read_text())["vocab_size"], PROMPT_LEN)
    home = tmp_path / "home"
    with running_node(home, {"EXO_MODELS_DIRS": str(models)}, args=("--engine", "llamacpp"), models=[MODEL_ID]) as node:
        state = node.state()
        assert [i["engine"] for i in state["instances"].values()] == ["llamacpp"]
        body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": STEPS, "temperature": 0, "logprobs": 1}
        response = httpx.post(f"{node.url}/v1/completions", json=body, timeout=240)
        assert response.status_code == 200, response.text
        served = response.json()["choices"][0]["logprobs"]["token_logprobs"]
    (gguf,) = (home / "cache" / "gguf").glob("*.gguf")
    kinds = {t.tensor_type.name for t in GGUFReader(gguf).tensors if len(t.shape) > 1}
    assert kinds == {"Q4_1"}, kinds
    tokens, direct = _direct(gguf, prompt)
    diff = float(np.abs(np.array(served) - np.array(direct)).max())
    print(f"served {MODEL_ID} on llama.cpp (Q4_1): tokens {tokens}, max |logprob diff| vs llama-cpp-python {diff:.1e}")
    assert len(served) == STEPS and diff <= 1e-3
