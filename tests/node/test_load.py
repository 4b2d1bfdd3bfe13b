"""The short version of bench/load.py: 8 streaming clients for 10 s on one real node."""

from exo.devtools.load_test import run_load


def test_eight_streaming_clients_for_ten_seconds_leave_nothing_behind(tmp_path):
    result = run_load(clients=8, seconds=10, scratch=tmp_path)
    print(result.report())
    assert result.streams >= 8
    assert result.problems() == []
