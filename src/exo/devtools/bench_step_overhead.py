"""exo's MLX engine against mlx-lm's own BatchGenerator, in this process, side by side,
on a model so small that compute is negligible: what remains is each side's per-step
overhead (scheduling, batching, detokenizing, Python).

    python -m exo.devtools.bench_step_overhead [--hidden 64 --layers 2 --streams 8]
        [--prompt 128 --decode 128 --rounds 5] [--profile]

A random llama (make_tiny_llama) loaded twice: as exo's MlxEngine (one rank, every layer,
as tests/support/engine.py loads it) and with mlx_lm.load for a BatchGenerator (batch
sizes = --streams). Both get the same prompts (random non-special token ids, fixed seed,
different per stream), greedy, exactly --decode tokens each: EOS banned by a logit bias
of -100 on both (exo's request logit_bias; mlx-lm's make_logits_processors, as RawTarget
does), and mlx-lm has no stop tokens. Each round runs exo and raw back to back (which goes
first alternates, so both see the machine's other load alike) and measures: the mean time
to first token of --streams prompts of --prompt tokens arriving together; that round's
aggregate decode tokens/s from when every stream has its first token to the last token;
one stream's decode tokens/s; and the median time of a decode step of each (what a busy
machine's stalls move least). Every round is cold: exo's prefix cache cleared, a fresh
BatchGenerator (made outside the clock).

Prints the median and best per side and exo/raw ratios (of the medians; "paired", the
median of each round's own ratio; of the bests), targets: aggregate decode >= 0.9, TTFT
<= 1.3; then one JSON line with every number. --profile runs one more exo round under
cProfile and lists exo's engine functions by time per step. Nothing is asserted."""

import argparse
import cProfile
import json
import pstats
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_lm import load
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from exo.devtools.local_engine import load_engine
from exo.devtools.tiny_models import SPECIAL_TOKENS, make_tiny_llama
from exo.engine.mlx.engine import MlxEngine
from exo.shared.types.common import CommandId, ModelId
from exo.shared.types.text_generation import TextGenerationTaskParams


@dataclass
class Stream:
    """One request's timeline: when it was sent, and when each token came out."""

    sent_at: float
    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


def summarize(streams: list[Stream]) -> dict[str, float]:
    """Mean TTFT; decode tokens/s over all streams once every one has its first token; and
    the median time between two decode steps then (a step hands every stream its token at
    once), which a busy machine's stalls move less than the mean."""
    ttft = statistics.mean(s.times[0] - s.sent_at for s in streams)
    start = max(s.times[0] for s in streams)
    steps = sorted({t for s in streams for t in s.times if t > start})
    decoded = sum(1 for s in streams for t in s.times if t > start)
    gaps = [b - a for a, b in zip([start, *steps], steps, strict=False)]
    return {
        "ttft_s": ttft,
        "decode_tps": decoded / (steps[-1] - start) if steps else 0.0,
        "step_s": statistics.median(gaps) if gaps else 0.0,
    }


def clear_prefix_cache(engine: MlxEngine) -> None:
    assert engine.scheduler is not None
    engine.scheduler.prefix_cache.clear()


class ExoSide:
    name = "exo"

    def __init__(self, model_dir: Path, banned: list[int]) -> None:
        self.engine = load_engine(model_dir)
        self.bias = {token: -100.0 for token in banned}
        self.count = 0

    def round(self, prompts: list[list[int]], max_tokens: int) -> list[Stream]:
        clear_prefix_cache(self.engine)
        engine, ids = self.engine, []
        sent_at = time.perf_counter()
        for prompt in prompts:
            self.count += 1
            ids.append(CommandId(f"bench-{self.count}"))
            params = TextGenerationTaskParams(
                model=ModelId("bench"),
                messages=[],
                prompt=prompt,  # token ids, fed as they are
                max_tokens=max_tokens,
                temperature=0.0,
                logit_bias=self.bias,
            )
            engine.submit(ids[-1], params)
        streams = {request_id: Stream(sent_at) for request_id in ids}
        while engine.has_work:
            chunks = engine.step()
            now = time.perf_counter()
            for chunk in chunks:
                if chunk.token_ids:
                    streams[chunk.command_id].times.append(now)
                    streams[chunk.command_id].tokens.extend(chunk.token_ids)
        return [streams[request_id] for request_id in ids]


class RawSide:
    name = "raw"

    def __init__(self, model: Any, banned: list[int]) -> None:
        self.model = model
        self.processors = make_logits_processors(logit_bias={token: -100.0 for token in banned})

    def round(self, prompts: list[list[int]], max_tokens: int) -> list[Stream]:
        generator = BatchGenerator(
            self.model,
            max_tokens=max_tokens,
            sampler=make_sampler(temp=0.0),
            logits_processors=self.processors,
            completion_batch_size=len(prompts),
            prefill_batch_size=len(prompts),
        )
        sent_at = time.perf_counter()
        uids = generator.insert(prompts, [max_tokens] * len(prompts))
        streams = {uid: Stream(sent_at) for uid in uids}
        done: set[int] = set()
        while len(done) < len(uids):
            responses = generator.next_generated()
            now = time.perf_counter()
            for response in responses:
                streams[response.uid].times.append(now)
                streams[response.uid].tokens.append(int(response.token))
                if response.finish_reason is not None:
                    done.add(response.uid)
        generator.close()
        return [streams[uid] for uid in uids]


def measure(side: Any, many: list[list[int]], one: list[int], decode: int) -> dict[str, Any]:
    together = side.round(many, decode)
    alone = side.round([one], decode)
    counts = sorted({len(s.tokens) for s in together + alone})
    if counts != [decode]:
        print(f"  warning: {side.name} generated {counts} tokens per stream, not {decode}")
    summary, single = summarize(together), summarize(alone)
    return {
        "ttft_s": summary["ttft_s"],
        "aggregate_tps": summary["decode_tps"],
        "step_s": summary["step_s"],
        "single_tps": single["decode_tps"],
        "single_step_s": single["step_s"],
        "tokens": [s.tokens for s in together + alone],
    }


def profile_exo(exo: ExoSide, many: list[list[int]], decode: int, top: int = 12) -> None:
    """One more 8-stream exo round under cProfile: exo's engine functions by cumulative time."""
    profiler = cProfile.Profile()
    profiler.enable()
    exo.round(many, decode)
    profiler.disable()
    # (file, line, function) -> (primitive calls, calls, own time, cumulative time, callers)
    entries: dict[tuple[str, int, str], tuple[Any, ...]] = pstats.Stats(profiler).__dict__["stats"]
    steps = next((v[1] for k, v in entries.items() if k[2] == "step" and "mlx/engine.py" in k[0]), 1)
    rows = [
        (v[3], v[2], v[1], f"{Path(k[0]).parent.name}/{Path(k[0]).name}:{k[1]}({k[2]})")
        for k, v in entries.items()
        if "exo/engine" in k[0] or "mlx_lm/generate.py" in k[0]
    ]
    print(f"\nexo round under cProfile: {steps} steps; exo's engine and mlx_lm/generate.py by cumulative time")
    print(f"  {'cum ms/step':>11} {'own ms/step':>11} {'calls':>6}  function")
    for cumulative, own, calls, name in sorted(rows, reverse=True)[:top]:
        print(f"  {1000 * cumulative / steps:11.3f} {1000 * own / steps:11.3f} {calls:6d}  {name}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per stream")
    parser.add_argument("--decode", type=int, default=128, help="tokens generated per stream")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="profile one more exo round")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-step-") as scratch:
        model_dir = Path(scratch) / "tiny-llama"
        make_tiny_llama(model_dir, hidden_size=args.hidden, num_hidden_layers=args.layers)
        config = json.loads((model_dir / "config.json").read_text())
        model, tokenizer = load(str(model_dir))[:2]
        banned = sorted(tokenizer.eos_token_ids)
        rng = random.Random(0)
        ids = range(len(SPECIAL_TOKENS), config["vocab_size"])
        many = [[rng.choice(ids) for _ in range(args.prompt)] for _ in range(args.streams)]
        one = [rng.choice(ids) for _ in range(args.prompt)]
        sides = [ExoSide(model_dir, banned), RawSide(model, banned)]
        for side in sides:  # one round each, not measured: kernels and buffers warm
            measure(side, many, one, args.decode)
        results: dict[str, list[dict[str, Any]]] = {side.name: [] for side in sides}
        for index in range(args.rounds):
            # Alternated, and which side goes first alternates too: both see the same load.
            for side in sides if index % 2 == 0 else sides[::-1]:
                results[side.name].append(measure(side, many, one, args.decode))
            exo, raw = results["exo"][-1], results["raw"][-1]
            print(
                f"round {index + 1}: {args.streams}-stream decode exo {exo['aggregate_tps']:.0f} raw "
                f"{raw['aggregate_tps']:.0f} tok/s, TTFT exo {1000 * exo['ttft_s']:.1f} raw "
                f"{1000 * raw['ttft_s']:.1f} ms, 1-stream exo {exo['single_tps']:.0f} raw {raw['single_tps']:.0f} tok/s"
            )
        same = all(e["tokens"] == r["tokens"] for e, r in zip(results["exo"], results["raw"], strict=True))
        if args.profile:
            profile_exo(sides[0], many, args.decode)

    rows = [
        ("aggregate_tps", f"{args.streams}-stream aggregate decode (tok/s)", max, ">= 0.9"),
        ("ttft_s", f"mean TTFT, {args.streams} x {args.prompt} tokens at once (ms)", min, "<= 1.3"),
        ("step_s", f"{args.streams}-stream decode step, median (ms)", min, ""),
        ("single_tps", "1-stream decode (tok/s)", max, ""),
        ("single_step_s", "1-stream decode step, median (ms)", min, ""),
    ]
    print(f"\nhidden {args.hidden}, {args.layers} layers, {args.decode} tokens per stream, {args.rounds} rounds")
    columns = ["exo med", "raw med", "ratio", "paired", "exo best", "raw best", "ratio"]
    print(f"{'':50} " + " ".join(f"{c:>8}" for c in columns))
    report: dict[str, Any] = {"args": vars(args), "same_tokens": same}
    for key, label, best_of, target in rows:
        scale = 1000 if key.endswith("_s") else 1
        values = {name: [scale * r[key] for r in results[name]] for name in results}
        median = {name: statistics.median(v) for name, v in values.items()}
        best = {name: best_of(v) for name, v in values.items()}
        ratio_median, ratio_best = median["exo"] / median["raw"], best["exo"] / best["raw"]
        # exo/raw within each round (the two ran back to back), the median over rounds.
        paired = statistics.median(e / r for e, r in zip(values["exo"], values["raw"], strict=True))
        numbers = [median["exo"], median["raw"], ratio_median, paired, best["exo"], best["raw"], ratio_best]
        print(f"{label:50} " + " ".join(f"{n:8.2f}" for n in numbers) + (f"  target {target}" if target else ""))
        report[key] = {**values, "ratio_median": ratio_median, "ratio_paired": paired, "ratio_best": ratio_best}
    print(f"greedy tokens identical on both sides: {same}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
