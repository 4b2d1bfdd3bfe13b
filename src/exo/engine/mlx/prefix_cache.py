"""Reusing the work of earlier prompts: mlx-lm's LRUPromptCache, fed the way exo prefills.

A request's cache is remembered when it finishes. Trimmable caches (plain KV) serve any
later prompt sharing a prefix with it: the copy is trimmed back to the shared part.
Caches that cannot be trimmed (sliding windows past their size, SSM state, DeepSeek V4's
compressed branches) can only be resumed from exactly where they stopped, so for them
a snapshot is also kept at each prefill chunk boundary; a later prompt that shares a
long prefix then resumes from the last boundary inside it."""

import copy
import os
from typing import Any

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

MAX_ENTRIES = int(os.environ.get("EXO_PREFIX_CACHE_ENTRIES", "8"))
MAX_BYTES = int(os.environ.get("EXO_PREFIX_CACHE_BYTES", str(2 << 30)))


class PrefixCache:
    def __init__(self, model: Any, key: str) -> None:
        self.model = model
        self.key = key
        self._lru = LRUPromptCache(max_size=MAX_ENTRIES, max_bytes=MAX_BYTES)

    def fetch(self, tokens: list[int]) -> tuple[list[Any], int]:
        """A cache holding the longest remembered prefix of `tokens`, and that prefix's length."""
        cache, rest = self._lru.fetch_nearest_cache(self.key, tokens) if tokens else (None, tokens)
        if cache is None:
            return make_prompt_cache(self.model), 0
        return cache, len(tokens) - len(rest)

    def remember_boundary(self, tokens: list[int], cache: list[Any]) -> None:
        """At a prefill chunk boundary: worth a snapshot only for caches that cannot be
        trimmed back to it later."""
        if not can_trim_prompt_cache(cache):
            self._lru.insert_cache(self.key, list(tokens), copy.deepcopy(cache), cache_type="system")

    def remember_finished(self, tokens: list[int], cache: list[Any]) -> None:
        """`tokens` are the prompt and the generated tokens; mlx-lm may already have fed
        the last one, so the cache's own offset says how many it holds."""
        if not can_trim_prompt_cache(cache):
            return
        held = max((getattr(c, "offset", 0) for c in cache), default=0)
        if held > len(tokens):
            # More than we know of (a token computed ahead): drop the excess.
            trim_prompt_cache(cache, held - len(tokens))
            held = len(tokens)
        if held > 0:
            self._lru.insert_cache(self.key, list(tokens[:held]), cache)
