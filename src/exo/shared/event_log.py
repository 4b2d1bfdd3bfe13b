"""A durable, append-only log of indexed events (one JSON line each)."""

import os
from pathlib import Path

from loguru import logger
from pydantic import ValidationError

from exo.shared.types.events import IndexedEvent


class EventLog:
    """Opening the log reads back what it holds (`events`) and cuts off anything after
    the last intact event, so new appends never follow a torn line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.events, intact_bytes = read_event_log(path)
        self._file = path.open("ab")
        self._file.truncate(intact_bytes)

    def append(self, event: IndexedEvent) -> None:
        self._file.write(event.model_dump_json().encode() + b"\n")
        self._file.flush()
        # State events are rare (not per token), so an fsync each keeps the log durable
        # at no noticeable cost.
        os.fsync(self._file.fileno())

    def rewrite(self, events: list[IndexedEvent]) -> None:
        """Replace the log with `events` (a node adopting the master's history after a
        partition): written to a new file, fsynced, then renamed over the old one."""
        self._file.close()
        fresh = self.path.with_suffix(".rewrite")
        with fresh.open("wb") as file:
            file.write(b"".join(event.model_dump_json().encode() + b"\n" for event in events))
            file.flush()
            os.fsync(file.fileno())
        os.replace(fresh, self.path)
        self._file = self.path.open("ab")

    def close(self) -> None:
        self._file.close()


def read_event_log(path: Path) -> tuple[list[IndexedEvent], int]:
    """Every intact event in order, and the byte length they take. A torn last line
    (power cut mid-write) is dropped with a warning; nothing after a gap is trusted."""
    if not path.exists():
        return [], 0
    events: list[IndexedEvent] = []
    intact_bytes = 0
    for line_number, line in enumerate(path.read_bytes().splitlines(keepends=True), 1):
        try:
            if not line.endswith(b"\n"):
                raise ValueError("line was cut short")
            event = IndexedEvent.model_validate_json(line)
        except (ValidationError, ValueError):
            logger.warning(f"event log {path}: dropping unreadable line {line_number} on")
            break
        if event.idx != len(events):
            logger.warning(f"event log {path}: index gap at line {line_number}, stopping")
            break
        events.append(event)
        intact_bytes += len(line)
    return events, intact_bytes
