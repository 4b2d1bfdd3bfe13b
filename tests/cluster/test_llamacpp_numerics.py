"""The llama.cpp engine gives transformers' numbers, on one node and split across two
nodes by ggml's RPC backend: for each family its GGUF converter covers, a random float32
transformers model (the served-numerics references) is served by two real nodes
running --engine llamacpp, once on one node and once as a 2-node pipeline (rank 0
offloads the second rank's layers to the other node's RPC server). A 64-token prompt,
prefilled in 24-token chunks, then 8 greedy tokens: every logprob within 1e-3 of
transformers' full forward, and the split's tokens and logprobs those of one node."""

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.cluster.test_served_numerics import (
    PIPELINE,
    PREFILL_STEP,
    SINGLE,
    STEPS,
    TOLERANCE,
    Reference,
    _reference,
    model_id,
)
from tests.support.cluster import Cluster, loopback_cluster, wait_converged

FAMILIES = ["llama", "qwen2", "qwen3"]
SPLIT_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Reference]]:
    models_dir = tmp_path_factory.mktemp("llamacpp-models")
    store = tmp_path_factory.mktemp("llamacpp-checkpoints")
    references = {}
    for family in FAMILIES:
        references[family] = _reference(store / family, family)
        for layout in (SINGLE, PIPELINE):
            (models_dir / model_id(family, layout).replace("/", "--")).symlink_to(store / family)
    return models_dir, references


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, checkpoints) -> Iterator[Cluster]:
    models_dir, _ = checkpoints
    env = {"EXO_MODELS_DIRS": str(models_dir), "EXO_PREFILL_STEP": str(PREFILL_STEP)}
    with loopback_cluster(2, tmp_path_factory.mktemp("llamacpp-cluster"), env, args=("--engine", "llamacpp")) as nodes:
        wait_converged(nodes)
        nodes[0].wait_for_state(lambda s: len(s["topology"]["connections"]) == 2, timeout=30, what="links measured")
        yield nodes


def _served(node, model: str, prompt: list[int]) -> tuple[str, list[float]]:
    body = {"model": model, "prompt": prompt, "max_tokens": STEPS, "temperature": 0, "logprobs": 1}
    response = httpx.post(f"{node.url}/v1/completions", json=body, timeout=240)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


@pytest.mark.parametrize("family", FAMILIES)
def test_llamacpp_gives_transformers_numbers_on_one_node_and_split(family: str, checkpoints, cluster: Cluster):
    _, references = checkpoints
    reference = references[family]
    served: dict[str, list[float]] = {}
    texts: dict[str, str] = {}
    for layout in (SINGLE, PIPELINE):
        instance_id = cluster[0].place(model_id(family, layout), 240, layout.sharding, layout.nodes)
        instance = cluster[0].get(f"/instance/{instance_id}").json()
        assert instance["engine"] == "llamacpp"
        texts[layout.name], served[layout.name] = _served(cluster[1], model_id(family, layout), reference.prompt)
        assert cluster[0].delete(f"/instance/{instance_id}").status_code == 200
        cluster[0].wait_for_state(lambda s: s["instances"] == {} and s["runners"] == {}, timeout=60, what="gone")
    diffs = {name: float(np.abs(np.array(got) - np.array(reference.logprobs)).max()) for name, got in served.items()}
    split = float(np.abs(np.array(served["pipeline"]) - np.array(served["single"])).max())
    print(f"{family}: max |logprob diff| vs transformers {diffs}, split vs one node {split:.1e}")
    assert max(diffs.values()) <= TOLERANCE, diffs
    assert split <= SPLIT_TOLERANCE
    assert texts["pipeline"] == texts["single"]
