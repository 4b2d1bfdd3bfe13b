"""Reusing the work of earlier prompts and answers, for every engine: which saved KV
serves a new prompt, and which entries go when room is short. What an entry holds (an
MLX cache, a llama.cpp sequence's state) is the backend's; this module only sees tokens.

A request's KV is remembered when it finishes, holding its prompt and its answer: an
agent's next turn re-sends both and adds a message, so it prefills only that message.
Trimmable KV (plain attention) also serves any later prompt sharing only part of a
remembered one: the copy is cut back to the shared part. KV that cannot be trimmed
(sliding windows past their size, SSM state, DeepSeek V4's compressed branches) resumes
only from exactly where it stopped: the finished request is such a point, and a
snapshot is also kept at prefill chunk boundaries (one per octave of prompt length), so
a prompt sharing a long prefix with an earlier one resumes from the last boundary
inside it.

Entries are counted in tokens, not bytes: on a split instance every rank must keep and
give up the same entries (each rank's bytes differ, its layers do), and the scheduler
holds the KV of running requests and of this cache inside one budget of tokens. Least
recently used entries go first."""

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class SavedKV:
    """A request's KV kept for reuse: the backend's snapshot of it, how many leading
    tokens of the request's prompt + answer it holds, its bytes (for /state), and whether
    the backend can cut it back to fewer tokens."""

    snapshot: Any
    length: int
    nbytes: int
    trimmable: bool


@dataclass
class _Entry:
    tokens: np.ndarray
    saved: SavedKV
    used: int  # the cache's clock when last inserted or served


def shared_prefix(tokens: np.ndarray, other: np.ndarray) -> int:
    """How many leading tokens the two have in common."""
    n = min(len(tokens), len(other))
    differ = np.flatnonzero(tokens[:n] != other[:n])
    return int(differ[0]) if len(differ) else n


class PrefixCache:
    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: list[_Entry] = []
        self._clock = 0

    @property
    def held_tokens(self) -> int:
        return sum(len(entry.tokens) for entry in self._entries)

    @property
    def held_bytes(self) -> int:
        return sum(entry.saved.nbytes for entry in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, tokens: list[int]) -> tuple[SavedKV, int] | None:
        """The entry holding the longest usable prefix of `tokens`, and that prefix's
        length; marked as just used."""
        wanted = np.asarray(tokens, dtype=np.int64)
        best, usable = None, 0
        for entry in self._entries:
            shared = shared_prefix(entry.tokens, wanted)
            # An entry that cannot be trimmed serves only if it stopped inside the prompt.
            if (shared == len(entry.tokens) or entry.saved.trimmable) and shared > usable:
                best, usable = entry, shared
        if best is None:
            return None
        self._clock += 1
        best.used = self._clock
        return best.saved, usable

    def remember(self, tokens: list[int], saved: SavedKV) -> None:
        """`tokens` are what `saved` holds. An entry it makes redundant goes: the same
        tokens, or (when it can be trimmed to any length) a prefix of them."""
        key = np.asarray(tokens, dtype=np.int64)

        def redundant(entry: _Entry) -> bool:
            shared = shared_prefix(entry.tokens, key)
            return shared == len(entry.tokens) and (shared == len(key) or saved.trimmable)

        self._entries = [entry for entry in self._entries if not redundant(entry)]
        self._clock += 1
        self._entries.append(_Entry(key, saved, self._clock))
        self.evict(max_tokens=None)

    def remember_boundary(self, tokens: list[int], saved: SavedKV) -> None:
        """A prefill chunk boundary of a prompt whose KV cannot be trimmed. Of the earlier
        boundaries of the same prompt, one per octave of length is kept (the longest), so
        a long prompt keeps a few, not one per chunk."""
        self.remember(tokens, saved)
        key = np.asarray(tokens, dtype=np.int64)
        longest: dict[int, _Entry] = {}
        for entry in self._entries:
            length = len(entry.tokens)
            if not entry.saved.trimmable and length < len(key) and shared_prefix(entry.tokens, key) == length:
                octave = length.bit_length()
                if octave not in longest or length > len(longest[octave].tokens):
                    longest[octave] = entry
        kept = {id(entry) for entry in longest.values()}
        self._entries = [
            entry
            for entry in self._entries
            if id(entry) in kept
            or entry.saved.trimmable
            or len(entry.tokens) >= len(key)
            or shared_prefix(entry.tokens, key) < len(entry.tokens)
        ]

    def evict(self, max_tokens: int | None, keep: SavedKV | None = None) -> None:
        """Least recently used entries go until at most `max_entries` remain holding at
        most `max_tokens` (None: no limit of tokens); `keep` stays."""
        self._entries.sort(key=lambda entry: entry.used)
        held = self.held_tokens
        index = 0
        while index < len(self._entries) and (
            len(self._entries) > self.max_entries or (max_tokens is not None and held > max_tokens)
        ):
            entry = self._entries[index]
            if entry.saved is keep:
                index += 1
                continue
            del self._entries[index]
            held -= len(entry.tokens)

    def clear(self) -> None:
        self._entries.clear()
