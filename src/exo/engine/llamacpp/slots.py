"""The context's sequence ids, and the prefix cache they make: a finished (or cancelled)
request's sequence keeps its KV and the tokens it holds; a new request whose prompt
starts with some of them gets those positions copied (llama.cpp shares the cells) and
prefills only the rest. Kept sequences go least recently used first when the context
needs a sequence or room."""

from exo.engine.llamacpp.native import Context


class Slots:
    def __init__(self, context: Context, count: int) -> None:
        self.context = context
        self.free = list(range(count - 1, -1, -1))
        # Kept sequences and the tokens their KV holds, least recently used first.
        self.kept: dict[int, list[int]] = {}

    def take(self, prompt: list[int]) -> tuple[int, int]:
        """A sequence for a new request, and how many of its prompt's first tokens are
        already in it. The last prompt token is always computed (its logits start the
        answer)."""
        wanted = prompt[:-1]
        best, matched = None, 0
        for sequence, tokens in self.kept.items():
            shared = _common_prefix(tokens, wanted)
            if shared > matched:
                best, matched = sequence, shared
        if not self.free:
            victim = next((s for s in self.kept if s != best), None)
            if victim is None:
                # The only kept sequence is the match: the request takes it over.
                assert best is not None, "no sequence free: more requests than sequences"
                del self.kept[best]
                self.context.remove(best, matched, -1)
                return best, matched
            self._drop(victim)
        sequence = self.free.pop()
        if best is not None:
            self.context.copy(best, sequence, matched)
            self.kept[best] = self.kept.pop(best)  # just used
        return sequence, matched

    def keep(self, sequence: int, tokens: list[int]) -> None:
        """A request is done with `sequence`, whose KV holds `tokens`."""
        if tokens:
            self.kept[sequence] = tokens
        else:
            self.release(sequence)

    def release(self, sequence: int) -> None:
        self.context.remove(sequence)
        self.free.append(sequence)

    def evict_one(self) -> bool:
        """Frees the least recently used kept sequence's cells; False if none is kept."""
        victim = next(iter(self.kept), None)
        if victim is None:
            return False
        self._drop(victim)
        return True

    def _drop(self, sequence: int) -> None:
        del self.kept[sequence]
        self.release(sequence)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
