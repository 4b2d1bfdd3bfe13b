"""Images on 2 nodes: the tiny Gemma 4 VLMs (E2B/E4B and 26B-A4B layouts), Qwen2.5-VL,
Qwen3-VL and Kimi-VL split by pipeline, and the Gemma 4 and Kimi-VL ones by tensor
parallelism (Kimi-VL's reference is mlx-vlm's model, tests/api/test_vision.py says why), across two real
nodes on 127.0.0.1. Rank 0 alone runs the vision tower and sends the features to the
other rank (Gemma 4's per-layer inputs are projected from the embeddings, so every rank
needs them), with the Qwen family's 3-D positions and Qwen3-VL's DeepStack features
(rank 1 holds decoder layer 2, which adds the third level); the image bytes are not
broadcast. The first
token's top-20 log-probabilities, sent with the openai SDK as a data URL, equal
transformers' forward within 1e-3, for two different images, with prefill chunks whose
boundaries fall inside the image's run (except for the 26B-A4B layout, whose image runs
are prefilled whole)."""

import base64
import hashlib
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from exo.devtools.tiny_vlms import vlm_reference
from tests.support.cluster import Cluster, loopback_cluster, wait_converged
from tests.support.images import VLM_MODELS, VLM_QUESTION, noise_png, vlm_models_dir

QUESTION = VLM_QUESTION
TOLERANCE = 1e-3
TOP = 20
PREFILL_STEP = 32
IMAGES = {"first": noise_png(3), "second": noise_png(4)}


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vlm_models_dir(tmp_path_factory.mktemp("vlm-models"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, vlm_dir: Path) -> Iterator[Cluster]:
    env = {"EXO_MODELS_DIRS": str(vlm_dir), "EXO_PREFILL_STEP": str(PREFILL_STEP)}
    with loopback_cluster(2, tmp_path_factory.mktemp("vlm-cluster"), env) as nodes:
        wait_converged(nodes)
        nodes[0].wait_for_state(lambda s: len(s["topology"]["connections"]) == 2, timeout=30, what="links measured")
        yield nodes


def _place_split(node, model: str, sharding: str) -> str:
    body = {"model_id": model, "sharding": sharding, "min_nodes": 2}
    response = node.post("/place_instance", json=body)
    assert response.status_code == 200, response.text
    params = {"instance_id": response.json()["instance_id"]}
    with httpx.stream("GET", f"{node.url}/instance/await", params=params, timeout=240) as stream:
        events = [line for line in stream.iter_lines() if line.startswith(("event:", "data:"))]
    assert "event: ready" in events, events[-4:]
    instance = node.get(f"/instance/{params['instance_id']}").json()
    assert len(instance["shardAssignments"]["nodeToRunner"]) == 2
    return instance


# Tensor where the language model has a strategy (Qwen2.5-VL's has none yet).
TENSOR = [("gemma4_vlm", "Tensor"), ("gemma4_moe_vlm", "Tensor"), ("kimi_vl", "Tensor")]
SPLITS = [(family, "Pipeline") for family in VLM_MODELS] + TENSOR


def _user_turn(data: bytes) -> dict:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}],
    }


def _first_token(node, model: str, messages: list[dict]):
    sdk = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=240)
    return sdk.chat.completions.create(
        model=model, messages=messages, max_tokens=1, temperature=0, logprobs=True, top_logprobs=TOP
    )


def _diff(completion, logprobs: list[float]) -> float:
    entry = completion.choices[0].logprobs.content[0]
    reference = np.sort(np.array(logprobs))[::-1][:TOP]
    served = np.array([alt.logprob for alt in entry.top_logprobs])
    return float(np.abs(served - reference).max())


def _delete(cluster: Cluster, instance_id: str) -> None:
    assert cluster[0].delete(f"/instance/{instance_id}").status_code == 200
    cluster[0].wait_for_state(lambda s: s["instances"] == {} and s["runners"] == {}, timeout=60, what="instances gone")


@pytest.mark.parametrize(("family", "sharding"), SPLITS)
def test_split_logprobs_equal_transformers(cluster: Cluster, vlm_dir: Path, family: str, sharding: str) -> None:
    model = VLM_MODELS[family]
    instance = _place_split(cluster[0], model, sharding)
    if family == "qwen3_vl":
        # A DeepStack level's layer on rank 1: its features must cross to it.
        starts = [shard["startLayer"] for shard in instance["shardAssignments"]["runnerToShard"].values()]
        assert 0 < max(starts) < 3, starts
    path = vlm_dir / model.replace("/", "--")
    diffs = {}
    for index, (name, data) in enumerate(IMAGES.items()):
        ids, logprobs = vlm_reference(path, QUESTION, Image.open(io.BytesIO(data)))
        # Asked of either node: the chunks cross the cluster to the one that was asked.
        completion = _first_token(cluster[index % 2], model, [_user_turn(data)])
        diffs[name] = _diff(completion, logprobs[0])
        assert completion.usage.prompt_tokens == len(ids)
    print(f"{family}, 2 nodes, {sharding}: max |logprob diff| per image: {diffs}")
    _delete(cluster, instance["instanceId"])
    assert max(diffs.values()) <= TOLERANCE


def test_images_cross_the_cluster_once_by_hash(cluster: Cluster, vlm_dir: Path) -> None:
    """Asked of the node that does not hold rank 0: the task names the image by hash and
    by the asked node, whose image store has the bytes; rank 0's node takes them from its
    /peer-images once. No event (so no node's durable event log) holds the bytes, and the
    same image again, then a follow-up turn repeating it, move none."""
    model = VLM_MODELS["qwen3_vl"]
    instance = _place_split(cluster[0], model, "Pipeline")
    assignments = instance["shardAssignments"]
    ranks = {
        node: assignments["runnerToShard"][runner]["deviceRank"] for node, runner in assignments["nodeToRunner"].items()
    }
    by_id = {node.node_id(): node for node in cluster}
    rank0 = by_id[min(ranks, key=lambda node: ranks[node])]
    asked = next(node for node in cluster if node is not rank0)
    data = noise_png(5)
    sha256 = hashlib.sha256(data).hexdigest()
    _, logprobs = vlm_reference(vlm_dir / model.replace("/", "--"), QUESTION, Image.open(io.BytesIO(data)))
    first = _first_token(asked, model, [_user_turn(data)])
    again = _first_token(asked, model, [_user_turn(data)])
    answer = {"role": "assistant", "content": first.choices[0].message.content or "?"}
    follow_up = _first_token(asked, model, [_user_turn(data), answer, _user_turn(data)])
    diffs = {"first": _diff(first, logprobs[0]), "again": _diff(again, logprobs[0])}
    transfers = rank0.logs().count(f"image {sha256[:12]}: {len(data)} bytes taken from node {asked.node_id()}")
    print(f"asked node {asked.node_id()}, rank 0 on {rank0.node_id()}: diffs {diffs}, transfers {transfers}")
    _delete(cluster, instance["instanceId"])
    encoded = base64.b64encode(data).decode()
    for node in cluster:
        # Its history: the event segments and the snapshots of State.
        log = "".join(path.read_text() for path in sorted((node.home / "data" / "history").iterdir()))
        assert sha256 in log
        assert encoded[:64] not in log and encoded[-64:] not in log, "the image's bytes are in an event"
    assert max(diffs.values()) <= TOLERANCE
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert follow_up.usage.completion_tokens == 1
    assert transfers == 1


def test_an_image_rank_0_cannot_prepare_fails_its_request_alone(cluster: Cluster, vlm_dir: Path) -> None:
    """A 1x600 image passes the API's checks (it decodes) but not Qwen's processor (an aspect ratio over 200), which
    only rank 0 runs: the other rank hears of the failure instead of waiting for
    features, the client gets a 400 naming the problem, and the instance serves on."""
    model = VLM_MODELS["qwen3_vl"]
    instance = _place_split(cluster[0], model, "Pipeline")
    with pytest.raises(openai.BadRequestError) as refused:
        _first_token(cluster[0], model, [_user_turn(noise_png(6, size=(1, 600)))])
    data = IMAGES["first"]
    _, logprobs = vlm_reference(vlm_dir / model.replace("/", "--"), QUESTION, Image.open(io.BytesIO(data)))
    served = _first_token(cluster[1], model, [_user_turn(data)])
    runners = [r["kind"] for r in cluster[0].state()["runners"].values()]
    print(f"1x600 image: {refused.value}; then runners {runners}")
    _delete(cluster, instance["instanceId"])
    assert "aspect ratio" in str(refused.value)
    assert _diff(served, logprobs[0]) <= TOLERANCE
    assert runners == ["RunnerReady", "RunnerReady"]
