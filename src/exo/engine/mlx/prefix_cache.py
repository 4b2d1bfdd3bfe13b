"""Reusing the work of earlier prompts and answers.

A request's cache is remembered when it finishes, holding its prompt and its answer: an
agent's next turn re-sends both and adds a message, so it prefills only that message.
Trimmable caches (plain KV) also serve any later prompt sharing only part of a remembered
one: the copy is trimmed back to the shared part. Caches that cannot be trimmed (sliding
windows past their size, SSM state, DeepSeek V4's compressed branches) resume only from
exactly where they stopped: the finished cache (prompt + answer) is such a point, and a
snapshot is also kept at each prefill chunk boundary, so a prompt sharing a long prefix
with an earlier one (its system prompt and first turns) resumes from the last boundary
inside it.

Eviction is least recently used, by count and by bytes; the byte budget also shrinks
when the machine runs low on memory, so cached prompts never push the model into swap."""

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from exo.engine.limits import PREFIX_CACHE_ENTRIES, prefix_cache_budget



@dataclass
class _Entry:
    tokens: np.ndarray
    cache: list[Any]
    nbytes: int
    trimmable: bool
    used: int  # the cache's clock when last inserted or served


def _shared(tokens: np.ndarray, other: np.ndarray) -> int:
    """How many leading tokens the two have in common."""
    n = min(len(tokens), len(other))
    differ = np.flatnonzero(tokens[:n] != other[:n])
    return int(differ[0]) if len(differ) else n


class PrefixCache:
    def __init__(self, model: Any, key: str) -> None:
        self.model = model
        self.key = key
        self._entries: list[_Entry] = []
        self._clock = 0

    def fetch(self, tokens: list[int]) -> tuple[list[Any], int]:
        """A cache holding the longest remembered prefix of `tokens`, and that prefix's length."""
        wanted = np.asarray(tokens, dtype=np.int64)
        best, usable = None, 0
        for entry in self._entries:
            shared = _shared(entry.tokens, wanted)
            # A cache that cannot be trimmed serves only if it stopped inside the prompt.
            if shared == len(entry.tokens) or entry.trimmable:
                if shared > usable:
                    best, usable = entry, shared
        if best is None:
            return make_prompt_cache(self.model), 0
        self._clock += 1
        best.used = self._clock
        cache = copy.deepcopy(best.cache)
        if usable < len(best.tokens):
            trim_prompt_cache(cache, len(best.tokens) - usable)
        return cache, usable

    def remember_boundary(self, tokens: list[int], cache: list[Any]) -> None:
        """At a prefill chunk boundary: worth a snapshot only for caches that cannot be
        trimmed back to it later. Of the earlier boundaries of the same prompt, one per
        octave of length is kept (the longest), so a long prompt keeps a few, not one
        per chunk."""
        if can_trim_prompt_cache(cache):
            return
        self._insert(tokens, copy.deepcopy(cache))
        key = np.asarray(tokens, dtype=np.int64)
        longest: dict[int, _Entry] = {}
        for entry in self._entries:
            length = len(entry.tokens)
            if not entry.trimmable and length < len(key) and _shared(entry.tokens, key) == length:
                octave = length.bit_length()
                if octave not in longest or length > len(longest[octave].tokens):
                    longest[octave] = entry
        thinned = {id(entry) for entry in longest.values()}
        self._entries = [
            entry
            for entry in self._entries
            if id(entry) in thinned
            or entry.trimmable
            or len(entry.tokens) >= len(key)
            or _shared(entry.tokens, key) < len(entry.tokens)
        ]

    def remember_finished(self, tokens: list[int], cache: list[Any]) -> None:
        """`tokens` are the prompt and the generated tokens, every one of them fed (mlx-lm
        feeds a token before handing it out); a plain cache's offset says so too."""
        held = max((c.offset for c in cache if hasattr(c, "offset")), default=len(tokens))
        if can_trim_prompt_cache(cache):
            if held > len(tokens):
                # More than we know of (a token computed ahead): drop the excess.
                trim_prompt_cache(cache, held - len(tokens))
            tokens = tokens[: min(held, len(tokens))]
        elif held != len(tokens):
            return  # where such a cache stopped is not known: not resumable
        if tokens:
            self._insert(tokens, cache)

    def _insert(self, tokens: list[int], cache: list[Any]) -> None:
        key = np.asarray(tokens, dtype=np.int64)
        trimmable = can_trim_prompt_cache(cache)

        def redundant(entry: _Entry) -> bool:
            # The same tokens, or (for a cache that can be trimmed to any length) a prefix.
            shared = _shared(entry.tokens, key)
            return shared == len(entry.tokens) and (shared == len(key) or trimmable)

        self._entries = [entry for entry in self._entries if not redundant(entry)]
        self._clock += 1
        nbytes = sum(c.nbytes for c in cache)
        self._entries.append(_Entry(key, cache, nbytes, trimmable, self._clock))
        self._evict()

    def _evict(self) -> None:
        held = sum(entry.nbytes for entry in self._entries)
        budget = prefix_cache_budget(held)
        self._entries.sort(key=lambda entry: entry.used)
        while self._entries and (len(self._entries) > PREFIX_CACHE_ENTRIES or held > budget):
            held -= self._entries.pop(0).nbytes
