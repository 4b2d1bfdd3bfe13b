"""Models dirs: where a node finds models on disk (`<dir>/<org>--<name>/`, Hugging Face
layout), and whether a model dir is complete enough to run."""

import json
import os
from importlib.resources import files
from pathlib import Path


def resource_dir(name: str) -> Path:
    return Path(str(files("exo") / "resources" / name))


def _dirs_from_env(variable: str) -> list[Path]:
    return [Path(entry).expanduser() for entry in os.environ.get(variable, "").split(":") if entry]


def models_dirs(exo_home: Path) -> list[Path]:
    """Writable models dirs: the node's own first, where downloads go."""
    return [exo_home / "models", *_dirs_from_env("EXO_MODELS_DIRS")]


def read_only_models_dirs() -> list[Path]:
    """Models dirs exo never writes to; the package one ships the built-in demo model."""
    return [resource_dir("models"), *_dirs_from_env("EXO_MODELS_READ_ONLY_DIRS")]


def all_models_dirs(exo_home: Path) -> list[Path]:
    """Every models dir, in the order they are searched."""
    return [*models_dirs(exo_home), *read_only_models_dirs()]


def model_dir_name(model_id: str) -> str:
    return model_id.replace("/", "--")


def weight_files(path: Path) -> list[Path] | None:
    """The weight files a model dir should hold, or None if its index is unreadable."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(path.glob("*.safetensors"))
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError):
        return None
    return [path / name for name in sorted(set(weight_map.values()))]


def is_complete_model_dir(path: Path) -> bool:
    if not (path / "config.json").is_file():
        return False
    weights = weight_files(path)
    if not weights or not all(weight.is_file() for weight in weights):
        return False
    tokenizer_files = ["tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
    return any((path / name).is_file() for name in tokenizer_files)


def find_local_model_dir(model_id: str, exo_home: Path) -> Path | None:
    for models_dir in all_models_dirs(exo_home):
        candidate = models_dir / model_dir_name(model_id)
        if is_complete_model_dir(candidate):
            return candidate
    return None
