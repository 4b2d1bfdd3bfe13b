"""What a node asks the master for again after a partition heal dropped its side's
history: the users' writes (cards, its own download orders), nothing the cluster derives
by itself (tasks, runner states, instances placed on the lost side)."""

from exo.routing.replica import asked_again
from exo.shared.models.model_cards import ModelCard
from exo.shared.types.commands import AddCustomModelCard, CancelDownload, DeleteCustomModelCard, StartDownload
from exo.shared.types.common import ModelId, NodeId
from exo.shared.types.events import (
    CustomModelCardAdded,
    CustomModelCardDeleted,
    DownloadOrdered,
    IndexedEvent,
    MasterElected,
    NodeTimedOut,
)

SELF = NodeId("node-self")
OTHER = NodeId("node-other")


def indexed(events: list) -> list[IndexedEvent]:
    return [IndexedEvent(idx=i, event=e) for i, e in enumerate(events)]


def test_cards_and_own_download_orders_are_asked_for_again_in_order():
    card = ModelCard(
        model_id=ModelId("acme/minority"),
        n_layers=2,
        hidden_size=64,
        tasks=["TextGeneration"],
        context_length=4096,
        storage_size={"in_bytes": 500000},
    )
    dropped = indexed(
        [
            MasterElected(node_id=SELF),
            NodeTimedOut(node_id=OTHER),
            CustomModelCardAdded(card=card),
            DownloadOrdered(node_id=SELF, model_id=ModelId("acme/a"), order="start", layers=(0, 2)),
            DownloadOrdered(node_id=OTHER, model_id=ModelId("acme/b"), order="start"),
            DownloadOrdered(node_id=SELF, model_id=ModelId("acme/a"), order="cancel"),
            CustomModelCardDeleted(model_id=ModelId("acme/old")),
        ]
    )
    commands = asked_again(dropped, SELF)
    assert [type(c) for c in commands] == [AddCustomModelCard, StartDownload, CancelDownload, DeleteCustomModelCard]
    assert commands[0] == AddCustomModelCard(card=card, command_id=commands[0].command_id)
    start = commands[1]
    assert isinstance(start, StartDownload) and start.node_id == SELF and start.layers == (0, 2)


def test_nothing_derived_is_asked_for_again():
    assert asked_again(indexed([MasterElected(node_id=SELF), NodeTimedOut(node_id=OTHER)]), SELF) == []
