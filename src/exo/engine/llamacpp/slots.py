"""The context's sequence ids, and the prefix cache: a finished (or cancelled) request's
KV is saved to host memory with the tokens it holds (llama.cpp's per-sequence state)
and its cells freed; a new request whose prompt starts with some of those tokens gets
the snapshot restored into its sequence, cut back to what it shares, and prefills only
the rest.

Snapshots rather than kept sequences: in one unified KV buffer every decode step
attends over the cells up to the highest one in use, whichever sequence holds it, so
kept sequences slowed every running request (a 1024x16 llama's decode went from 8.6 to
12 ms a token as five finished 900-token requests stayed in the cache). Snapshots
leave the cells to the running requests; restoring one costs a copy of its KV.
Least recently used snapshots go first, past the entries or bytes the prefix cache may
hold (engine/limits.py)."""

from dataclasses import dataclass

from exo.engine.limits import PREFIX_CACHE_ENTRIES, prefix_cache_budget
from exo.engine.llamacpp.native import Context, SequenceState


@dataclass
class _Snapshot:
    tokens: list[int]
    state: SequenceState


class Slots:
    def __init__(self, context: Context, count: int) -> None:
        self.context = context
        self.free = list(range(count - 1, -1, -1))
        # Least recently used first.
        self.snapshots: list[_Snapshot] = []

    def take(self, prompt: list[int]) -> tuple[int, int]:
        """A sequence for a new request, and how many of its prompt's first tokens are
        already in it. The last prompt token is always computed (its logits start the
        answer)."""
        assert self.free, "no sequence free: more requests than sequences"
        sequence = self.free.pop()
        wanted = prompt[:-1]
        best, matched = None, 0
        for snapshot in self.snapshots:
            shared = _common_prefix(snapshot.tokens, wanted)
            if shared > matched:
                best, matched = snapshot, shared
        if best is None:
            return sequence, 0
        self.snapshots.remove(best)
        self.snapshots.append(best)  # just used
        if not self.context.restore(best.state, sequence):
            return sequence, 0  # no room for it in the KV now: prefill from the start
        self.context.remove(sequence, matched, -1)
        return sequence, matched

    def keep(self, sequence: int, tokens: list[int]) -> None:
        """A request is done with `sequence`, whose KV holds `tokens`: saved, then freed."""
        if tokens:
            self.snapshots = [s for s in self.snapshots if _common_prefix(s.tokens, tokens) < len(s.tokens)]
            self.snapshots.append(_Snapshot(tokens, self.context.save(sequence)))
            self._evict()
        self.release(sequence)

    def release(self, sequence: int) -> None:
        self.context.remove(sequence)
        self.free.append(sequence)

    def clear(self) -> None:
        self.snapshots.clear()

    @property
    def cached_bytes(self) -> int:
        return sum(s.state.nbytes for s in self.snapshots)

    def _evict(self) -> None:
        held = self.cached_bytes
        budget = prefix_cache_budget(held)
        while self.snapshots and (len(self.snapshots) > PREFIX_CACHE_ENTRIES or held > budget):
            held -= self.snapshots.pop(0).state.nbytes


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
