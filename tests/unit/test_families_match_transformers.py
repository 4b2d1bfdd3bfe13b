"""Every family's tiny model in our engine computes what transformers computes.

For each `TINY_CONFIGS` architecture transformers can build, a random float32 model with
sharp weights (N(0, initializer_range = 0.08)) is made and saved by transformers, loaded
the way the engine loads it (mlx-lm plus our model modules, so `sanitize` sees what
`save_pretrained` wrote), and must give transformers' logits within 1e-3 over a 64-token
prompt (past every tiny sliding window and sparse top-k) and 16 greedy decode steps
through the cache, with the prompt prefilled at once and in 3 chunks. DeepSeek V4 and
Gemma 4 have their own, longer tests (test_deepseek_v4_model.py, test_gemma4_model.py).

Not here: the configs in WITHOUT_TRANSFORMERS_CHECKPOINT (why is said there)."""

import copy

import pytest

from exo.devtools.onboard import compare
from exo.devtools.tiny_configs import TINY_CONFIGS, WITHOUT_TRANSFORMERS_CHECKPOINT

TOLERANCE = 1e-3
OWN_TESTS = {"deepseek_v4", "gemma4", "gemma4_moe"}
FAMILIES = [name for name in TINY_CONFIGS if name not in OWN_TESTS | WITHOUT_TRANSFORMERS_CHECKPOINT]


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
