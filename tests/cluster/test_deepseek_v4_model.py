"""DeepSeek V4 in our MLX module computes what transformers' reference computes.

A tiny random DeepSeek V4 (`TINY_CONFIGS["deepseek_v4"]`: 4 streams of hyper-connections,
sliding-window, CSA and HCA layers, hash-routed and learned-router MoE) is built and
saved by transformers in float32, loaded through mlx-lm with our module, and must give
the reference's logits within 1e-3 over a 64-token prompt and 32 greedy decode steps
through our cache, also with the prompt prefilled in 2 or 3 chunks. Split over 2
processes (MLX ring on 127.0.0.1), tensor and pipeline, it must give the single
process's logits within 1e-4."""

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import exo.engine.mlx.models  # noqa: F401  (makes mlx_lm.models.deepseek_v4 ours)
from exo.devtools.onboard import engine_run, load_engine_model, reference_run, write_reference_model
from exo.devtools.tiny_configs import TINY_CONFIGS
from exo.devtools.tiny_models import make_tiny
from exo.engine.mlx.models.deepseek_v4 import _FP4_VALUES, DeepseekV4Cache, Model, dequantize_fp4, dequantize_fp8

PROMPT_LEN = 64
DECODE_STEPS = 32
TOLERANCE = 1e-3
PARALLEL_TOLERANCE = 1e-4


@dataclass
class Reference:
    path: Path
    prompt: list[int]
    prompt_logits: np.ndarray
    step_logits: np.ndarray
    tokens: list[int]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    path = tmp_path_factory.mktemp("deepseek_v4")
    model = write_reference_model(path, TINY_CONFIGS["deepseek_v4"])
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, model.config.vocab_size, PROMPT_LEN)]
    prompt_logits, step_logits, tokens = reference_run(model, prompt, DECODE_STEPS)
    return Reference(path, prompt, prompt_logits, step_logits, tokens)


@pytest.fixture(scope="module")
def model(reference: Reference) -> Model:
    return load_engine_model(reference.path)


def test_tiny_config_has_every_deepseek_v4_feature(model: Model) -> None:
    args = model.args
    assert args.hc_mult > 1
    assert set(args.compress_ratios) == {0, 4, 16}  # sliding only, CSA (with indexer), HCA
    assert {"hash_moe", "moe"} == set(args.mlp_layer_types)
    assert args.index_topk < PROMPT_LEN // 4  # the indexer really drops entries
    assert args.sliding_window < PROMPT_LEN
    assert all(
        hasattr(layer.attn, "indexer") == (ratio == 4)
        for layer, ratio in zip(model.layers, args.compress_ratios, strict=True)
    )


def test_prompt_logits_match_transformers(model: Model, reference: Reference) -> None:
    prompt_logits, _ = engine_run(model, reference.prompt, [])
    diff = float(np.abs(prompt_logits - reference.prompt_logits).max())
    print(f"prompt: max |logit diff| {diff:.2e}")
    assert diff <= TOLERANCE


@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_decode_through_cache_matches_transformers(model: Model, reference: Reference, chunks: int) -> None:
    prompt_logits, step_logits = engine_run(model, reference.prompt, reference.tokens, chunks)
    prompt_diff = float(np.abs(prompt_logits - reference.prompt_logits).max())
    decode_diff = float(np.abs(step_logits - reference.step_logits).max())
    print(f"prefill in {chunks} chunk(s): max |logit diff| prompt {prompt_diff:.2e}, decode {decode_diff:.2e}")
    assert prompt_diff <= TOLERANCE and decode_diff <= TOLERANCE
    greedy = [int(row.argmax()) for row in [prompt_logits[-1], *step_logits[:-1]]]
    assert greedy == reference.tokens


def _decode(model: Model, cache: list[DeepseekV4Cache], tokens: list[int]) -> np.ndarray:
    return np.stack([np.array(model(mx.array([[t]]), cache=cache)[0, -1]) for t in tokens])


def test_restored_snapshot_continues_like_the_original(model: Model, reference: Reference) -> None:
    cache = model.make_cache()
    model(mx.array(reference.prompt[:41])[None], cache=cache)
    snapshot = [c.snapshot() for c in cache]
    first = _decode(model, cache, reference.tokens[:12])
    for c, snap in zip(cache, snapshot, strict=True):
        c.restore(snap)
    again = _decode(model, cache, reference.tokens[:12])
    copied = _decode(model, [snap.copy() for snap in snapshot], reference.tokens[:12])
    assert np.array_equal(first, again) and np.array_equal(first, copied)


def test_cache_state_round_trips(model: Model, reference: Reference) -> None:
    cache = model.make_cache()
    model(mx.array(reference.prompt[:37])[None], cache=cache)
    rebuilt = []
    for c in cache:
        fresh = DeepseekV4Cache(0)
        fresh.state, fresh.meta_state = c.state, c.meta_state
        rebuilt.append(fresh)
    assert np.array_equal(_decode(model, cache, reference.tokens[:4]), _decode(model, rebuilt, reference.tokens[:4]))


def test_mlx_community_layout_loads_unchanged(model: Model, reference: Reference, tmp_path: Path) -> None:
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp_path / "config.json").write_text((reference.path / "config.json").read_text())
    reloaded = load_engine_model(tmp_path)
    prompt = mx.array(reference.prompt[:24])[None]
    assert np.array_equal(np.array(model(prompt)), np.array(reloaded(prompt)))


def test_quantized_grouped_output_projection_matches_dequantized(model: Model) -> None:
    attn = model.layers[1].attn
    out = mx.random.normal((1, 5, attn.n_heads * attn.head_dim), key=mx.random.key(0))
    quantized = nn.QuantizedLinear.from_linear(attn.wo_a, group_size=32, bits=8)
    dense = nn.Linear(1, 1, bias=False)
    dense.weight = mx.dequantize(quantized.weight, quantized.scales, quantized.biases, group_size=32, bits=8)
    expected = _with_wo_a(attn, dense, out)
    assert float(mx.abs(_with_wo_a(attn, quantized, out) - expected).max()) <= 1e-4


def _with_wo_a(attn, wo_a: nn.Module, out: mx.array) -> mx.array:
    original, attn.wo_a = attn.wo_a, wo_a
    try:
        return attn.grouped_output(out)
    finally:
        attn.wo_a = original


def test_deepseek_fp8_and_fp4_weights_dequantize() -> None:
    """DeepSeek's checkpoints: FP8 with a UE8M0 scale per 128 x 128 tile, and routed
    experts as FP4 pairs in bytes with a scale per 32 inputs."""
    weight = mx.random.normal((200, 300), key=mx.random.key(1))
    exponents = mx.random.randint(120, 130, (2, 3), key=mx.random.key(2)).astype(mx.uint8)
    tile_scales = mx.repeat(mx.repeat(mx.power(2.0, exponents.astype(mx.float32) - 127), 128, 0), 128, 1)
    fp8 = mx.to_fp8(weight / tile_scales[:200, :300])
    expected = mx.from_fp8(fp8, dtype=mx.float32) * tile_scales[:200, :300]
    assert float(mx.abs(dequantize_fp8(fp8, exponents).astype(mx.float32) - expected).max()) == 0.0

    codes = np.random.default_rng(0).integers(0, 16, (4, 64))
    packed = mx.array((codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)).view(mx.int8)
    scales = mx.array(np.full((4, 2), 128, np.uint8))  # 2 ** 1 for each block of 32
    values = np.array(dequantize_fp4(packed, scales).astype(mx.float32))
    assert np.array_equal(values, np.array(_FP4_VALUES, dtype=np.float32)[codes] * 2)


# 1 vs 2 processes. Each rank registers our model module before parallel_check loads.
RANK_LAUNCHER = (
    "import runpy, sys; sys.modules['torch'] = None; import exo.engine.mlx.models; "
    "runpy.run_module('exo.devtools.parallel_check', run_name='__main__', alter_sys=True)"
)
PARALLEL_PROMPT = [(i * 37 + 11) % 320 for i in range(48)]
PARALLEL_DECODE_STEPS = 8


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def _run(model_dir: Path, out_dir: Path, sharding: str, world_size: int) -> list[dict[str, np.ndarray]]:
    hosts = ",".join(f"127.0.0.1:{port}" for port in _free_ports(world_size))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    procs = []
    for rank in range(world_size):
        cmd = [
            sys.executable, "-c", RANK_LAUNCHER, str(model_dir), str(out_dir / f"{sharding}{rank}.npz"),
            "--sharding", sharding, "--world-size", str(world_size), "--rank", str(rank), "--hosts", hosts,
            "--prompt", json.dumps(PARALLEL_PROMPT), "--decode-steps", str(PARALLEL_DECODE_STEPS),
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env))
    try:
        outputs = [proc.communicate(timeout=180)[0].decode(errors="replace") for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} failed:\n{outputs[rank][-3000:]}"
    return [dict(np.load(out_dir / f"{sharding}{rank}.npz")) for rank in range(world_size)]


@pytest.fixture(scope="module")
def mlx_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("deepseek_v4_mlx"), "deepseek_v4")


@pytest.mark.parametrize("sharding", ["tensor", "pipeline"])
def test_two_processes_match_one(mlx_tiny: Path, tmp_path: Path, sharding: str) -> None:
    (single,) = _run(mlx_tiny, tmp_path, "pipeline", 1)
    ranks = _run(mlx_tiny, tmp_path, sharding, 2)
    diffs = [float(np.abs(rank["logits"] - single["logits"]).max()) for rank in ranks]
    print(f"{sharding} x2: max |logit diff| per rank {[f'{d:.2e}' for d in diffs]}")
    assert max(diffs) <= PARALLEL_TOLERANCE
    assert all(rank["tokens"].tolist() == single["tokens"].tolist() for rank in ranks)
