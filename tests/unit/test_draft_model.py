"""Speculative decoding with a draft model on MLX (engine/mlx/draft.py) and llama.cpp
(engine/llamacpp/draft.py), on real engines in this process: a draft that agrees with
the target (the target's own scripted weights at one layer, its other layers being the
identity) has every proposal kept; a draft that does not (another random model with the
same tokenizer) has most refused and its cache cut back each time; either way every
answer is the plain one, alone or batched with plain requests. A card's default applies
to requests that do not say; "off" overrides it. On llama.cpp each finished request gives
its sequence of the draft's context back."""

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import pytest

from exo.devtools.local_engine import load_engine, load_llamacpp_engine
from exo.devtools.scripted_models import make_copy_model
from exo.devtools.tiny_models import make_tiny_llama
from exo.engine import limits
from exo.engine.llamacpp.engine import LlamaCppEngine
from exo.shared.types.common import CommandId, ModelId
from exo.shared.types.text_generation import ChatMessage, Speculative, TextGenerationTaskParams
from tests.support.engine import answers, tokens_of, usage_of

DRAFT = Speculative(method="draft", num_draft=5)
WORDS = "cluster node model token the cat runs over the quiet moon "
LOADERS: dict[str, Callable[[Path], Any]] = {"mlx": load_engine, "llamacpp": load_llamacpp_engine}


def _params(speculative, text: str = WORDS * 4, max_tokens: int = 48, **extra) -> TextGenerationTaskParams:
    return TextGenerationTaskParams(
        model=ModelId("test/model"),
        messages=[ChatMessage(role="user", content=text)],
        max_tokens=max_tokens,
        speculative=speculative,
        **{"temperature": 0.0, **extra},
    )


@pytest.fixture(scope="module", params=list(LOADERS))
def random_pair(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A 3-layer tiny llama and, as its draft, a 1-layer one of other weights (same tokenizer)."""
    root = tmp_path_factory.mktemp("pair")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EXO_HOME", str(root / "home"))  # llama.cpp's GGUFs
        engine = LOADERS[request.param](make_tiny_llama(root / "target", num_hidden_layers=3, seed=0))
        engine.load_draft(make_tiny_llama(root / "draft", num_hidden_layers=1, seed=5), "test/draft")
        yield engine
        engine.close()


@pytest.mark.parametrize("engine_name", list(LOADERS))
def test_a_draft_that_agrees_has_every_proposal_kept(engine_name: str, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("EXO_HOME", str(tmp_path / "home"))
    prompt = make_copy_model(tmp_path / "target", 150, config_overrides={"num_hidden_layers": 4})
    make_copy_model(tmp_path / "draft", 150, config_overrides={"num_hidden_layers": 1})
    engine = LOADERS[engine_name](tmp_path / "target")
    try:
        engine.load_draft(tmp_path / "draft", "test/draft")
        asked = _params(None, max_tokens=120).model_copy(update={"messages": [], "prompt": prompt})
        plain = answers(engine, {"plain": asked})["plain"]
        drafted = answers(engine, {"draft": asked.model_copy(update={"speculative": DRAFT})})["draft"]
        assert tokens_of(drafted) == tokens_of(plain)
        assert len(tokens_of(plain)) == 120
        usage = usage_of(drafted)
        print(f"{engine_name}: {usage.accepted_tokens} of {usage.proposed_tokens} proposed kept")
        assert usage.proposed_tokens >= 90 and usage.accepted_tokens == usage.proposed_tokens
        assert drafted[-1].stats is not None and drafted[-1].stats.acceptance_rate == 1.0
    finally:
        engine.close()


@pytest.mark.parametrize(
    "extra", [{}, {"frequency_penalty": 0.4, "logit_bias": {7: 2.0}}, {"temperature": 0.7, "seed": 3}]
)
def test_a_draft_that_disagrees_changes_no_answer(random_pair, extra):
    plain = answers(random_pair, {"plain": _params(None, **extra)})["plain"]
    drafted = answers(random_pair, {"draft": _params(DRAFT, **extra)})["draft"]
    assert tokens_of(drafted) == tokens_of(plain)
    usage = usage_of(drafted)
    print(f"{usage.accepted_tokens} of {usage.proposed_tokens} proposed kept")
    assert usage.proposed_tokens > usage.accepted_tokens  # refused proposals: its cache was cut back


def test_drafted_and_plain_requests_batched_answer_as_each_alone(random_pair):
    requests = {f"r{i}": _params(DRAFT if i % 2 else None, text=WORDS * 3 + f" {i}") for i in range(4)}
    alone = {name: tokens_of(answers(random_pair, {name: params})[name]) for name, params in requests.items()}
    together = answers(random_pair, requests)
    assert {name: tokens_of(chunks) for name, chunks in together.items()} == alone


def test_a_draft_request_needs_the_instance_draft(random_pair, tmp_path: Path, monkeypatch):
    with pytest.raises(ValueError, match="drafts with test/draft, not other/draft"):
        random_pair.submit(CommandId("x"), _params(Speculative(method="draft", draft_model="other/draft")))
    monkeypatch.setenv("EXO_HOME", str(tmp_path / "home"))
    loader = load_llamacpp_engine if isinstance(random_pair, LlamaCppEngine) else load_engine
    engine = loader(make_tiny_llama(tmp_path / "alone"))
    try:
        with pytest.raises(ValueError, match="needs a draft model"):
            engine.submit(CommandId("y"), _params(DRAFT))
        make_copy_model(tmp_path / "other", 40)  # another tokenizer
        with pytest.raises(ValueError, match="another tokenizer"):
            engine.load_draft(tmp_path / "other", "test/other")
    finally:
        engine.close()


def test_the_card_default_applies_unless_the_request_says(random_pair, monkeypatch):
    monkeypatch.setattr(random_pair, "card_speculative", DRAFT)
    unsaid = usage_of(answers(random_pair, {"a": _params(None)})["a"])
    off = usage_of(answers(random_pair, {"b": _params("off")})["b"])
    lookup = usage_of(answers(random_pair, {"c": _params(Speculative(num_draft=4))})["c"])
    assert unsaid.proposed_tokens > 0 and off.proposed_tokens == 0
    assert lookup.proposed_tokens > 0


def _draft_proposals(engine: Any, settings: Speculative) -> Any:
    return engine._proposer(_params(settings))


def _draft_kv_length(proposals: Any) -> int:
    """The tokens the request's draft KV holds: its MLX cache's offset, or the positions of
    its llama.cpp sequence."""
    if hasattr(proposals, "cache"):
        return proposals.cache[0].offset
    return llama_cpp.llama_memory_seq_pos_max(proposals.draft.context.memory, proposals.sequence) + 1


def test_the_draft_cache_follows_what_the_target_kept(random_pair):
    """Proposal after proposal, with the sequence keeping some guesses and refusing the
    rest: the incremental draft proposes what a fresh draft given the whole sequence
    proposes, and its cache holds the sequence's tokens alone (plus its own guesses)."""
    settings = Speculative(method="draft", num_draft=4)
    running = _draft_proposals(random_pair, settings)
    sequence = [5 + (7 * i) % 300 for i in range(40)]
    running.extend(sequence)
    try:
        for kept in (0, 2, 3, 1, 0, 3):
            proposals = running.propose(4)
            fresh = _draft_proposals(random_pair, settings)
            fresh.extend(list(running.tokens))
            assert proposals == fresh.propose(4)
            fresh.close()
            # The target keeps `kept` of them, then draws a token of its own.
            accepted = proposals[:kept] + [(proposals[kept] + 1) % 300 if kept < len(proposals) else 9]
            running.extend(accepted)
            assert _draft_kv_length(running) == running.confirmed + len(running.guesses)
    finally:
        running.close()


# llama.cpp alone: its draft holds a fixed set of sequences (MLX's keeps a cache per request).
@pytest.mark.parametrize("random_pair", ["llamacpp"], indirect=True)
def test_finished_requests_give_their_draft_sequence_back(random_pair):
    """llama.cpp: more drafted requests one after another than the draft's context has
    sequences, and one cancelled mid-answer: each still gets proposals, and every
    sequence is free after."""
    assert isinstance(random_pair, LlamaCppEngine)
    random_pair.submit(CommandId("cancelled"), _params(DRAFT, max_tokens=40))
    random_pair.step()
    random_pair.step()
    random_pair.cancel(CommandId("cancelled"))
    for i in range(limits.MAX_BATCH + 2):
        name = f"s{i}"
        usage = usage_of(answers(random_pair, {name: _params(DRAFT, text=WORDS * 2 + f" {i}", max_tokens=8)})[name])
        assert usage.proposed_tokens > 0, name
    assert sorted(random_pair.draft.free_sequences) == list(range(limits.MAX_BATCH))
