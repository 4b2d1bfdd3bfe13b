"""The node's speed probe (worker/speed_probe.py), run for real in its child process."""

import pytest

from exo.shared.types.instances import EngineKind
from exo.worker.speed_probe import probe_speed


def test_the_probe_measures_compute_and_bandwidth_with_the_engines_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.setenv("EXO_LLAMACPP_THREADS", "1")
    speed = probe_speed(EngineKind.LlamaCpp)
    assert speed is not None
    # A float32 matmul makes more FLOP/s than a one-row matmul reads bytes/s on any
    # machine: the first reuses each weight across rows, the second streams them once.
    assert speed.matmul_gflops > speed.matvec_gbps > 0
    assert speed.threads == 1  # llama.cpp's thread count, given to the probe's BLAS
    assert "cpu" in speed.device


def test_the_probe_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXO_SPEED_PROBE", "0")
    assert probe_speed(EngineKind.Mlx) is None
