"""Aggregate decode speed of 1 and of N concurrent greedy streams through a real node, side
by side in one run (continuous batching should make N streams cost little more than 1).

    python -m exo.devtools.bench_batching [--streams 8] [--tokens 64] [--hidden 256 --layers 4] [--rounds 3]

Makes a random llama with exo.devtools.tiny_models (width and depth as given), starts an
`exo` node on free ports with its own EXO_HOME, places the model, then runs the streams
over Chat Completions with EOS banned (logit_bias -100), so each stream decodes exactly
--tokens tokens. A stream's decode rate counts its tokens after the first over the time
from its first token to its last; the aggregate is all streams' such tokens over the time
from the first stream's first token to the last stream's last.

Beside it, the raw forward of the same weights in this process (mlx-lm, no exo) at batch
1 and N gives the ceiling batching can reach on this machine: N x t(1) / t(N)."""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from exo.devtools.tiny_models import make_tiny_llama

MODEL_ID = "bench/tiny-llama"
PROMPT_WORDS = "the cat runs over the quiet moon and the node sleeps "


@dataclass
class Stream:
    tokens: int = 0
    sent_at: float = 0.0
    first_at: float = 0.0
    last_at: float = 0.0


def _free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_node(home: Path, models_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    args = [sys.executable, "-m", "exo.main", "--api-port", str(port), "--api-host", "127.0.0.1"]
    args += ["--namespace", f"bench-{uuid.uuid4().hex[:8]}", "--no-multicast"]
    args += ["--discovery-port", str(_free_port(socket.SOCK_DGRAM))]
    env = {**os.environ, "EXO_HOME": str(home), "EXO_MODELS_DIRS": str(models_dir)}
    log = (home / "node.log").open("wb")
    process = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"exo exited; see {home / 'node.log'}")
        try:
            if httpx.get(url + "/node_id", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("exo did not start")


def _place(url: str) -> None:
    node_id = httpx.get(url + "/node_id").json()
    while node_id not in httpx.get(url + "/state").json()["nodes"]:
        time.sleep(0.1)
    response = httpx.post(url + "/place_instance", json={"model_id": MODEL_ID}, timeout=30)
    response.raise_for_status()
    instance_id = response.json()["instance_id"]
    params = {"instance_id": instance_id}
    with httpx.stream("GET", url + "/instance/await", params=params, timeout=600) as events:
        last = [line for line in events.iter_lines() if line.startswith("event:")][-1]
    if last != "event: ready":
        raise RuntimeError(f"instance not ready: {last}")


def _run_stream(url: str, index: int, tokens: int, eos: int, stream: Stream) -> None:
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": f"{index} " + PROMPT_WORDS * 2}],
        "max_tokens": tokens,
        "temperature": 0.0,
        "stream": True,
        "logit_bias": {str(eos): -100},
        "stream_options": {"include_usage": True},
    }
    stream.sent_at = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            usage = chunk.get("usage")
            if usage:
                stream.tokens = usage["completion_tokens"]
            if chunk.get("choices"):
                now = time.perf_counter()
                stream.first_at = stream.first_at or now
                stream.last_at = now


def _round(url: str, count: int, tokens: int, eos: int) -> dict[str, float]:
    streams = [Stream() for _ in range(count)]
    threads = [
        threading.Thread(target=_run_stream, args=(url, i, tokens, eos, stream)) for i, stream in enumerate(streams)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    decoded = sum(stream.tokens - 1 for stream in streams)
    window = max(s.last_at for s in streams) - min(s.first_at for s in streams)
    per_stream = [(s.tokens - 1) / max(s.last_at - s.first_at, 1e-9) for s in streams]
    return {
        "streams": count,
        "tokens": sum(s.tokens for s in streams),
        "aggregate_tps": decoded / max(window, 1e-9),
        "mean_stream_tps": sum(per_stream) / count,
        "max_ttft_s": max(s.first_at - s.sent_at for s in streams),
    }


def _raw_step_seconds(model_dir: Path, batch: int, steps: int = 20) -> float:
    """One decode forward of `batch` rows, after a 64-token context, averaged."""
    model = load(str(model_dir))[0]
    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((batch, 64), dtype=mx.int32), cache=cache))
    token = mx.zeros((batch, 1), dtype=mx.int32)
    mx.eval(model(token, cache=cache))
    start = time.perf_counter()
    for _ in range(steps):
        mx.eval(model(token, cache=cache))
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description="Aggregate decode tok/s of 1 vs N concurrent greedy streams.")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="exo-bench-") as tmp:
        root = Path(tmp)
        model_dir = make_tiny_llama(
            root / "models" / MODEL_ID.replace("/", "--"),
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=args.hidden * 3,
        )
        eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
        size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        (root / "home").mkdir()
        process, url = _start_node(root / "home", root / "models")
        try:
            _place(url)
            _round(url, 1, 8, eos)  # warm the API path
            ones, manys = [], []
            # Alternated, best of each: other load on the machine comes and goes.
            for _ in range(args.rounds):
                ones.append(_round(url, 1, args.tokens, eos))
                manys.append(_round(url, args.streams, args.tokens, eos))
            one = max(ones, key=lambda row: row["aggregate_tps"])
            many = max(manys, key=lambda row: row["aggregate_tps"])
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)
        raw_one, raw_many = _raw_step_seconds(model_dir, 1), _raw_step_seconds(model_dir, args.streams)
    print(f"model: llama hidden={args.hidden} layers={args.layers} ({size / 1e6:.0f} MB float32), one node")
    print(f"best of {args.rounds} alternated rounds each")
    print(f"{'streams':>8} {'tokens':>7} {'aggregate tok/s':>16} {'per stream tok/s':>17} {'max TTFT s':>11}")
    for row in (one, many):
        print(
            f"{row['streams']:>8} {row['tokens']:>7} {row['aggregate_tps']:>16.1f}"
            f" {row['mean_stream_tps']:>17.1f} {row['max_ttft_s']:>11.2f}"
        )
    print(f"ratio {args.streams} vs 1 streams (aggregate decode): {many['aggregate_tps'] / one['aggregate_tps']:.2f}x")
    print(
        f"raw mlx-lm forward: {raw_one * 1e3:.1f} ms at batch 1, {raw_many * 1e3:.1f} ms at batch {args.streams};"
        f" ceiling {args.streams * raw_one / raw_many:.2f}x on {mx.default_device()}"
    )


if __name__ == "__main__":
    main()
