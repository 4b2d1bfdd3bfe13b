"""Cards and placement as the API needs them: a card or a 404, where a model would go or
a 400 that says why not, and placing a model for a request when auto-placement is on."""

import asyncio
import time
from collections.abc import Callable
from typing import Annotated

from fastapi import Depends, Request
from loguru import logger

from exo.api.errors import ApiError
from exo.api.port import ClusterPort
from exo.master.placement import (
    DISAGGREGATION_MIN_TOKENS,
    LINKS_BEING_MEASURED,
    PlacementError,
    place_disaggregated,
    place_instance,
)
from exo.shared.models.model_cards import ModelCard
from exo.shared.queries import gave_up_on, instances_of, least_loaded_instance
from exo.shared.types.commands import CreateInstance
from exo.shared.types.common import InstanceId, ModelId, NodeId
from exo.shared.types.instances import Instance, Sharding
from exo.shared.types.state import State

# A placed instance takes a moment to reach State; after that, a missing one is gone.
PLACEMENT_VISIBLE_SECONDS = 10.0
# How long a placement that cannot work yet waits for the cluster to settle: this node's
# own worker to register (it answers HTTP before it is in State), links to a new node to
# be measured.
PLACEMENT_SETTLE_SECONDS = 6.0
# After a model's instance was given up on (its runner failed at every attempt), requests
# are told so for this long instead of placing it again: a crash loop otherwise, one
# placement per request.
AUTO_PLACE_PAUSE_SECONDS = 300


def card_or_404(cluster: ClusterPort, model_id: str) -> ModelCard:
    card = cluster.cards().get(model_id)
    if card is None and (problem := cluster.model_dir_problem(model_id)) is not None:
        raise ApiError(
            422,
            f"model '{model_id}' is in this node's models dirs but cannot be used: {problem}",
            code="unusable_model",
            param="model_id",
        )
    if card is None:
        raise ApiError(
            404, f"model '{model_id}' is not known to this cluster", code="model_not_found", param="model_id"
        )
    return card


def planned_instance(
    cluster: ClusterPort,
    model_id: str,
    sharding: Sharding,
    min_nodes: int,
    context_length: int | None,
    draft_model: str | None = None,
) -> Instance:
    """Where placement would put the model now, or a 400 that says why it cannot go.
    With its draft model (`draft_model`, else the card's), which rank 0's node fetches."""
    card = card_or_404(cluster, model_id)
    draft = draft_model or card.draft_model
    if draft is not None and draft not in cluster.cards():
        raise ApiError(
            404, f"draft model '{draft}' is not known to this cluster", code="model_not_found", param="draft_model"
        )
    try:
        instance = place_instance(cluster.state, card, sharding, min_nodes, context_length)
    except PlacementError as error:
        raise ApiError(400, str(error), code="placement_failed") from error
    return instance.model_copy(update={"draft_model": ModelId(draft)}) if draft is not None else instance


def place_model(
    cluster: ClusterPort,
    model_id: str,
    sharding: Sharding = Sharding.Pipeline,
    min_nodes: int = 1,
    context_length: int | None = None,
    draft_model: str | None = None,
) -> CreateInstance:
    instance = planned_instance(cluster, model_id, sharding, min_nodes, context_length, draft_model)
    command = CreateInstance(instance=instance)
    cluster.send_command(command)
    return command


def place_disaggregated_model(
    cluster: ClusterPort,
    model_id: str,
    prefill_node: str,
    decode_node: str,
    context_length: int | None,
    min_tokens: int | None,
) -> CreateInstance:
    """The model served on `decode_node` with its long prompts prefilled on
    `prefill_node` (two instances, the prefill one created first), or a 400 saying why
    not. Returns the decode instance's command."""
    card = card_or_404(cluster, model_id)
    try:
        decode, prefill = place_disaggregated(
            cluster.state,
            card,
            NodeId(prefill_node),
            NodeId(decode_node),
            context_length,
            min_tokens if min_tokens is not None else DISAGGREGATION_MIN_TOKENS,
        )
    except PlacementError as error:
        raise ApiError(400, str(error), code="placement_failed") from error
    cluster.send_command(CreateInstance(instance=prefill))
    command = CreateInstance(instance=decode)
    cluster.send_command(command)
    return command


def _changed_from(state: State) -> Callable[[State], bool]:
    return lambda current: current is not state


def _settling(cluster: ClusterPort, state: State, error: ApiError) -> bool:
    return cluster.node_id not in state.nodes or LINKS_BEING_MEASURED in error.message


async def place_model_when_settled(
    cluster: ClusterPort,
    model_id: str,
    sharding: Sharding,
    min_nodes: int,
    context_length: int | None,
    draft_model: str | None = None,
) -> CreateInstance:
    """place_model, but a placement that fails only because the cluster is still settling
    (this node not yet in State, links to a new node not yet measured) is tried again as
    State changes, for up to PLACEMENT_SETTLE_SECONDS; then its error stands."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + PLACEMENT_SETTLE_SECONDS
    while True:
        state = cluster.state
        try:
            return place_model(cluster, model_id, sharding, min_nodes, context_length, draft_model)
        except ApiError as error:
            remaining = deadline - loop.time()
            if remaining <= 0 or not _settling(cluster, state, error):
                raise
        try:
            await cluster.wait_for(_changed_from(state), remaining)
        except TimeoutError:
            pass


def auto_place_enabled(flag: bool | None, state: State) -> bool:
    """The --auto-place / --no-auto-place flag, else on only in a one-node cluster."""
    return flag if flag is not None else len(state.nodes) == 1


class AutoPlacer:
    """Places a requested model that has no instance. Remembers what it placed until the
    instance shows in State, so requests arriving meanwhile wait for it instead of
    placing it again."""

    def __init__(self) -> None:
        self._placed: dict[str, tuple[InstanceId, float]] = {}
        # Instances given up on, and when this node first saw it.
        self._given_up_seen: dict[InstanceId, float] = {}

    def require_instance(self, cluster: ClusterPort, model: str) -> InstanceId | None:
        """None when an instance of the model serves; else the instance to wait for: one
        being loaded (placed by anyone, or re-placed by the master after a node left), or
        one placed now when auto-placement is on. A 404 for an unknown model, or a known
        one with no instance when auto-placement is off; a 400 when the model cannot be
        placed."""
        card_or_404(cluster, model)
        state = cluster.state
        if least_loaded_instance(state, ModelId(model)) is not None:
            return None
        loading = instances_of(state, model)
        if loading:
            return loading[0].instance_id
        if not auto_place_enabled(cluster.settings.auto_place, state):
            raise ApiError(
                404,
                f"model '{model}' has no running instance; place it first (POST /place_instance)",
                code="model_not_loaded",
                param="model",
            )
        now = time.monotonic()
        self._refuse_if_given_up(state, model, now)
        if model in self._placed:
            instance_id, placed_at = self._placed[model]
            if now - placed_at < PLACEMENT_VISIBLE_SECONDS and instance_id not in state.instance_deletions:
                return instance_id
        instance_id = place_model(cluster, model).instance.instance_id
        self._placed[model] = (instance_id, now)
        logger.info(f"auto-placing {model} as instance {instance_id}")
        return instance_id

    def _refuse_if_given_up(self, state: State, model: str, now: float) -> None:
        given_up = gave_up_on(state, model)
        if given_up is None:
            return
        instance_id, reason = given_up
        seen = self._given_up_seen.setdefault(instance_id, now)
        remaining = AUTO_PLACE_PAUSE_SECONDS - (now - seen)
        if remaining > 0:
            raise ApiError(
                503,
                f"model '{model}' is not placed again for {remaining:.0f} s: {reason}; "
                "place it by hand (POST /place_instance) once that is fixed",
                code="model_failed",
                retry_after=int(remaining) + 1,
            )


def auto_placer(request: Request) -> AutoPlacer:
    return request.app.state.auto_placer


AutoPlacerDep = Annotated[AutoPlacer, Depends(auto_placer)]
