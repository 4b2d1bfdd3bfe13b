"""Models dirs: where a node finds models on disk (`<dir>/<org>--<name>/`, Hugging Face
layout), whether a model dir is complete enough to run, and which writable dir a
download goes to.

EXO_MODELS_DIRS and EXO_MODELS_READ_ONLY_DIRS are colon-separated paths (`~` expands).
Writable dirs are `$EXO_HOME/models` and EXO_MODELS_DIRS, minus any dir also listed as
read-only; exo never creates, writes or deletes anything in a read-only dir."""

import json
import os
import shutil
from importlib.resources import files
from pathlib import Path

PARTIAL_DIR_NAME = ".downloads"


def resource_dir(name: str) -> Path:
    return Path(str(files("exo") / "resources" / name))


def _dirs_from_env(variable: str) -> list[Path]:
    return [Path(entry).expanduser() for entry in os.environ.get(variable, "").split(":") if entry]


def models_dirs(exo_home: Path) -> list[Path]:
    """Writable models dirs, the node's own first."""
    read_only = {_resolved(d) for d in read_only_models_dirs()}
    return [d for d in [exo_home / "models", *_dirs_from_env("EXO_MODELS_DIRS")] if _resolved(d) not in read_only]


def read_only_models_dirs() -> list[Path]:
    """Models dirs exo never writes to; the package one ships the built-in demo model."""
    return [resource_dir("models"), *_dirs_from_env("EXO_MODELS_READ_ONLY_DIRS")]


def all_models_dirs(exo_home: Path) -> list[Path]:
    """Every models dir, in the order they are searched."""
    return [*models_dirs(exo_home), *read_only_models_dirs()]


def _resolved(path: Path) -> Path:
    return path.expanduser().resolve(strict=False)


def is_read_only_path(path: Path) -> bool:
    """The path is a read-only models dir or inside one."""
    resolved = _resolved(path)
    return any(resolved.is_relative_to(_resolved(d)) for d in read_only_models_dirs())


def _free_bytes(dirs: list[Path]) -> dict[Path, int]:
    """Free bytes on the disk each dir is (or would be created) on, for the writable
    ones. One reading per disk, so dirs sharing a disk tie exactly (two readings of a busy
    disk differ by whatever was written in between)."""
    per_device: dict[int, int] = {}
    free = {}
    for path in dirs:
        existing = path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if os.access(existing, os.W_OK):
            device = existing.stat().st_dev
            if device not in per_device:
                per_device[device] = shutil.disk_usage(existing).free
            free[path] = per_device[device]
    return free


def partial_model_dir(models_dir: Path, model_id: str) -> Path:
    """Where a download of the model collects its files until it is whole; no scan for
    models looks there."""
    return models_dir / PARTIAL_DIR_NAME / f"{model_dir_name(model_id)}.partial"


def download_free_bytes(exo_home: Path) -> int:
    """Free bytes in the roomiest writable models dir: the most a download can take."""
    return max(_free_bytes(models_dirs(exo_home)).values(), default=0)


def download_dir(exo_home: Path, model_id: str) -> Path:
    """The writable models dir a download of the model goes to: one already holding part
    of it (so it resumes there), else the one with the most free space (the first listed
    on a tie)."""
    candidates = models_dirs(exo_home)
    for candidate in candidates:
        if partial_model_dir(candidate, model_id).is_dir():
            return candidate
    free = _free_bytes(candidates)
    if not free:
        return candidates[0]  # the download reports why it cannot write there
    return max(free, key=lambda candidate: free[candidate])  # dicts keep order: the first wins a tie


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
