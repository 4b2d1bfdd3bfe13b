"""Decode speed of one model on 1 node, split over 2 nodes by pipeline, and split over
2 nodes by tensor parallelism: real exo nodes on loopback, measured as a client sees it,
in one run, with the ratios to the single node.

    .venv/bin/python bench/bench_distributed.py [--tokens 128]

On one 2-core machine two nodes share the cores, so this measures the cost of the split
(communication, agreement between ranks), not the speed-up real separate machines give.
"""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import httpx  # noqa: E402
from bench_decode import bench_model, streamed_decode_tps  # noqa: E402

from cluster import loopback_cluster, wait_converged  # noqa: E402


def place(node, model_id: str, sharding: str, min_nodes: int) -> str:
    response = node.post("/place_instance", json={"model_id": model_id, "sharding": sharding, "min_nodes": min_nodes})
    response.raise_for_status()
    instance_id = response.json()["instance_id"]
    with httpx.stream("GET", f"{node.url}/instance/await", params={"instance_id": instance_id}, timeout=900) as stream:
        for _ in stream.iter_lines():
            pass
    return instance_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model_dir, model_id = bench_model(Path(scratch))
        with loopback_cluster(2, Path(scratch), {"EXO_MODELS_DIRS": str(model_dir.parent)}) as nodes:
            wait_converged(nodes)
            nodes[0].wait_for_state(lambda s: len(s["topology"]["connections"]) == 2, timeout=60)
            results = {}
            for label, sharding, min_nodes in (
                ("1 node", "Pipeline", 1),
                ("2-node pipeline", "Pipeline", 2),
                ("2-node tensor", "Tensor", 2),
            ):
                instance_id = place(nodes[0], model_id, sharding, min_nodes)
                results[label], generated = streamed_decode_tps(nodes[0].url, model_id, args.tokens)
                nodes[0].delete(f"/instance/{instance_id}")
                nodes[0].wait_for_state(lambda s: s["instances"] == {} and s["runners"] == {}, timeout=60)
    single = results["1 node"]
    print(f"model: {model_id}, {generated} tokens per run")
    for label, tps in results.items():
        print(f"{label:16s} {tps:7.1f} tok/s   ratio to 1 node: {tps / single:.3f}")


if __name__ == "__main__":
    main()
