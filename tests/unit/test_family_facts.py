"""The family table's sharding facts match the code they describe: mlx-lm's model modules
with a `shard()` method (so an mlx-lm upgrade that adds or drops one fails here), exo's
own model modules, and exo's strategy modules in engine/mlx/sharding."""

import importlib
import pkgutil
from pathlib import Path
from types import ModuleType

import mlx_lm.models

import exo.engine.mlx.models
import exo.engine.mlx.sharding
from exo.engine.parsing.tool_calls import MLX_MODULES
from exo.shared.models.families import FAMILIES, StrategyOwner


def _model_types(owner: StrategyOwner) -> set[str]:
    return {model_type for model_type, facts in FAMILIES.items() if facts.tensor_strategy == owner}


def _modules_with_shard(package_dir: Path) -> set[str]:
    return {path.stem for path in package_dir.glob("*.py") if "def shard(" in path.read_text(encoding="utf-8")}


def _exo_modules(package: ModuleType) -> dict[str, ModuleType]:
    names = [info.name for info in pkgutil.iter_modules(package.__path__) if info.name != "common"]
    return {name: importlib.import_module(f"{package.__name__}.{name}") for name in names}


def test_mlx_lm_strategies_are_the_installed_mlx_lm_modules_with_shard():
    installed = _modules_with_shard(Path(mlx_lm.models.__path__[0]))
    assert _model_types(StrategyOwner.mlx_lm) == installed


def test_exo_model_strategies_are_exos_model_modules_with_shard():
    assert _model_types(StrategyOwner.exo_model) == _modules_with_shard(Path(exo.engine.mlx.models.__path__[0]))


def test_exo_strategies_and_pipeline_fix_ups_are_the_sharding_modules():
    modules = _exo_modules(exo.engine.mlx.sharding)
    assert _model_types(StrategyOwner.exo) == {name for name, module in modules.items() if hasattr(module, "shard")}
    fix_ups = {name for name, module in modules.items() if hasattr(module, "fix_pipeline")}
    assert {model_type for model_type, facts in FAMILIES.items() if facts.pipeline_fix_up} == fix_ups


def test_every_tool_format_is_one_the_output_parser_takes():
    formats = {facts.tool_format for facts in FAMILIES.values() if facts.tool_format}
    assert formats <= set(MLX_MODULES) | {"harmony", "dsml"}
