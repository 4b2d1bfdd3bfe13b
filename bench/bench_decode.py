"""Decode speed through the whole exo stack versus mlx-lm's own generate_step, on the
same model, prompt and machine, in one run.

    .venv/bin/python bench/bench_decode.py                 # a random 8-layer model
    .venv/bin/python bench/bench_decode.py --model-dir DIR --model-id org/name

The API side is measured by the client (first to last streamed token), so it includes
the runner subprocess, the master, the chunk topic, FastAPI and SSE. The two sides run
one after the other, never at once, alternating over several rounds (direct, API, direct,
...), and the ratio is of the medians: a small shared machine drifts by 10-20% from one
run to the next, and a single pair would mostly measure that drift.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load

from exo.devtools.tiny_models import make_tiny_llama
from exo.engine.mlx.chat_template import encode_prompt
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for tests.support
from tests.support.node import start_node, stop_node  # noqa: E402

PROMPT = "Write a long story about a cluster of computers."


def direct_decode_tps(model, tokenizer, tokens: int) -> float:
    params = TextGenerationTaskParams(model="bench", messages=[ChatMessage(role="user", content=PROMPT)])
    prompt = mx.array(encode_prompt(tokenizer, params)[0])
    stream = generate_step(prompt, model, max_tokens=tokens, sampler=make_sampler(temp=0.0))
    token, _ = next(stream)
    if int(token) in tokenizer.eos_token_ids:
        raise SystemExit("the model ended its answer at once; nothing to time")
    start = time.perf_counter()
    count = 0
    for token, _ in stream:
        count += 1
        # Stop where the API stops too, so both sides decode the same greedy tokens.
        if int(token) in tokenizer.eos_token_ids:
            break
    return count / (time.perf_counter() - start)


def streamed_decode_tps(url: str, model_id: str, tokens: int) -> tuple[float, int]:
    """Decode tokens/s as a client sees it: streamed tokens over the time between the
    first and the last, with the token count from usage."""
    body = {
        "model": model_id,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    times: list[float] = []
    generated = 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content") is not None:
                times.append(time.perf_counter())
            if chunk.get("usage"):
                generated = chunk["usage"]["completion_tokens"]
    return (generated - 1) / (times[-1] - times[0]), generated


def bench_model(scratch: Path) -> tuple[Path, str]:
    """A random float32 Llama big enough that compute, not overhead, sets the pace."""
    model_dir = make_tiny_llama(
        scratch / "bench--random-llama",
        hidden_size=1024,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        intermediate_size=2816,
        vocab_size=4096,
    )
    return model_dir, "bench/random-llama"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, help="HF-layout model dir named org--name")
    parser.add_argument("--model-id", help="model id of --model-dir, e.g. org/name")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3, help="API runs, each between two direct runs")
    args = parser.parse_args()
    direct: list[float] = []
    through_api: list[float] = []
    with tempfile.TemporaryDirectory() as scratch:
        if args.model_dir is None:
            model_dir, model_id = bench_model(Path(scratch))
        else:
            model_dir, model_id = args.model_dir, args.model_id
        model, tokenizer = load(str(model_dir))
        node = start_node(Path(scratch) / "exo_home", {"EXO_MODELS_DIRS": str(model_dir.parent)})
        try:
            node.place(model_id, timeout=600)
            direct.append(direct_decode_tps(model, tokenizer, args.tokens))
            for _ in range(args.rounds):
                tps, generated = streamed_decode_tps(node.url, model_id, args.tokens)
                through_api.append(tps)
                direct.append(direct_decode_tps(model, tokenizer, args.tokens))
        finally:
            stop_node(node)
    print(f"model: {model_id} ({model_dir.name}), {generated} tokens, cpu count {os.cpu_count()}")
    print(
        f"mlx-lm generate_step: {', '.join(f'{t:.1f}' for t in direct)} tok/s (median {statistics.median(direct):.1f})"
    )
    print(
        f"exo API (streamed):   {', '.join(f'{t:.1f}' for t in through_api)} tok/s "
        f"(median {statistics.median(through_api):.1f})"
    )
    print(f"ratio API / direct:   {statistics.median(through_api) / statistics.median(direct):.3f} (of the medians)")


if __name__ == "__main__":
    main()
