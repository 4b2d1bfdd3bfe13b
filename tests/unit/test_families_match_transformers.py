"""Every family's tiny model in our engine computes what transformers computes.

For each `TINY_CONFIGS` architecture transformers can build, a random float32 model with
sharp weights (N(0, initializer_range = 0.08)) is made and saved by transformers, loaded
the way the engine loads it (mlx-lm plus our model modules, so `sanitize` sees what
`save_pretrained` wrote, rewritten in the published layout where transformers' own
differs: devtools/hub_layouts.py), and must give transformers' logits within 1e-3 over a 64-token
prompt (past every tiny sliding window and sparse top-k) and 16 greedy decode steps
through the cache, with the prompt prefilled at once and in 3 chunks. DeepSeek V4 and
Gemma 4 have their own, longer tests (test_deepseek_v4_model.py, test_gemma4_model.py).

Two references are not a transformers class of the config's own model_type, and are
still transformers' computation of that model (devtools/hub_layouts.py says why):
kimi_k25 is DeepseekV3ForCausalLM of its text config (what transformers' Kimi K2.5 runs
a text prompt through), step3p5 is transformers' Step 3.7 Flash language model (whose
config model_type is step3p5) under a linear head. gpt_oss also checks our fixes to
mlx-lm's gpt-oss (engine/mlx/models/gpt_oss.py): YaRN's rounded correction range (0.35
off before) and the SwiGLU clamp fixed at 7 whatever the config says (1.05 off before,
with the tiny config's clamp of 1.5)."""

import copy

import pytest

from exo.devtools.onboard import compare
from exo.devtools.tiny_configs import TINY_CONFIGS

TOLERANCE = 1e-3
OWN_TESTS = {"deepseek_v4", "gemma4", "gemma4_moe"}
FAMILIES = [name for name in TINY_CONFIGS if name not in OWN_TESTS]


def _init_std(config: dict) -> float:
    return config.get("text_config", config)["initializer_range"]


@pytest.mark.parametrize("name", FAMILIES)
def test_family_matches_transformers(name: str) -> None:
    config = copy.deepcopy(TINY_CONFIGS[name])
    assert _init_std(config) >= 0.08  # sharp weights
    for result in compare(config, prompt_len=64, decode_steps=16, chunk_counts=(1, 3)):
        print(f"{name}, {result.chunks} chunk(s): prompt {result.prompt_diff:.2e}, decode {result.decode_diff:.2e}")
        assert result.prompt_diff <= TOLERANCE and result.decode_diff <= TOLERANCE
        assert result.tokens_agree
