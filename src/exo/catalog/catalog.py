"""The cards a node knows, held in memory: built-in ones, one for every complete model
dir in its models dirs, and the custom ones the cluster was given.

A request reads the cache and never the disk. `watch` looks at the models dirs' mtimes
(and their model dirs') every second, in a thread, and rescans only when one changed: a
download renamed into place, a model dir copied in or removed."""

import asyncio
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

from exo.catalog.cards import builtin_cards, card_from_model_dir, model_dir_problem
from exo.catalog.model_dirs import all_models_dirs, is_complete_model_dir
from exo.shared.models.model_cards import ModelCard
from exo.shared.types.common import ModelId

WATCH_SECONDS = 1.0

Stamp = tuple[tuple[str, int, tuple[tuple[str, int], ...]], ...]


def _local_models(exo_home: Path) -> tuple[dict[str, tuple[Path, ModelCard]], dict[str, str]]:
    """Every complete `<org>--<name>` dir, by model id, with its card; the first models
    dir holding a model wins, and a built-in card wins over a derived one. Then, by model
    id, why each dir that cannot be used was left out."""
    builtin = builtin_cards()
    models: dict[str, tuple[Path, ModelCard]] = {}
    problems: dict[str, str] = {}
    for models_dir in all_models_dirs(exo_home):
        if not models_dir.is_dir():
            continue
        for model_dir in sorted(models_dir.iterdir()):
            if "--" not in model_dir.name or not is_complete_model_dir(model_dir):
                continue
            model_id = model_dir.name.replace("--", "/", 1)
            if model_id in models or model_id in problems:
                continue
            try:
                problem = model_dir_problem(model_dir)
                if problem is not None:
                    raise ValueError(problem)
                models[model_id] = (model_dir, builtin.get(model_id) or card_from_model_dir(model_dir, model_id))
            except (ValueError, OSError) as error:
                # One odd model dir must not hide every other local model.
                logger.warning(f"skipping model dir {model_dir}: {error}")
                problems[model_id] = f"{model_dir}: {error}"
    return models, problems


def local_cards(exo_home: Path) -> dict[str, ModelCard]:
    """Cards for the models in the models dirs, read from disk now."""
    return {model_id: card for model_id, (_, card) in _local_models(exo_home)[0].items()}


def all_cards(exo_home: Path) -> dict[str, ModelCard]:
    return {**builtin_cards(), **local_cards(exo_home)}


def _mtime_ns(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return -1


def models_dirs_stamp(dirs: list[Path]) -> Stamp:
    """The mtimes of the models dirs and of the dirs in them: any of them changes when a
    model dir appears, goes, or gains or loses a file."""
    stamp = []
    for models_dir in dirs:
        try:
            with os.scandir(models_dir) as entries:
                inner = tuple(sorted((e.name, _mtime_ns(e.path)) for e in entries if e.is_dir()))
        except OSError:
            inner = ()
        stamp.append((str(models_dir), _mtime_ns(str(models_dir)), inner))
    return tuple(stamp)


@dataclass(frozen=True)
class _Snapshot:
    stamp: Stamp
    cards: dict[str, ModelCard]  # built-in and local
    local: dict[str, tuple[Path, ModelCard]]
    problems: dict[str, str]  # model dirs left out, and why


class Catalog:
    """One node's cards. Built with a first scan (blocking); then `cards()` is a dict
    merge and `refresh()`, which `watch` runs off the event loop, rescans on change."""

    def __init__(self, exo_home: Path) -> None:
        self.exo_home = exo_home
        self._snapshot = self._scan()

    def _scan(self) -> _Snapshot:
        # The stamp is taken first: a change during the scan shows at the next refresh.
        stamp = models_dirs_stamp(all_models_dirs(self.exo_home))
        local, problems = _local_models(self.exo_home)
        cards = {**builtin_cards(), **{model_id: card for model_id, (_, card) in local.items()}}
        return _Snapshot(stamp, cards, local, problems)

    def cards(self, custom: Mapping[ModelId, ModelCard]) -> dict[str, ModelCard]:
        """Built-in, local and the given custom cards (custom ones win)."""
        return {**self._snapshot.cards, **custom}

    def local_model_ids(self) -> set[str]:
        """Models whose weights are in one of this node's models dirs."""
        return set(self._snapshot.local)

    def local_model_dir(self, model_id: str) -> Path | None:
        """Where a model's files are on this node, if they are."""
        local = self._snapshot.local.get(model_id)
        return local[0] if local is not None else None

    def model_dir_problem(self, model_id: str) -> str | None:
        """Why this node's models dir entry for the model was left out, if it was."""
        return self._snapshot.problems.get(model_id)

    def refresh(self) -> None:
        """Rescan if a models dir changed. Blocking: stats every model dir."""
        if models_dirs_stamp(all_models_dirs(self.exo_home)) != self._snapshot.stamp:
            self._snapshot = self._scan()

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_SECONDS)
            await asyncio.to_thread(self.refresh)
