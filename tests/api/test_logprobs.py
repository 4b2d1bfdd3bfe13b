"""Logprobs through the API equal a direct mlx-lm forward pass on the same prompt."""

import math

import mlx.core as mx
import numpy as np
import openai
from mlx_lm.utils import load_model, load_tokenizer

from exo.engine.mlx.chat_template import encode_prompt
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from tests.support.node import TINY_MODEL_ID, ExoNode

MESSAGES = [{"role": "user", "content": "the cat runs over the moon"}]
TOP = 5


def _direct_logprobs(model_dir, steps: int) -> list[np.ndarray]:
    """Log-softmax of the model's logits at each greedy step, by plain forward passes
    over the whole sequence (no cache, no engine)."""
    model, _ = load_model(model_dir)
    tokenizer = load_tokenizer(model_dir)
    params = TextGenerationTaskParams(model=ModelId(TINY_MODEL_ID), messages=[ChatMessage(**m) for m in MESSAGES])
    tokens, _ = encode_prompt(tokenizer, params)
    out = []
    for _ in range(steps):
        logits = model(mx.array(tokens)[None])[0, -1].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits)
        out.append(np.array(logprobs))
        tokens.append(int(mx.argmax(logits).item()))
    return out


def test_top_logprobs_match_a_direct_forward_pass(exo_node: ExoNode, tiny_models_dir):
    exo_node.place()
    sdk = openai.OpenAI(base_url=f"{exo_node.url}/v1", api_key="unused", max_retries=0)
    completion = sdk.chat.completions.create(
        model=TINY_MODEL_ID, messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True, top_logprobs=TOP
    )
    entries = completion.choices[0].logprobs.content
    assert len(entries) == completion.usage.completion_tokens
    direct = _direct_logprobs(tiny_models_dir / TINY_MODEL_ID.replace("/", "--"), len(entries))
    for entry, expected in zip(entries, direct, strict=True):
        best = np.argsort(-expected)[:TOP]
        assert len(entry.top_logprobs) == TOP
        got = [alt.logprob for alt in entry.top_logprobs]
        assert np.max(np.abs(np.array(got) - expected[best])) <= 1e-4, (got, expected[best])
        # Greedy: the sampled token is the most likely one.
        assert math.isclose(entry.logprob, float(expected[best[0]]), abs_tol=1e-4)

    # The legacy Completions shape carries the same numbers.
    legacy = sdk.completions.create(
        model=TINY_MODEL_ID, prompt="the cat runs", max_tokens=2, temperature=0, logprobs=TOP
    )
    logprobs = legacy.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 2
    assert all(len(alternatives) <= TOP for alternatives in logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == legacy.choices[0].text
