"""Fixtures shared by every folder: a tiny random model on disk and one real exo node
serving it, whose log is printed when the test using it fails."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from exo.devtools.tiny_models import make_tiny_llama
from tests.support.node import TINY_MODEL_ID, ExoNode, running_node


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    models_dir = tmp_path_factory.mktemp("models")
    make_tiny_llama(models_dir / TINY_MODEL_ID.replace("/", "--"))
    return models_dir


@pytest.fixture
def exo_node(tmp_path: Path, tiny_models_dir: Path, request: pytest.FixtureRequest) -> Iterator[ExoNode]:
    with running_node(tmp_path / "exo_home", {"EXO_MODELS_DIRS": str(tiny_models_dir)}) as node:
        yield node
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(f"--- exo node log ---\n{node.logs()[-20000:]}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
