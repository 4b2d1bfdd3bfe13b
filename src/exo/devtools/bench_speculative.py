"""Speculative decoding by prompt lookup against plain decoding, side by side in one
process, on exo's engines (MLX and llama.cpp):

    python -m exo.devtools.bench_speculative [--engines mlx,llamacpp] [--length 1500]

A copy-heavy workload: the prompt holds a text of `--length` tokens and the answer writes
it back (a scripted model whose greedy answer is that text: the best case, where every
proposal is right, standing in for an edited file written back). Each round runs the
same greedy request without and with speculation; the text must be identical. Prints
decode tok/s (first token to last), the ratio, and the acceptance rate. With
`--draft-layers L`, each engine also drafts with the copy model cut to L layers (the draft a
distilled pair stands for: it agrees with the target, at a fraction of its cost). With
`--concurrency N`, also N streams at once, plain and then half of them speculative:
every text must equal its solo run; prints the aggregate decode tok/s of both."""

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from exo.devtools.local_engine import load_engine, load_llamacpp_engine
from exo.devtools.scripted_models import make_copy_model
from exo.shared.types.common import CommandId, ModelId
from exo.shared.types.text_generation import Speculative, TextGenerationTaskParams


def _params(prompt: list[int], max_tokens: int, speculative: Speculative | None) -> TextGenerationTaskParams:
    return TextGenerationTaskParams(
        model=ModelId("bench"),
        messages=[],
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        speculative=speculative,
    )


def decode_together(engine: Any, requests: dict[str, TextGenerationTaskParams]) -> tuple[dict[str, Any], float]:
    """Every request at once; each one's tokens and usage, and the aggregate decode tok/s:
    the tokens drawn after every request has its first one, over the time from then to the
    end (so the other streams' prefills, the same in both runs, do not dilute the ratio)."""
    for name, params in requests.items():
        engine.submit(CommandId(name), params)
    tokens: dict[str, list[int]] = {name: [] for name in requests}
    usage: dict[str, Any] = {}
    all_started = None
    decoded = 0
    while engine.has_work:
        for chunk in engine.step():
            if all_started is not None:
                decoded += len(chunk.token_ids)
            tokens[chunk.command_id] += chunk.token_ids
            if chunk.usage is not None:
                usage[chunk.command_id] = chunk.usage
        if all_started is None and all(tokens.values()):
            all_started = time.perf_counter()
    assert all_started is not None
    elapsed = time.perf_counter() - all_started
    results = {name: {"tokens": tokens[name], "usage": usage[name]} for name in requests}
    return results, decoded / elapsed


def decode(engine: Any, prompt: list[int], max_tokens: int, speculative: Speculative | None) -> dict[str, Any]:
    results, tps = decode_together(engine, {"bench": _params(prompt, max_tokens, speculative)})
    usage = results["bench"]["usage"]
    return {
        "tokens": results["bench"]["tokens"],
        "tps": tps,
        "proposed": usage.proposed_tokens,
        "accepted": usage.accepted_tokens,
    }


def bench_streams(name: str, engine: Any, prompt: list[int], max_tokens: int, streams: int, num_draft: int) -> None:
    """`streams` requests of different lengths (each its prompt's text cut at its own
    place), plain, then the odd ones speculative."""
    prompts = {f"s{i}": prompt[: len(prompt) - 1 - 7 * i] + prompt[-1:] for i in range(streams)}
    solo = {key: decode(engine, p, max_tokens, None)["tokens"] for key, p in prompts.items()}
    plain, plain_tps = decode_together(engine, {key: _params(p, max_tokens, None) for key, p in prompts.items()})
    mixed_requests = {
        key: _params(p, max_tokens, Speculative(num_draft=num_draft) if i % 2 else None)
        for i, (key, p) in enumerate(prompts.items())
    }
    mixed, mixed_tps = decode_together(engine, mixed_requests)
    for results in (plain, mixed):
        if any(results[key]["tokens"] != solo[key] for key in prompts):
            raise SystemExit(f"{name}: a batched stream's text differs from its solo run")
    kept = sum(result["usage"].accepted_tokens for result in mixed.values())
    proposed = sum(result["usage"].proposed_tokens for result in mixed.values())
    print(
        f"{name} {streams} streams: plain batching {plain_tps:.1f} tok/s, half prompt lookup {mixed_tps:.1f} tok/s "
        f"({mixed_tps / plain_tps:.2f}x), {kept} of {proposed} proposed kept, every text equal to its solo run"
    )


def bench(
    name: str,
    engine: Any,
    prompt: list[int],
    max_tokens: int,
    rounds: int,
    num_draft: int,
    method: Literal["prompt_lookup", "draft"],
) -> float:
    label = method.replace("_", " ")
    plain_tps, fast_tps = [], []
    for round_index in range(rounds):
        plain = decode(engine, prompt, max_tokens, None)
        fast = decode(engine, prompt, max_tokens, Speculative(method=method, num_draft=num_draft))
        if fast["tokens"] != plain["tokens"]:
            raise SystemExit(f"{name}: the speculative text differs from the plain one")
        plain_tps.append(plain["tps"])
        fast_tps.append(fast["tps"])
        rate = fast["accepted"] / max(fast["proposed"], 1)
        print(
            f"{name} round {round_index + 1}: plain {plain['tps']:.1f} tok/s, {label} {fast['tps']:.1f} tok/s "
            f"({fast['tps'] / plain['tps']:.2f}x), {fast['accepted']} of {fast['proposed']} proposed kept "
            f"({rate:.0%}), {len(plain['tokens'])} tokens, identical text"
        )
    ratio = statistics.median(fast_tps) / statistics.median(plain_tps)
    print(
        f"{name} {label}: median {statistics.median(fast_tps):.1f} vs {statistics.median(plain_tps):.1f} tok/s "
        f"= {ratio:.2f}x"
    )
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
    parser.add_argument("--concurrency", type=int, default=0, help="also this many streams at once")
    parser.add_argument(
        "--draft-layers",
        type=int,
        default=0,
        help="each engine also drafts with the copy model at this many layers (its other layers are the identity)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = Path(scratch) / "copy"
        overrides = {"num_hidden_layers": args.layers, "intermediate_size": args.intermediate}
        prompt = make_copy_model(model_dir, args.length, config_overrides=overrides)
        print(f"copy model: {args.length}-token text, {args.layers} layers, MLP {args.intermediate} wide")
        if args.draft_layers:
            draft_overrides = {"num_hidden_layers": args.draft_layers, "intermediate_size": args.intermediate}
            make_copy_model(Path(scratch) / "draft", args.length, config_overrides=draft_overrides)
        loaders = {"mlx": load_engine, "llamacpp": load_llamacpp_engine}
        for name in args.engines.split(","):
            engine = loaders[name](model_dir)
            try:
                bench(name, engine, prompt, args.max_tokens, args.rounds, args.num_draft, "prompt_lookup")
                if args.draft_layers:
                    engine.load_draft(Path(scratch) / "draft", "draft")
                    bench(name, engine, prompt, args.max_tokens, args.rounds, args.num_draft, "draft")
                if args.concurrency:
                    bench_streams(name, engine, prompt, args.max_tokens, args.concurrency, args.num_draft)
            finally:
                engine.close()


if __name__ == "__main__":
    main()
