"""Speculative decoding by prompt lookup against plain decoding, side by side in one
process, on exo's engines (MLX and llama.cpp):

    python -m exo.devtools.bench_speculative [--engines mlx,llamacpp] [--length 1500]

A copy-heavy workload: the prompt holds a text of `--length` tokens and the answer writes
it back (a scripted model whose greedy answer is that text: the best case, where every
proposal is right, standing in for an edited file written back). Each round runs the
same greedy request without and with speculation; the text must be identical. Prints
decode tok/s (first token to last), the ratio, and the acceptance rate."""

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from exo.devtools.local_engine import load_engine, load_llamacpp_engine
from exo.devtools.scripted_models import make_copy_model
from exo.shared.types.common import CommandId, ModelId
from exo.shared.types.text_generation import Speculative, TextGenerationTaskParams


def decode(engine: Any, prompt: list[int], max_tokens: int, speculative: Speculative | None) -> dict[str, Any]:
    params = TextGenerationTaskParams(
        model=ModelId("bench"),
        messages=[],
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        speculative=speculative,
    )
    engine.submit(CommandId("bench"), params)
    tokens: list[int] = []
    first = usage = None
    while engine.has_work:
        for chunk in engine.step():
            if chunk.token_ids and first is None:
                first = time.perf_counter()
            tokens += chunk.token_ids
            usage = chunk.usage or usage
    assert first is not None and usage is not None
    elapsed = time.perf_counter() - first
    return {
        "tokens": tokens,
        "tps": (len(tokens) - 1) / elapsed,
        "proposed": usage.proposed_tokens,
        "accepted": usage.accepted_tokens,
    }


def bench(name: str, engine: Any, prompt: list[int], max_tokens: int, rounds: int, num_draft: int) -> float:
    plain_tps, fast_tps = [], []
    for round_index in range(rounds):
        plain = decode(engine, prompt, max_tokens, None)
        fast = decode(engine, prompt, max_tokens, Speculative(num_draft=num_draft))
        if fast["tokens"] != plain["tokens"]:
            raise SystemExit(f"{name}: the speculative text differs from the plain one")
        plain_tps.append(plain["tps"])
        fast_tps.append(fast["tps"])
        rate = fast["accepted"] / max(fast["proposed"], 1)
        print(
            f"{name} round {round_index + 1}: plain {plain['tps']:.1f} tok/s, prompt lookup {fast['tps']:.1f} tok/s "
            f"({fast['tps'] / plain['tps']:.2f}x), {fast['accepted']} of {fast['proposed']} proposed kept "
            f"({rate:.0%}), {len(plain['tokens'])} tokens, identical text"
        )
    ratio = statistics.median(fast_tps) / statistics.median(plain_tps)
    print(f"{name}: median {statistics.median(fast_tps):.1f} vs {statistics.median(plain_tps):.1f} tok/s = {ratio:.2f}x")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="mlx,llamacpp")
    parser.add_argument("--length", type=int, default=1500, help="tokens of the text the prompt holds")
    parser.add_argument("--max-tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-draft", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = Path(scratch) / "copy"
        overrides = {"num_hidden_layers": args.layers, "intermediate_size": args.intermediate}
        prompt = make_copy_model(model_dir, args.length, config_overrides=overrides)
        print(f"copy model: {args.length}-token text, {args.layers} layers, MLP {args.intermediate} wide")
        loaders = {"mlx": load_engine, "llamacpp": load_llamacpp_engine}
        for name in args.engines.split(","):
            engine = loaders[name](model_dir)
            try:
                bench(name, engine, prompt, args.max_tokens, args.rounds, args.num_draft)
            finally:
                engine.close()


if __name__ == "__main__":
    main()
