"""Distributed inference gives the single-process answer.

A tiny random float32 model runs in one process and then split over 2 (and 4) processes
joined by the MLX ring backend on 127.0.0.1, with pipeline and with tensor sharding,
through `exo.devtools.parallel_check` (the engine's real loading and sharding code).
Every rank's logits for a 32-token prompt and 16 greedy decode steps must match the
single process within 1e-4, and every rank must emit the same tokens.

2-way splits of every family are served by real nodes and compared with transformers in
test_served_numerics.py; here 2-way cases run only with EXO_PARALLEL_FULL=1. Tensor cases exist for architectures with a
strategy (exo's or mlx-lm's). 4-way cases run by default for llama and deepseek_v3 (MoE +
MLA), both ways, for gpt_oss pipeline (4-way puts a rank boundary after an odd layer,
which 2-way over 4 layers does not) and for gemma4 pipeline; EXO_PARALLEL_FULL=1 runs
every case."""

import os
import re
from pathlib import Path

import numpy as np
import pytest

from exo.devtools.tiny_configs import TINY_CONFIGS
from exo.devtools.tiny_models import make_tiny
from exo.shared.models.families import has_tensor_strategy
from tests.support.ranks import run_ranks

PROMPT = [(i * 37 + 11) % 320 for i in range(32)]  # every tiny vocab has >= 384 tokens
DECODE_STEPS = 16
DECODE = ["--decode-steps", str(DECODE_STEPS)]
TOLERANCE = 1e-4

ARCHITECTURES = list(TINY_CONFIGS)
FULL = os.environ.get("EXO_PARALLEL_FULL", "") not in ("", "0")
FOUR_WAY_DEFAULT = {
    ("llama", "pipeline"),
    ("llama", "tensor"),
    ("deepseek_v3", "pipeline"),
    ("deepseek_v3", "tensor"),
    ("gpt_oss", "pipeline"),
    # Equal shares would cut between the KV-shared layers and their sources; the split
    # keeps them on the last rank (placement's pipeline_tail_start).
    ("gemma4", "pipeline"),
}


def _n_layers(config: dict) -> int:
    return config.get("num_hidden_layers") or config["text_config"]["num_hidden_layers"]


def _has_tensor_strategy(config: dict) -> bool:
    return has_tensor_strategy(config["model_type"])


def _cases() -> list:
    cases = []
    for arch in ARCHITECTURES:
        for world_size in (2, 4):
            for sharding in ("pipeline", "tensor"):
                if world_size == 4 and not (FULL or (arch, sharding) in FOUR_WAY_DEFAULT):
                    continue
                if world_size == 2 and not FULL:
                    continue
                if sharding == "pipeline" and _n_layers(TINY_CONFIGS[arch]) < world_size:
                    continue
                if sharding == "tensor" and not _has_tensor_strategy(TINY_CONFIGS[arch]):
                    continue
                cases.append(pytest.param(arch, sharding, world_size, id=f"{arch}-{sharding}-{world_size}"))
    return cases


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny models, built on first use; one per architecture for the whole module."""
    root = tmp_path_factory.mktemp("tiny-models")

    class Built(dict):
        def __missing__(self, arch: str) -> Path:
            self[arch] = make_tiny(root / arch, arch)
            return self[arch]

    return Built()


@pytest.fixture(scope="module")
def references(model_dirs: dict[str, Path]) -> dict[str, dict[str, np.ndarray]]:
    """Single-process logits and tokens per architecture: parallel_check's own run_rank
    with world size 1, in this process."""
    from exo.devtools.parallel_check import build_instance, run_rank
    from exo.shared.types.instances import Sharding

    class Computed(dict):
        def __missing__(self, arch: str) -> dict[str, np.ndarray]:
            model_dir = model_dirs[arch]
            instance = build_instance(model_dir, Sharding.Pipeline, 1, [])
            self[arch] = run_rank(model_dir, instance, 0, PROMPT, DECODE_STEPS)
            return self[arch]

    return Computed()


@pytest.mark.parametrize(("arch", "sharding", "world_size"), _cases())
def test_split_model_matches_single_process(
    arch: str,
    sharding: str,
    world_size: int,
    model_dirs: dict[str, Path],
    references: dict[str, dict[str, np.ndarray]],
    tmp_path: Path,
) -> None:
    reference = references[arch]
    assert reference["logits"].shape[0] == DECODE_STEPS + 1 and np.isfinite(reference["logits"]).all()

    ranks = run_ranks(model_dirs[arch], tmp_path, sharding, world_size, PROMPT, DECODE)

    diffs = [float(np.abs(result["logits"] - reference["logits"]).max()) for result in ranks]
    print(f"{arch} {sharding} x{world_size}: max |logit diff| per rank {[f'{d:.2e}' for d in diffs]}")
    for rank, result in enumerate(ranks):
        assert result["tokens"].tolist() == ranks[0]["tokens"].tolist(), f"rank {rank} emitted other tokens than rank 0"
    assert max(diffs) <= TOLERANCE, f"max |logit diff| per rank: {diffs}"
    assert ranks[0]["tokens"].tolist() == reference["tokens"].tolist()
    if sharding == "pipeline":
        config = TINY_CONFIGS[arch]
        every_rank_embeds = bool(config.get("text_config", config).get("hidden_size_per_layer_input"))
        assert_each_rank_holds_only_its_ends(reference, ranks, every_rank_embeds)


def _ends(result: dict[str, np.ndarray]) -> set[str]:
    """Which of the embeddings, the final norm and the head a run holds."""
    kinds = set()
    for name in result["ends"].tolist():
        if re.search(r"(^|\.)embed_tokens\.", name):
            kinds.add("embeddings")
        if re.match(r"(language_model\.)?lm_head\.", name):
            kinds.add("head")
        if re.fullmatch(r"(model\.|language_model\.model\.)?norm\.weight", name):
            kinds.add("norm")
    return kinds


def assert_each_rank_holds_only_its_ends(
    reference: dict[str, np.ndarray], ranks: list[dict[str, np.ndarray]], every_rank_embeds: bool
) -> None:
    """Rank 0 alone holds the embeddings (the last rank too where the head is them, every
    rank where each layer takes an input from them), the last rank alone the final norm
    and the head (issue 33 point 3: so a rank fetches only those files)."""
    whole = _ends(reference)
    tied = "head" not in whole
    last = len(ranks) - 1
    for rank, result in enumerate(ranks):
        expected = set()
        if rank == 0 or every_rank_embeds or (tied and rank == last):
            expected.add("embeddings")
        if rank == last:
            expected |= {"head", "norm"}
        assert _ends(result) == expected & whole, (rank, sorted(result["ends"].tolist()))


def test_gemma4_split_between_kv_shared_layer_and_its_source_is_refused(model_dirs: dict[str, Path]):
    from mlx_lm.utils import load_model

    from exo.engine.mlx.sharding.gemma4 import fix_pipeline

    model, _ = load_model(model_dirs["gemma4"], lazy=True)
    # Layers 6 and 7 read the keys and values of layers 4 and 5.
    with pytest.raises(ValueError, match="another rank holds"):
        fix_pipeline(model, 6, 8)
    fix_pipeline(model, 4, 8)
    assert model.language_model.model.previous_kvs == [0, 1, 0, 1]


def _with_float32_norms(model_dir: Path) -> Path:
    """The checkpoint in bfloat16 but its norms, kept in float32 as some published
    checkpoints keep them: a rank's hidden state leaves its first block in float32
    (bfloat16 weights promote), while the next rank's own embedding, the shape it used
    to receive into, is bfloat16."""
    import mlx.core as mx

    for file in model_dir.glob("*.safetensors"):
        weights = mx.load(str(file))
        mixed = {name: w if "norm" in name else w.astype(mx.bfloat16) for name, w in weights.items()}
        mx.save_safetensors(str(file), mixed, metadata={"format": "mlx"})
    return model_dir


def test_pipeline_ranks_agree_on_the_hidden_states_dtype(tmp_path: Path) -> None:
    """Before the ranks agreed on one wire dtype, rank 1 read rank 0's float32 hidden
    state as bfloat16 and every logit was NaN."""
    from exo.devtools.parallel_check import build_instance, run_rank
    from exo.shared.types.instances import Sharding

    model_dir = _with_float32_norms(make_tiny(tmp_path / "mixed", "llama"))
    reference = run_rank(model_dir, build_instance(model_dir, Sharding.Pipeline, 1, []), 0, PROMPT, DECODE_STEPS)
    assert np.isfinite(reference["logits"]).all()

    ranks = run_ranks(model_dir, tmp_path, "pipeline", 2, PROMPT, DECODE)

    diffs = [float(np.abs(result["logits"] - reference["logits"]).max()) for result in ranks]
    print(f"bf16 + float32 norms, pipeline x2: max |logit diff| per rank {diffs}")
    assert max(diffs) <= TOLERANCE, diffs
    assert all(result["tokens"].tolist() == reference["tokens"].tolist() for result in ranks)
