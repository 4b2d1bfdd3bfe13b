"""Every family, served by real nodes, gives transformers' numbers.

For every tiny architecture, a random float32 transformers model with sharp weights
(N(0, 0.08)) is saved in the layout its published checkpoints use (save_pretrained's,
rewritten where that differs: gpt_oss, qwen3_5_moe, kimi_k25, step3p5; see
devtools/hub_layouts.py, which also says why kimi_k25's and step3p5's references, not
transformers classes of their own model_type, compute those models), and two real exo
nodes on 127.0.0.1 serve it three ways at once: on one node, as a 2-node pipeline, and (where the family has a
tensor strategy) as a 2-node tensor split over the MLX ring. The nodes run the default
engine, llama.cpp here: the families its GGUF converter covers are served by it on one
node and as a pipeline (ggml's RPC backend), the rest by MLX. Each way is its own model id
(a symlink to the same files), so one request per id reaches that instance. A 64-token
prompt (past every tiny sliding window, every sparse top-k and DeepSeek V4's first
dropped indexer entry) goes to /v1/completions as token ids, prefilled in 24-token
chunks, with 8 greedy tokens and their logprobs; every logprob must equal transformers'
full forward over the same tokens within 1e-3, and a split's the single node's within
1e-4 (the full forward, not transformers'
incremental decode, is the reference: see test_deepseek_v4_model.py for why it is right
for DeepSeek V4)."""

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from exo.devtools.onboard import random_prompt, write_reference_model
from exo.devtools.tiny_configs import TINY_CONFIGS
from exo.engine.llamacpp.gguf_convert import supports
from exo.shared.models.families import has_tensor_strategy
from exo.shared.types.instances import EngineKind
from tests.support.cluster import Cluster, loopback_cluster, wait_converged
from tests.support.node import DEFAULT_ENGINE

TOLERANCE = 1e-3
SPLIT_TOLERANCE = 1e-4
PROMPT_LEN = 64
STEPS = 8
PREFILL_STEP = 24
FAMILIES = list(TINY_CONFIGS)


@dataclass(frozen=True)
class Layout:
    name: str
    sharding: str
    nodes: int


SINGLE = Layout("single", "Pipeline", 1)
PIPELINE = Layout("pipeline", "Pipeline", 2)
TENSOR = Layout("tensor", "Tensor", 2)


def layouts_for(family: str) -> list[Layout]:
    return [SINGLE, PIPELINE] + ([TENSOR] if has_tensor_strategy(TINY_CONFIGS[family]["model_type"]) else [])


def model_id(family: str, layout: Layout) -> str:
    return f"exo-test/{family.replace('_', '-')}-{layout.name}"


@dataclass
class Reference:
    prompt: list[int]
    logprobs: list[float]


def _reference(path: Path, family: str) -> Reference:
    """Writes the checkpoint at `path`; greedy logprobs by transformers' full forward."""
    import torch

    model = write_reference_model(path, TINY_CONFIGS[family])
    prompt = random_prompt(model.config.get_text_config().vocab_size, PROMPT_LEN)
    tokens, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(STEPS):
            row = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), dim=-1)
            tokens.append(int(row.argmax()))
            logprobs.append(float(row[tokens[-1]]))
    return Reference(prompt, logprobs)


def _selected_families(request: pytest.FixtureRequest) -> list[str]:
    """The families of this module's test cases that run (after -k): the nodes must find
    every model when they start, so only those are built."""
    mine = [item for item in request.session.items if getattr(item, "module", None) is request.module]
    chosen = {item.callspec.params["family"] for item in mine if hasattr(item, "callspec")}
    return [family for family in FAMILIES if family in chosen]


@pytest.fixture(scope="module")
def checkpoints(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Reference]]:
    models_dir = tmp_path_factory.mktemp("served-models")
    store = tmp_path_factory.mktemp("checkpoints")
    references = {}
    for family in _selected_families(request):
        references[family] = _reference(store / family, family)
        for layout in layouts_for(family):
            (models_dir / model_id(family, layout).replace("/", "--")).symlink_to(store / family)
    return models_dir, references


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, checkpoints) -> Iterator[Cluster]:
    models_dir, _ = checkpoints
    env = {"EXO_MODELS_DIRS": str(models_dir), "EXO_PREFILL_STEP": str(PREFILL_STEP)}
    with loopback_cluster(2, tmp_path_factory.mktemp("served-cluster"), env) as nodes:
        wait_converged(nodes)
        nodes[0].wait_for_state(lambda s: len(s["topology"]["connections"]) == 2, timeout=30, what="links measured")
        yield nodes


def _served_logprobs(node, model: str, prompt: list[int]) -> list[float]:
    body = {"model": model, "prompt": prompt, "max_tokens": STEPS, "temperature": 0, "logprobs": 1}
    response = httpx.post(f"{node.url}/v1/completions", json=body, timeout=240)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["token_logprobs"]


@pytest.mark.parametrize("family", FAMILIES)
def test_served_logprobs_match_transformers(family: str, checkpoints, cluster: Cluster) -> None:
    _, references = checkpoints
    reference = references[family]
    layouts = layouts_for(family)
    started = time.monotonic()
    # The layouts load side by side; requests go through both nodes, so chunks of a split
    # instance cross the cluster to the node that was asked.
    with ThreadPoolExecutor(len(layouts)) as pool:
        instance_ids = list(
            pool.map(lambda lay: cluster[0].place(model_id(family, lay), 240, lay.sharding, lay.nodes), layouts)
        )
        served = list(
            pool.map(
                lambda i: _served_logprobs(cluster[i % 2], model_id(family, layouts[i]), reference.prompt),
                range(len(layouts)),
            )
        )
    # The nodes run llama.cpp (the default here): it serves what its converter covers, on
    # one node and split by its RPC backend; MLX serves the rest, and every tensor split.
    engines = [cluster[0].get(f"/instance/{instance_id}").json()["engine"] for instance_id in instance_ids]
    on_llama_cpp = DEFAULT_ENGINE == EngineKind.LlamaCpp and supports(TINY_CONFIGS[family]) is None
    assert engines == ["llamacpp" if on_llama_cpp and lay != TENSOR else "mlx" for lay in layouts]
    for instance_id in instance_ids:
        assert cluster[0].delete(f"/instance/{instance_id}").status_code == 200
    cluster[0].wait_for_state(lambda s: s["instances"] == {} and s["runners"] == {}, timeout=60, what="instances gone")
    # Deleting a split instance stops its ranks in order: none is reported failed.
    failures = [
        e["event"]["status"]
        for e in cluster[0].get("/events").json()
        if e["event"]["kind"] == "RunnerStatusUpdated" and e["event"]["status"]["kind"] == "RunnerFailed"
    ]
    assert failures == []
    diffs = {
        lay.name: float(np.abs(np.array(got) - np.array(reference.logprobs)).max())
        for lay, got in zip(layouts, served, strict=True)
    }
    print(
        f"{family}: max |logprob diff| {', '.join(f'{k} {v:.1e}' for k, v in diffs.items())} ({time.monotonic() - started:.0f} s)"
    )
    for got in served:
        assert len(got) == STEPS
    assert max(diffs.values()) <= TOLERANCE, diffs
    split_diffs = [float(np.abs(np.array(got) - np.array(served[0])).max()) for got in served[1:]]
    assert max(split_diffs) <= SPLIT_TOLERANCE, f"splits against the single node: {split_diffs}"
