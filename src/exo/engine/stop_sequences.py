"""Cutting a text stream at stop sequences without ever showing part of one."""


class StopSequenceFilter:
    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self._held = ""
        # The stop sequence that ended the stream, once one has.
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns the text safe to show now, and whether a stop sequence was hit."""
        if not self.stop:
            return text, False
        pending = self._held + text
        hits = [(pending.find(s), s) for s in self.stop if s in pending]
        if hits:
            cut, self.matched = min(hits)
            self._held = ""
            return pending[:cut], True
        keep = self._longest_stop_prefix_suffix(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep], False

    def flush(self) -> str:
        """What was held back, once the stream ends without a stop sequence."""
        held, self._held = self._held, ""
        return held

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
