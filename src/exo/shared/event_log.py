"""A durable, append-only file of indexed events (one JSON line each), read from disk
when asked: a node keeps only each event's offset in memory, so a cluster left serving
for days holds 8 bytes per event, not the event. One file holds the events from its
`first` index on; `shared/history.py` strings such segments together with snapshots."""

import os
from array import array
from collections.abc import Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import overload

from loguru import logger
from pydantic import ValidationError

from exo.shared.types.events import IndexedEvent


class EventLog(Sequence[IndexedEvent]):
    """Opening the log checks what it holds and cuts off anything after the last intact
    event, so new appends never follow a torn line. Indexing reads the event back."""

    def __init__(self, path: Path, first: int = 0) -> None:
        self.path = path
        # The index of the file's first event; indexing counts from 0 all the same.
        self.first = first
        path.parent.mkdir(parents=True, exist_ok=True)
        # Where each event's line starts; the file ends at `_end`.
        self._offsets, self._end = scan_event_log(path, first)
        self._file = path.open("a+b")
        self._file.truncate(self._end)
        # The newest event, asked for every second (the master re-announces it).
        self._last: IndexedEvent | None = self._read(len(self) - 1) if len(self) else None

    def __len__(self) -> int:
        return len(self._offsets)

    @overload
    def __getitem__(self, index: int) -> IndexedEvent: ...
    @overload
    def __getitem__(self, index: slice) -> list[IndexedEvent]: ...
    def __getitem__(self, index: int | slice) -> IndexedEvent | list[IndexedEvent]:
        if isinstance(index, slice):
            return [self._read(i) for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"event {index} is not in the log ({len(self)} events)")
        if index == len(self) - 1 and self._last is not None:
            return self._last
        return self._read(index)

    def since(self, start: int, stop: int | None = None) -> Iterator[IndexedEvent]:
        """Events [start, stop) in order, read one line at a time."""
        stop = len(self) if stop is None else min(stop, len(self))
        if start >= stop:
            return
        with self.path.open("rb") as file:
            file.seek(self._offsets[start])
            for line in islice(file, stop - start):
                yield IndexedEvent.model_validate_json(line)

    def _read(self, index: int) -> IndexedEvent:
        start = self._offsets[index]
        end = self._offsets[index + 1] if index + 1 < len(self) else self._end
        return IndexedEvent.model_validate_json(os.pread(self._file.fileno(), end - start, start))

    def append(self, event: IndexedEvent, durable: bool = True) -> None:
        """Written and flushed to the OS; fsynced too when `durable` (an fsync also
        makes every earlier line durable, so a power cut costs at most a tail of
        non-durable events)."""
        line = event.model_dump_json().encode() + b"\n"
        self._file.write(line)
        self._file.flush()
        if durable:
            os.fsync(self._file.fileno())
        self._offsets.append(self._end)
        self._end += len(line)
        self._last = event

    def truncate(self, length: int) -> None:
        """Keep the first `length` events (a node dropping what it wrote apart from the
        master after a partition), durably: the file is cut and fsynced."""
        if length >= len(self):
            return
        self._end = self._offsets[length]
        del self._offsets[length:]
        self._file.truncate(self._end)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._last = self._read(length - 1) if length else None

    def close(self) -> None:
        self._file.close()


def scan_event_log(path: Path, first: int = 0) -> tuple[array, int]:
    """The start offset of every intact event in order, and the byte length they take.
    A torn last line (power cut mid-write) is dropped with a warning; nothing after a
    gap is trusted."""
    offsets = array("Q")
    if not path.exists():
        return offsets, 0
    intact_bytes = 0
    with path.open("rb") as file:
        for line_number, line in enumerate(file, 1):
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("line was cut short")
                event = IndexedEvent.model_validate_json(line)
            except (ValidationError, ValueError):
                logger.warning(f"event log {path}: dropping unreadable line {line_number} on")
                break
            if event.idx != first + len(offsets):
                logger.warning(f"event log {path}: index gap at line {line_number}, stopping")
                break
            offsets.append(intact_bytes)
            intact_bytes += len(line)
    return offsets, intact_bytes
