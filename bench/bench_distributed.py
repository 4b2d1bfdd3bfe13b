"""Decode and prefill speed of one model on 1 node, split over 2 nodes by pipeline, and
split over 2 nodes by tensor parallelism: real exo nodes on loopback, measured as a
client sees it, in one run, with the ratios to the single node. Prefill is a long
prompt's tokens per second as the runner reports them (generation_stats.prompt_tps).

    .venv/bin/python bench/bench_distributed.py [--tokens 128]

On one 2-core machine two nodes share the cores, so this measures the cost of the split
(communication, agreement between ranks), not the speed-up real separate machines give.
"""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for tests.support
sys.path.insert(0, str(Path(__file__).resolve().parent))
import httpx  # noqa: E402
from bench_decode import bench_model, streamed_decode_tps  # noqa: E402

from tests.support.cluster import loopback_cluster, wait_converged  # noqa: E402


def place(node, model_id: str, sharding: str, min_nodes: int) -> str:
    response = node.post("/place_instance", json={"model_id": model_id, "sharding": sharding, "min_nodes": min_nodes})
    response.raise_for_status()
    instance_id = response.json()["instance_id"]
    with httpx.stream("GET", f"{node.url}/instance/await", params={"instance_id": instance_id}, timeout=900) as stream:
        for _ in stream.iter_lines():
            pass
    return instance_id


def prefill_tps(url: str, model_id: str, words: int) -> float:
    body = {
        "model": model_id,
        "messages": [{"role": "user", "content": "the cluster runs a model over every node " * (words // 8)}],
        "max_tokens": 1,
        "temperature": 0,
    }
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=900)
    response.raise_for_status()
    return response.json()["generation_stats"]["prompt_tps"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=600)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model_dir, model_id = bench_model(Path(scratch))
        with loopback_cluster(2, Path(scratch), {"EXO_MODELS_DIRS": str(model_dir.parent)}) as nodes:
            wait_converged(nodes)
            nodes[0].wait_for_state(lambda s: len(s["topology"]["connections"]) == 2, timeout=60)
            results, prefill = {}, {}
            for label, sharding, min_nodes in (
                ("1 node", "Pipeline", 1),
                ("2-node pipeline", "Pipeline", 2),
                ("2-node tensor", "Tensor", 2),
            ):
                instance_id = place(nodes[0], model_id, sharding, min_nodes)
                results[label], generated = streamed_decode_tps(nodes[0].url, model_id, args.tokens)
                prefill[label] = prefill_tps(nodes[0].url, model_id, args.prompt_words)
                nodes[0].delete(f"/instance/{instance_id}")
                nodes[0].wait_for_state(lambda s: s["instances"] == {} and s["runners"] == {}, timeout=60)
    single = results["1 node"]
    print(f"model: {model_id}, {generated} tokens per run")
    for label, tps in results.items():
        print(f"{label:16s} decode  {tps:7.1f} tok/s   ratio to 1 node: {tps / single:.3f}")
    for label, tps in prefill.items():
        print(f"{label:16s} prefill {tps:7.1f} tok/s   ratio to 1 node: {tps / prefill['1 node']:.3f}")


if __name__ == "__main__":
    main()
