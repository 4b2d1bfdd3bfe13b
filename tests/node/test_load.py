"""The short version of bench/load.py: 8 streaming clients for 10 s on one real node,
which snapshots its State every 100 events meanwhile (about 15 requests)."""

from exo.devtools.load_test import run_load


def test_eight_streaming_clients_for_ten_seconds_leave_nothing_behind(tmp_path):
    result = run_load(clients=8, seconds=10, scratch=tmp_path, env_extra={"EXO_SNAPSHOT_EVENTS": "100"})
    print(result.report())
    assert result.streams >= 8
    assert result.problems() == []
    assert len(result.snapshots) == 2, result.snapshots  # taken, and the older ones dropped
