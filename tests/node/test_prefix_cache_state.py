"""A real node's prefix cache use, in usage and in /state: the same prompt twice, and the
second reports its cached tokens (usage.prompt_tokens_details.cached_tokens) and the
runner's status in State counts the hits, misses and cached tokens the usages said
(prefixCache); so does the Responses API's usage."""

import httpx

from tests.support.node import TINY_MODEL_ID, running_node

PROMPT = "the cat runs over the quiet moon and the node sleeps " * 8


def _ask(url: str) -> dict:
    body = {
        "model": TINY_MODEL_ID,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 4,
        "temperature": 0,
    }
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()["usage"]


def _prefix_cache(state: dict) -> dict | None:
    [runner] = state["runners"].values()
    return runner.get("prefixCache") if runner["kind"] == "RunnerReady" else None


def test_cache_hits_and_cached_tokens_are_in_usage_and_in_state(tmp_path, tiny_models_dir):
    with running_node(
        tmp_path / "home", {"EXO_MODELS_DIRS": str(tiny_models_dir), "EXO_ENGINE": "mlx"}, models=[TINY_MODEL_ID]
    ) as node:
        first = _ask(node.url)
        second = _ask(node.url)
        # At most the chat template's first tokens, shared with the warm-up's prompt.
        cold = first["prompt_tokens_details"]["cached_tokens"]
        assert cold < 5
        cached = second["prompt_tokens_details"]["cached_tokens"]
        # All but the last prompt token, which the first decode step feeds.
        assert cached == second["prompt_tokens"] - 1
        expected = {"hits": 1 + (cold > 0), "misses": int(cold == 0), "cachedTokens": cold + cached}
        node.wait_for_state(lambda state: _prefix_cache(state) == expected, timeout=30, what="prefixCache")

        # The Responses API says so too (it said 0 whatever was cached).
        body = {"model": TINY_MODEL_ID, "input": PROMPT, "max_output_tokens": 4, "temperature": 0}
        response = httpx.post(node.url + "/v1/responses", json=body, timeout=120)
        response.raise_for_status()
        assert response.json()["usage"]["input_tokens_details"]["cached_tokens"] == cached
