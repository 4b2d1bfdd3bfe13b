"""llama.cpp's engine as rank 0 of a 2-rank split, its follower a real ggml RPC server in
another process (no exo nodes: the engine is wired to the follower as connect() would).
A request that ran alone keeps its KV for the prefix cache; one that decoded among
others does not, since reading its scattered KV back from the follower costs a round
trip per piece (8 such requests took 3.4 s each on a 1024x16 llama). Both give the
tokens one node gives. And ranks of one instance on one machine let idle threads sleep
soon, so the working rank has the cores."""

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from exo.catalog.cards import card_from_model_dir
from exo.devtools.bench_targets import free_port
from exo.engine.llamacpp.cores import IDLE_SPINS, share_cores
from exo.engine.llamacpp.engine import LlamaCppEngine
from exo.shared.types.shards import PipelineShardMetadata
from tests.support.node import TINY_MODEL_ID
from tests.unit.test_llamacpp_batching import params, run, tokens


@pytest.fixture(scope="module")
def split_engine(tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaCppEngine]:
    port = free_port()
    follower = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import time; from exo.engine.llamacpp import rpc; rpc.serve('127.0.0.1:{port}'); time.sleep(600)",
        ]
    )
    model_dir = tiny_models_dir / TINY_MODEL_ID.replace("/", "--")
    card = card_from_model_dir(model_dir, "test/model")
    shard = PipelineShardMetadata(
        model_card=card, device_rank=0, world_size=2, start_layer=0, end_layer=card.n_layers - 1, n_layers=card.n_layers
    )
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("EXO_HOME", str(tmp_path_factory.mktemp("home")))
            engine = LlamaCppEngine()
            engine.endpoints, engine.follower_layers = [f"127.0.0.1:{port}"], [1]
            engine.load(model_dir, shard, lambda done, total: None)
            engine.warm_up()
            yield engine
            engine.close()
    finally:
        follower.kill()
        follower.wait()


def test_a_lone_request_is_cached_and_a_batched_one_is_not(split_engine: LlamaCppEngine):
    cache = split_engine.scheduler.prefix_cache if split_engine.scheduler is not None else None
    assert cache is not None and split_engine.model is not None
    alone = run(split_engine, {"a": params("the moon sleeps over the slow cluster", 6)})["a"]
    assert len(cache) == 1
    again = run(split_engine, {"b": params("the moon sleeps over the slow cluster", 6)})["b"]
    assert again[-1].usage is not None and again[-1].usage.cached_tokens == again[-1].usage.prompt_tokens - 1
    assert tokens(again) == tokens(alone)

    cache.clear()
    together = run(split_engine, {f"s{i}": params(f"the node {i} runs over the bright cluster", 24) for i in range(3)})
    # Each decoded ~24 steps beside the others: its KV is in as many pieces.
    assert len(cache) == 0
    solo = run(split_engine, {"s1": params("the node 1 runs over the bright cluster", 24)})["s1"]
    assert tokens(together["s1"]) == tokens(solo)


def test_runners_let_each_other_have_the_cores_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    share_cores()
    assert os.environ["GOMP_SPINCOUNT"] == IDLE_SPINS
    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    share_cores()
    assert os.environ["GOMP_SPINCOUNT"] == "123"
