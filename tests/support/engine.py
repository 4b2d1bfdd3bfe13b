"""The real MLX engine in this process, for tests of the engine itself, without a node."""

from dataclasses import replace

from exo.devtools.local_engine import load_engine

__all__ = ["load_engine", "set_step_tokens"]


def set_step_tokens(monkeypatch, engine, tokens: int) -> None:
    """The engine's scheduler feeds at most `tokens` tokens a step (for this test)."""
    monkeypatch.setattr(engine.scheduler, "budget", replace(engine.scheduler.budget, step_tokens=tokens))
