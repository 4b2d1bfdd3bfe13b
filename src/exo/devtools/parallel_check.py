"""Runs one rank of a model split over an MLX ring and records its logits, so tests can
compare 1, 2 and 4 processes on the same prompt. Uses the engine's real loading and
sharding code. With `--schedules` it records instead the logits at every prompt position
for each way of feeding the prompt through the cache (whole, in chunks, token by token).

    python -m exo.devtools.parallel_check MODEL_DIR OUT.npz --sharding pipeline \\
        --world-size 2 --rank 0 --hosts 127.0.0.1:5000,127.0.0.1:5001
"""

import argparse
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from exo.catalog.cards import card_from_model_dir
from exo.engine.mlx.engine import prefill_chunk
from exo.engine.mlx.loading import load_shard
from exo.engine.mlx.parallel import connect_group, from_last_rank
from exo.master.placement import split_layers
from exo.shared.types.common import InstanceId, ModelId, NodeId, RunnerId
from exo.shared.types.instances import Instance, ShardAssignments, Sharding
from exo.shared.types.shards import PipelineShardMetadata, ShardMetadata, TensorShardMetadata


def build_instance(model_dir: Path, sharding: Sharding, world_size: int, hosts: list[str]) -> Instance:
    card = card_from_model_dir(model_dir, "check/model")
    ranges = (
        split_layers(card.n_layers, [1] * world_size, card.pipeline_tail_start)
        if sharding == Sharding.Pipeline
        else None
    )
    shards = {}
    for rank in range(world_size):
        start, end = ranges[rank] if ranges else (0, card.n_layers)
        shard_type = PipelineShardMetadata if sharding == Sharding.Pipeline else TensorShardMetadata
        shards[RunnerId(f"rank{rank}")] = shard_type(
            model_card=card,
            device_rank=rank,
            world_size=world_size,
            start_layer=start,
            end_layer=end,
            n_layers=card.n_layers,
        )
    return Instance(
        instance_id=InstanceId("check"),
        sharding=sharding,
        shard_assignments=ShardAssignments(
            model_id=ModelId("check/model"),
            runner_to_shard=shards,
            node_to_runner={NodeId(f"node{r}"): RunnerId(f"rank{r}") for r in range(world_size)},
        ),
        hosts=hosts if world_size > 1 else [],
    )


def load_rank(
    model_dir: Path, instance: Instance, rank: int
) -> tuple[nn.Module, ShardMetadata, mx.distributed.Group | None]:
    shard = instance.shard_assignments.runner_to_shard[RunnerId(f"rank{rank}")]
    group = connect_group(instance, shard)
    model, _ = load_shard(model_dir, shard, group, lambda done, total: None)
    return model, shard, group


def run_rank(model_dir: Path, instance: Instance, rank: int, prompt: list[int], decode_steps: int) -> dict:
    model, shard, group = load_rank(model_dir, instance, rank)
    cache = make_prompt_cache(model)
    # The prompt goes in as the engine sends it: all but the last token by the engine's
    # prefill (overlapped micro-chunks across pipeline ranks), then the last one.
    pipeline_ranks = shard.world_size if isinstance(shard, PipelineShardMetadata) else 1
    prefill_chunk(model, prompt[:-1], cache, pipeline_ranks)

    def forward(tokens: list[int]) -> mx.array:
        logits = model(mx.array(tokens)[None], cache=cache)[0, -1]
        # A pipeline's last rank alone computes logits; it shares them for the record.
        return logits if pipeline_ranks == 1 or group is None else from_last_rank(logits, group)

    all_logits, tokens = [forward(prompt[-1:])], []
    for _ in range(decode_steps):
        token = int(mx.argmax(all_logits[-1]))
        tokens.append(token)
        all_logits.append(forward([token]))
    # The weights the rank holds outside its layers (embeddings, final norm, head, ...).
    ends = sorted(name for name, _ in tree_flatten(model.parameters()) if ".layers." not in f".{name}")
    return {
        "logits": np.array(mx.stack(all_logits).astype(mx.float32)),
        "tokens": np.array(tokens),
        "ends": np.array(ends, dtype=str),
    }


def logits_per_schedule(
    model: nn.Module, prompt: list[int], schedules: dict[str, list[int]], pipeline: mx.distributed.Group | None = None
) -> dict[str, np.ndarray]:
    """For each schedule (the lengths of the calls, summing to the prompt's), the logits
    [len(prompt), vocab] of a fresh cache fed the prompt in those calls (on a pipeline's
    ranks, the last rank's)."""
    results = {}
    for name, pieces in schedules.items():
        if sum(pieces) != len(prompt):
            raise ValueError(f"schedule {name} covers {sum(pieces)} of {len(prompt)} tokens")
        cache, logits, start = make_prompt_cache(model), [], 0
        for length in pieces:
            out = model(mx.array(prompt[start : start + length])[None], cache=cache)[0]
            out = out if pipeline is None else from_last_rank(out, pipeline)
            logits.append(np.array(out.astype(mx.float32)))
            start += length
        results[name] = np.concatenate(logits)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--sharding", choices=["pipeline", "tensor"], default="pipeline")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--hosts", default="")
    parser.add_argument("--prompt", default="[]", help="JSON list of token ids")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--schedules", help="JSON object: name -> lengths of the calls feeding the prompt")
    args = parser.parse_args()
    sharding = Sharding.Pipeline if args.sharding == "pipeline" else Sharding.Tensor
    instance = build_instance(args.model_dir, sharding, args.world_size, [h for h in args.hosts.split(",") if h])
    prompt = json.loads(args.prompt)
    result: dict  # arrays by name, for np.savez
    if args.schedules:
        model, shard, group = load_rank(args.model_dir, instance, args.rank)
        pipeline = group if isinstance(shard, PipelineShardMetadata) else None
        result = logits_per_schedule(model, prompt, json.loads(args.schedules), pipeline)
    else:
        result = run_rank(args.model_dir, instance, args.rank, prompt, args.decode_steps)
    np.savez(args.out, **result)


if __name__ == "__main__":
    main()
