"""The llama.cpp engine's numpy sampler: its filters keep what mlx-lm's keep, and extreme
penalties still give a token and JSON-safe log probabilities."""

import numpy as np
import pytest

from exo.engine.llamacpp.sampling import Sampler, token_logprob

LOGITS = np.random.default_rng(0).normal(size=335).astype(np.float32)


@pytest.mark.parametrize("penalty", [5e-324, 1e300])
def test_an_extreme_repetition_penalty_still_samples_within_the_vocabulary(penalty: float):
    # Found by schemathesis on the MLX engine; here it was an IndexError (a 500).
    sampler = Sampler(temperature=0.7, repetition_penalty=penalty, seed=1)
    for _ in range(6):
        token, logprobs = sampler.choose(LOGITS, True)
        assert 0 <= token < len(LOGITS) and logprobs is not None and not np.isnan(logprobs).any()
        entry = token_logprob(lambda ids: str(ids), token, logprobs, 3)
        assert all(-9999.0 <= v <= 0.0 for v in [entry.logprob, *(alt.logprob for alt in entry.top_logprobs)])
        sampler.accept(token)


def test_filters_keep_only_the_allowed_tokens():
    best = np.argsort(-LOGITS)
    top_k = {Sampler(temperature=1.0, top_k=3, seed=i).choose(LOGITS, False)[0] for i in range(200)}
    assert top_k <= set(best[:3].tolist()) and len(top_k) > 1
    # min_p 0.9: only tokens within log(0.9) of the best survive (here the best alone).
    assert {Sampler(temperature=1.0, min_p=0.9, seed=i).choose(LOGITS, False)[0] for i in range(50)} == {best[0]}
    assert Sampler(temperature=0.0).choose(LOGITS, False)[0] == best[0]


def test_a_seed_gives_the_same_draws():
    draws = [[Sampler(temperature=1.0, seed=7).choose(LOGITS, False)[0] for _ in range(3)] for _ in range(2)]
    assert draws[0] == draws[1]
