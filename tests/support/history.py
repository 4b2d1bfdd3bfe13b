"""Reading a node's history through GET /events and its home: events older than the
node's oldest kept snapshot are compacted away, so histories are compared by index."""

import contextlib
import threading

import httpx

from tests.support.node import ExoNode


def held_events(node: ExoNode) -> dict[int, dict]:
    """The events the node holds, by index; they run without a gap from the index its
    X-Exo-History-Start header gives."""
    response = node.get("/events")
    events = {event["idx"]: event for event in response.json()}
    start = int(response.headers["X-Exo-History-Start"])
    assert sorted(events) == list(range(start, start + len(events))), "a gap or an index twice"
    return events


def agree(first: dict[int, dict], second: dict[int, dict]) -> int:
    """Both hold the same event at every index both hold; how many indexes that is."""
    shared = first.keys() & second.keys()
    assert all(first[idx] == second[idx] for idx in shared)
    return len(shared)


def snapshots_taken(node: ExoNode) -> list[int]:
    """The event indexes of the snapshots in the node's home."""
    directory = node.home / "data" / "history"
    return sorted(int(path.stem.split("-")[1]) for path in directory.glob("snapshot-*.json"))


class EventTap:
    """Every event a node held while the tap ran, by index (the last version seen of an
    index the node rewrote), polled from GET /events: with a snapshot every few events,
    what a test counts at the end may have been compacted away by then. A poll that comes
    late (a busy machine) can find events compacted before it saw them: `missed` holds
    their indexes, so a test can tell "not written" from "not seen"."""

    def __init__(self, node: ExoNode, period: float = 0.05) -> None:
        self.node = node
        self.period = period
        self.events: dict[int, dict] = {}
        self.missed: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(self.period):
            with contextlib.suppress(httpx.HTTPError, ValueError):
                self._read()

    def _read(self) -> None:
        response = self.node.get("/events")
        response.raise_for_status()
        start = int(response.headers["X-Exo-History-Start"])
        if self.events:
            self.missed |= set(range(max(self.events) + 1, start)) - self.events.keys()
        self.events.update({event["idx"]: event for event in response.json()})

    def stop(self) -> dict[int, dict]:
        """Stops polling, after a last poll; the events seen."""
        self._stop.set()
        self._thread.join()
        self._read()
        return self.events
