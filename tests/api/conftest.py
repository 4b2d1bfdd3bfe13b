"""The node most API test modules share: one per module, serving the tiny model (a module
whose node needs other models, flags or limits defines its own `node`)."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.node import TINY_MODEL_ID, ExoNode, running_node


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, tiny_models_dir: Path) -> Iterator[ExoNode]:
    home = tmp_path_factory.mktemp("node") / "home"
    with running_node(home, {"EXO_MODELS_DIRS": str(tiny_models_dir)}, models=[TINY_MODEL_ID]) as exo:
        yield exo
