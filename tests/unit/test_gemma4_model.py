"""Gemma 4 text models in mlx-lm compute what transformers' reference computes.

Tiny random Gemma 4 models with sharp weights (N(0, 0.08)) are built and saved by
transformers in float32, loaded the way the engine loads them (mlx-lm's `load_model`, so
`sanitize` sees what `save_pretrained` wrote), and must give the reference's logits
within 1e-3 over a 64-token prompt and 32 greedy decode steps through mlx-lm's cache,
with the prompt prefilled at once and in 3 chunks. The sliding window (16) is shorter than the prompt, so sliding layers drop keys.

- dense: `TINY_CONFIGS["gemma4"]` (multimodal wrapper, text only): per-layer inputs, a
  double-wide MLP and KV-shared last 2 layers (one sliding, one full).
- moe: `TINY_CONFIGS["gemma4_moe"]`: routed experts beside the dense MLP, k_eq_v full
  attention with one global KV head.
- moe_kv_shared: the MoE layout with 6 layers, the last 2 KV-shared."""

import copy
from dataclasses import dataclass

import numpy as np
import pytest

from exo.devtools.onboard import (
    compare_engine_model,
    load_engine_model,
    random_prompt,
    reference_run,
    write_reference_model,
)
from exo.devtools.tiny_configs import TINY_CONFIGS

PROMPT_LEN = 64
DECODE_STEPS = 32
TOLERANCE = 1e-3


def _moe_kv_shared() -> dict:
    config = copy.deepcopy(TINY_CONFIGS["gemma4_moe"])
    config.update(
        num_hidden_layers=6,
        layer_types=["sliding_attention", "full_attention"] * 3,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
    )
    return config


CONFIGS = {
    "dense": TINY_CONFIGS["gemma4"],
    "moe": TINY_CONFIGS["gemma4_moe"],
    "moe_kv_shared": _moe_kv_shared(),
}


@dataclass
class Case:
    model: object
    prompt: list[int]
    prompt_logits: np.ndarray
    step_logits: np.ndarray
    tokens: list[int]

    @property
    def text_model(self):
        return getattr(self.model, "language_model", self.model).model


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    path = tmp_path_factory.mktemp(f"gemma4_{request.param}")
    reference = write_reference_model(path, copy.deepcopy(CONFIGS[request.param]))
    prompt = random_prompt(reference.config.get_text_config().vocab_size, PROMPT_LEN)
    prompt_logits, step_logits, tokens = reference_run(reference, prompt, DECODE_STEPS)
    return Case(load_engine_model(path), prompt, prompt_logits, step_logits, tokens)


def test_case_exercises_its_gemma4_features(case: Case, request: pytest.FixtureRequest) -> None:
    name = request.node.callspec.params["case"]
    text = case.text_model
    config = text.config
    assert config.sliding_window < PROMPT_LEN
    assert CONFIGS[name].get("text_config", CONFIGS[name])["initializer_range"] >= 0.08  # sharp weights
    assert {"sliding_attention", "full_attention"} <= set(config.layer_types)
    assert config.enable_moe_block == name.startswith("moe")
    assert bool(config.hidden_size_per_layer_input) == (name == "dense")
    if name == "moe":
        assert config.num_kv_shared_layers == 0
        assert all(layer.self_attn.use_k_eq_v for layer in text.layers if layer.layer_type == "full_attention")
        return
    first_shared = config.num_hidden_layers - config.num_kv_shared_layers
    shared = text.layers[first_shared:]
    assert {layer.layer_type for layer in shared} == {"sliding_attention", "full_attention"}
    assert not any(hasattr(layer.self_attn, "k_proj") for layer in shared)
    # Each shared layer reads the last earlier layer of its type, as transformers' "store" layer.
    for index in range(first_shared, config.num_hidden_layers):
        source = text.previous_kvs[index]
        assert source < first_shared
        assert config.layer_types[source] == config.layer_types[index]
        assert config.layer_types[source + 1 : first_shared].count(config.layer_types[index]) == 0


@pytest.mark.parametrize("chunks", [1, 3])
def test_logits_match_transformers(case: Case, chunks: int) -> None:
    result = compare_engine_model(case.model, case.prompt, case.prompt_logits, case.step_logits, case.tokens, chunks)
    print(
        f"prefill in {chunks} chunk(s): max |logit diff| prompt {result.prompt_diff:.2e}, "
        f"{DECODE_STEPS} decode steps {result.decode_diff:.2e}"
    )
    assert result.prompt_diff <= TOLERANCE
    assert result.decode_diff <= TOLERANCE
    assert result.tokens_agree
