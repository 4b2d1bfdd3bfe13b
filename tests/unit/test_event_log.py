"""The master's event log survives a restart, and a power cut mid-write costs at most
the event being written, never the log's readability. Events are read back from disk,
by index, slice or from an index on."""

from pathlib import Path

import pytest

from exo.shared.event_log import EventLog, scan_event_log
from exo.shared.types.common import NodeId, TaskId
from exo.shared.types.events import (
    IndexedEvent,
    MasterElected,
    NodeTimedOut,
    TaskDeleted,
)


def events(count: int, start: int = 0) -> list[IndexedEvent]:
    kinds = [
        lambda i: MasterElected(node_id=NodeId(f"node-{i}")),
        lambda i: NodeTimedOut(node_id=NodeId(f"node-{i}")),
        lambda i: TaskDeleted(task_id=TaskId(f"task-{i}")),
    ]
    return [IndexedEvent(idx=i, event=kinds[i % len(kinds)](i)) for i in range(start, start + count)]


@pytest.fixture
def log_path(tmp_path: Path) -> Path:
    return tmp_path / "master" / "events.jsonl"


def write_log(path: Path, written: list[IndexedEvent]) -> None:
    log = EventLog(path)
    for event in written:
        log.append(event)
    log.close()


def reopen(path: Path) -> list[IndexedEvent]:
    log = EventLog(path)
    read = list(log.since(0))
    assert read == list(log) == log[:]  # the three ways of reading agree
    log.close()
    return read


def test_a_new_log_starts_empty(log_path: Path):
    assert reopen(log_path) == []


def test_appended_events_are_read_back_after_reopening(log_path: Path):
    write_log(log_path, events(5))
    assert reopen(log_path) == events(5)


def test_appends_after_reopening_continue_the_log(log_path: Path):
    write_log(log_path, events(3))
    write_log(log_path, events(2, start=3))
    assert reopen(log_path) == events(5)


def test_torn_partial_json_last_line_is_dropped(log_path: Path):
    write_log(log_path, events(3))
    torn = events(1, start=3)[0].model_dump_json().encode()[:20]
    with log_path.open("ab") as file:
        file.write(torn)
    assert reopen(log_path) == events(3)


def test_valid_last_line_without_trailing_newline_is_dropped(log_path: Path):
    # A complete JSON object whose newline never reached the disk is still a torn write.
    write_log(log_path, events(3))
    with log_path.open("ab") as file:
        file.write(events(1, start=3)[0].model_dump_json().encode())
    assert reopen(log_path) == events(3)


@pytest.mark.parametrize("tail", ["partial json", "json without newline"])
def test_append_after_a_torn_line_leaves_a_clean_readable_log(log_path: Path, tail: str):
    write_log(log_path, events(3))
    line = events(1, start=3)[0].model_dump_json().encode()
    with log_path.open("ab") as file:
        file.write(line[:20] if tail == "partial json" else line)

    write_log(log_path, events(2, start=3))

    assert reopen(log_path) == events(5)
    assert log_path.read_bytes() == b"".join(e.model_dump_json().encode() + b"\n" for e in events(5))


def test_reading_stops_at_an_index_gap(log_path: Path):
    write_log(log_path, events(2) + events(2, start=3))
    offsets, intact_bytes = scan_event_log(log_path)
    assert reopen(log_path) == events(2) and len(offsets) == 2
    assert intact_bytes == sum(len(e.model_dump_json()) + 1 for e in events(2))


def test_a_truncated_log_holds_exactly_the_kept_events_and_takes_appends(log_path: Path):
    # A node that adopts the master's history after a partition cuts its own from the
    # first difference on, then appends the master's.
    log = EventLog(log_path)
    for event in events(6):
        log.append(event)
    log.truncate(3)
    assert len(log) == 3 and log[-1] == events(3)[2]
    from_the_master = IndexedEvent(idx=3, event=TaskDeleted(task_id=TaskId("from-the-master")))
    log.append(from_the_master)
    assert log[3] == from_the_master and log[1] == events(3)[1]
    assert list(log.since(2)) == [events(3)[2], from_the_master]
    log.close()
    assert reopen(log_path) == [*events(3), from_the_master]


def test_reading_past_the_end_is_an_index_error(log_path: Path):
    write_log(log_path, events(2))
    log = EventLog(log_path)
    with pytest.raises(IndexError):
        log[2]
    assert log[-1] == events(2)[1] and list(log.since(5)) == []
    log.close()
