"""Speculative decoding by prompt lookup, in both engines in this process (real MLX and
real llama.cpp on the tiny llama): the answer is the plain answer token for token
(greedy, with penalties and logit bias, seeded sampling, and a JSON schema's grammar), proposals are made and
some kept (the tiny llama's greedy text repeats itself, which the lookup finds), usage
counts them, and speculative requests batched with plain ones change no one's answer."""

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from exo.devtools.local_engine import load_llamacpp_engine
from exo.devtools.scripted_models import make_copy_model
from exo.devtools.tiny_models import make_tiny_llama
from exo.engine.speculative import PromptLookup
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import ChatMessage, Speculative, TextGenerationTaskParams
from tests.support.engine import answers, load_engine, tokens_of, usage_of

WORDS = "cluster node model token the cat runs over the quiet moon "
ON = Speculative(method="prompt_lookup", num_draft=6)


def test_the_lookup_proposes_what_followed_the_longest_match():
    lookup = PromptLookup(ON)
    lookup.extend([1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 8, 1, 2, 3])
    # "1 2 3" last occurred at the start: what followed it is proposed, not what
    # followed the later, shorter match "2 3".
    assert lookup.propose(4) == [4, 5, 6, 9]
    assert lookup.propose(100) == [4, 5, 6, 9, 2, 3]  # num_draft caps it
    lookup.extend([7])
    assert lookup.propose(4) == [8, 1, 2, 3]  # "2 3 7" -> 8 ...
    lookup.extend([11])
    assert lookup.propose(4) == []  # "7 11" and "3 7 11" never occurred
    assert PromptLookup(ON).propose(3) == []


def _params(text: str, max_tokens: int, speculative: Speculative | None, **extra) -> TextGenerationTaskParams:
    return TextGenerationTaskParams(
        model=ModelId("test/model"),
        messages=[ChatMessage(role="user", content=text)],
        max_tokens=max_tokens,
        speculative=speculative,
        **{"temperature": 0.0, **extra},
    )


REQUESTS = {
    "greedy": dict(text=WORDS * 6, max_tokens=64),
    "penalized": dict(text=WORDS * 3, max_tokens=48, frequency_penalty=0.4, logit_bias={7: 2.0}),
    "sampled": dict(text=WORDS * 4, max_tokens=64, temperature=0.5, top_p=0.95, seed=7),
    # The grammar masks every verified position as it masks a plain step.
    "json": dict(
        text=WORDS * 4,
        max_tokens=64,
        response_format={
            "type": "json_schema",
            "json_schema": {
                "name": "words",
                "schema": {
                    "type": "object",
                    "properties": {
                        "words": {"type": "array", "items": {"enum": ["cat", "moon", "node"]}, "minItems": 12}
                    },
                    "required": ["words"],
                },
            },
        },
    ),
}


@pytest.fixture(scope="module")
def mlx_engine(tmp_path_factory: pytest.TempPathFactory):
    engine = load_engine(make_tiny_llama(tmp_path_factory.mktemp("spec") / "tiny"))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def llamacpp_engine(tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    from tests.unit.test_llamacpp_batching import loaded_engine

    with loaded_engine(tiny_models_dir, tmp_path_factory.mktemp("home")) as engine:
        yield engine


ENGINES: dict[str, Callable[[pytest.FixtureRequest], object]] = {
    "mlx": lambda request: request.getfixturevalue("mlx_engine"),
    "llamacpp": lambda request: request.getfixturevalue("llamacpp_engine"),
}


@pytest.mark.parametrize("engine_name", list(ENGINES))
def test_speculative_answers_are_the_plain_answers(engine_name: str, request: pytest.FixtureRequest):
    engine = ENGINES[engine_name](request)
    for name, spec in REQUESTS.items():
        plain = answers(engine, {name: _params(**spec, speculative=None)})[name]
        fast = answers(engine, {name: _params(**spec, speculative=ON)})[name]
        assert tokens_of(fast) == tokens_of(plain), name
        assert fast[-1].finish_reason == plain[-1].finish_reason
        usage = usage_of(fast)
        print(f"{engine_name} {name}: {usage.accepted_tokens} of {usage.proposed_tokens} proposed kept")
        assert usage.completion_tokens == usage_of(plain).completion_tokens
        assert 0 <= usage.accepted_tokens <= usage.proposed_tokens
        assert usage_of(plain).proposed_tokens == 0
    # The greedy text repeats itself: proposals were made and kept.
    greedy = usage_of(answers(engine, {"g": _params(**REQUESTS["greedy"], speculative=ON)})["g"])
    assert greedy.proposed_tokens > 0 and greedy.accepted_tokens > 0
    # So does the schema's answer (at least 12 items of three words), under its grammar.
    constrained = usage_of(answers(engine, {"j": _params(**REQUESTS["json"], speculative=ON)})["j"])
    assert constrained.proposed_tokens > 0 and constrained.accepted_tokens > 0


@pytest.mark.parametrize("engine_name", list(ENGINES))
def test_speculative_and_plain_requests_batched_answer_as_each_alone(engine_name: str, request):
    engine = ENGINES[engine_name](request)
    requests = {
        f"{name}-{i}": _params(**{**spec, "text": spec["text"] + f" {i}"}, speculative=ON if i % 2 else None)
        for i in range(2)
        for name, spec in REQUESTS.items()
        if name != "sampled"
    }
    alone = {name: tokens_of(answers(engine, {name: params})[name]) for name, params in requests.items()}
    together = answers(engine, requests)
    assert {name: tokens_of(chunks) for name, chunks in together.items()} == alone


@pytest.fixture(scope="module")
def copy_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """A model whose answer is a 120-token text its prompt holds (scripted weights)."""
    path = tmp_path_factory.mktemp("copy") / "model"
    return path, make_copy_model(path, 120)


@pytest.mark.parametrize("engine_name", ["mlx", "llamacpp"])
def test_sampled_proposals_are_kept_only_where_the_sampler_draws_them(engine_name, copy_model, tmp_path, monkeypatch):
    """At temperature 6 the script's next token is likely but far from sure (its logit
    stands far above the rest): some proposals are drawn and kept, many are not, and the
    seeded answer is the plain one."""
    monkeypatch.setenv("EXO_HOME", str(tmp_path))
    path, prompt = copy_model
    engine = load_engine(path) if engine_name == "mlx" else load_llamacpp_engine(path)
    try:
        by_mode = {}
        for speculative in (None, ON):
            params = TextGenerationTaskParams(
                model=ModelId("test/model"),
                messages=[],
                prompt=prompt,
                max_tokens=100,
                temperature=6.0,
                seed=3,
                speculative=speculative,
            )
            by_mode[speculative is not None] = answers(engine, {"copy": params})["copy"]
        usage = usage_of(by_mode[True])
        print(f"{engine_name}: {usage.accepted_tokens} of {usage.proposed_tokens} proposed kept")
        assert tokens_of(by_mode[True]) == tokens_of(by_mode[False])
        assert 0 < usage.accepted_tokens < usage.proposed_tokens
    finally:
        engine.close()
