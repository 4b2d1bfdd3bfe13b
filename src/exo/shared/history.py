"""A node's history on disk: snapshots of State and the events after them, so a node
that runs for months keeps a bounded log and restarts from its newest snapshot plus a
short tail instead of replaying every event since the cluster began.

The directory holds `snapshot-<idx>.json` (State after event idx, written whole and
renamed into place) and `events-<first>.jsonl` segments (`EventLog`s, each holding the
events from its first index on). A snapshot starts a new segment; once a newer one is
written, what only an older snapshot needed goes: the node keeps its two newest
snapshots and the events after the older of them, so a replica a little behind still
gets events, and a history that went apart in a partition can still be cut there."""

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import overload

from loguru import logger
from pydantic import ValidationError

from exo.shared.event_log import EventLog
from exo.shared.types.events import (
    Event,
    IndexedEvent,
    RunnerStatusUpdated,
    TaskCreated,
    TaskDeleted,
    TaskStatusUpdated,
)
from exo.shared.types.runners import SERVING_STATUSES
from exo.shared.types.state import State

SNAPSHOTS_KEPT = 2


class History(Sequence[IndexedEvent]):
    """Indexed by event index; `len` is the next index. Events before `start` were
    compacted into a snapshot: indexing one is an IndexError, and slices and `since`
    begin at `start`."""

    def __init__(self, directory: Path, legacy_log: Path | None = None) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        if legacy_log is not None and legacy_log.exists() and not _segment_paths(directory):
            # A home from before snapshots: its single log is the first segment.
            legacy_log.rename(_segment_path(directory, 0))
        self._segments = _open_segments(directory)

    @property
    def start(self) -> int:
        """The oldest event held."""
        return self._segments[0].first

    def __len__(self) -> int:
        last = self._segments[-1]
        return last.first + len(last)

    @overload
    def __getitem__(self, index: int) -> IndexedEvent: ...
    @overload
    def __getitem__(self, index: slice) -> list[IndexedEvent]: ...
    def __getitem__(self, index: int | slice) -> IndexedEvent | list[IndexedEvent]:
        if isinstance(index, slice):
            first, stop, step = index.indices(len(self))
            return list(self.since(max(first, self.start), stop))[:: step or 1]
        if index < 0:
            index += len(self)
        if not self.start <= index < len(self):
            raise IndexError(f"event {index} is not held (events {self.start} to {len(self) - 1})")
        segment = self._segment_of(index)
        return segment[index - segment.first]

    def since(self, start: int, stop: int | None = None) -> Iterator[IndexedEvent]:
        """Events [start, stop) in order, from `start` or the oldest held."""
        stop = len(self) if stop is None else min(stop, len(self))
        for segment in self._segments:
            begin = max(start, segment.first) - segment.first
            end = min(stop - segment.first, len(segment))
            if begin < end:
                yield from segment.since(begin, end)

    def append(self, event: IndexedEvent, durable: bool = True) -> None:
        self._segments[-1].append(event, durable)

    def truncate(self, length: int) -> None:
        """Keep the events before index `length` (a node dropping what it wrote apart
        from the master), and only the snapshots they lead to."""
        for idx in self.snapshot_indices():
            if idx >= length:
                _snapshot_path(self.directory, idx).unlink()
        while len(self._segments) > 1 and self._segments[-1].first >= length:
            dropped = self._segments.pop()
            dropped.close()
            dropped.path.unlink()
        last = self._segments[-1]
        if last.first > length:
            self.reset(length)
        else:
            last.truncate(length - last.first)

    def reset(self, first: int) -> None:
        """Hold nothing: the next event appended is `first` (after a snapshot taken
        from the master, or a history that could not be cut where it went apart)."""
        for segment in self._segments:
            segment.close()
            segment.path.unlink()
        self._segments = [EventLog(_segment_path(self.directory, first), first)]

    def snapshot_indices(self) -> list[int]:
        return sorted(int(path.stem.split("-")[1]) for path in self.directory.glob("snapshot-*.json"))

    def snapshot(self, before: int | None = None) -> State | None:
        """The newest readable snapshot (covering events before `before`, if given)."""
        for idx in reversed(self.snapshot_indices()):
            if before is not None and idx >= before:
                continue
            path = _snapshot_path(self.directory, idx)
            try:
                state = State.model_validate_json(path.read_bytes())
            except (OSError, ValidationError) as error:
                logger.warning(f"history {self.directory}: unreadable snapshot {path.name}: {error}")
                continue
            if state.last_event_applied_idx == idx:
                return state
        return None

    def write_snapshot(self, state: State) -> None:
        """Write `state` durably, start a new segment after it, and drop what only
        older snapshots needed."""
        idx = state.last_event_applied_idx
        path = _snapshot_path(self.directory, idx)
        scratch = path.with_suffix(".tmp")
        with scratch.open("wb") as file:
            file.write(state.model_dump_json().encode())
            file.flush()
            os.fsync(file.fileno())
        scratch.rename(path)
        _fsync_directory(self.directory)
        if idx + 1 == len(self) and len(self._segments[-1]):
            self._segments.append(EventLog(_segment_path(self.directory, idx + 1), idx + 1))
        self._drop_before(self.snapshot_indices()[-SNAPSHOTS_KEPT:][0])

    def install_snapshot(self, state: State) -> None:
        """Start over from a snapshot (the master's): everything held before goes."""
        self.reset(state.last_event_applied_idx + 1)
        for idx in self.snapshot_indices():
            _snapshot_path(self.directory, idx).unlink()
        self.write_snapshot(state)

    def _drop_before(self, oldest_snapshot: int) -> None:
        for idx in self.snapshot_indices():
            if idx < oldest_snapshot:
                _snapshot_path(self.directory, idx).unlink()
        # A segment goes once the next one starts at or before the oldest snapshot's tail.
        while len(self._segments) > 1 and self._segments[1].first <= oldest_snapshot + 1:
            dropped = self._segments.pop(0)
            dropped.close()
            dropped.path.unlink()

    def disk_bytes(self) -> int:
        return sum(path.stat().st_size for path in self.directory.iterdir() if path.is_file())

    def _segment_of(self, index: int) -> EventLog:
        for segment in reversed(self._segments):
            if segment.first <= index:
                return segment
        raise IndexError(index)

    def close(self) -> None:
        for segment in self._segments:
            segment.close()


def must_be_durable(event: Event) -> bool:
    """Whether an event is fsynced before it counts. What describes one request (its
    task's life, and the Ready/Running flips of its runner) is written but not fsynced:
    six of a request's seven events, on every node. A power cut can cost a node only a
    tail of them (the next durable event's fsync makes every line before it durable),
    and they describe requests whose streams died with it: the master deletes the tasks
    of sessions that are gone, workers report their runners afresh, and a history that
    lost such a tail while the others kept it is cut and replaced like any that went
    apart (no user's write is among them)."""
    match event:
        case TaskCreated() | TaskStatusUpdated() | TaskDeleted():
            return False
        case RunnerStatusUpdated(status=status) if isinstance(status, SERVING_STATUSES):
            return False
        case _:
            return True


def _segment_path(directory: Path, first: int) -> Path:
    return directory / f"events-{first:012d}.jsonl"


def _snapshot_path(directory: Path, idx: int) -> Path:
    return directory / f"snapshot-{idx:012d}.json"


def _segment_paths(directory: Path) -> list[Path]:
    return sorted(directory.glob("events-*.jsonl"))


def _open_segments(directory: Path) -> list[EventLog]:
    """The segments in order; one that does not continue the one before (a crash between
    writing a snapshot and dropping old segments leaves none such, but a hand-edited dir
    might) ends the history there, and an empty dir gets its first segment."""
    segments: list[EventLog] = []
    for path in _segment_paths(directory):
        first = int(path.stem.split("-")[1])
        if segments and segments[-1].first + len(segments[-1]) != first:
            if len(segments[-1]) == 0 and segments[-1].first < first:
                # An empty segment followed by a later one: a snapshot bridged the gap.
                stale = segments.pop()
                stale.close()
                stale.path.unlink()
            else:
                logger.warning(f"history {directory}: {path.name} does not follow on; dropping it")
                path.unlink()
                continue
        segments.append(EventLog(path, first))
    return segments or [EventLog(_segment_path(directory, 0), 0)]


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
