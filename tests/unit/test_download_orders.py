"""Download orders (POST /download/start, /download/cancel, DELETE /download/...): how
`apply` keeps them in State and what the planner makes of them."""

from exo.catalog.cards import builtin_cards
from exo.shared.apply import apply_event
from exo.shared.types.common import ModelId, NodeId
from exo.shared.types.downloads import (
    DownloadCancelled,
    DownloadCompleted,
    DownloadFailed,
    DownloadOngoing,
    DownloadOrder,
    DownloadOrderEntry,
    DownloadProgress,
)
from exo.shared.types.events import DownloadOrdered, NodeDownloadDeleted, NodeTimedOut
from exo.shared.types.state import State
from exo.worker.planner import CancelModelDownload, DeleteModelFiles, StartModelDownload, plan
from tests.unit.test_planner import INSTANCE, NODE, NOW, RUNNER, instance_over

MODEL = ModelId("mlx-community/Qwen3.5-2B-MLX-8bit")
ONGOING = DownloadOngoing(downloaded_bytes=10, total_bytes=100)


def ordered(order: DownloadOrder, record: DownloadProgress | None = None) -> State:
    state = State(downloads={NODE: {MODEL: record}} if record is not None else {})
    return apply_event(state, DownloadOrdered(node_id=NODE, model_id=MODEL, order=order))


def test_an_order_is_kept_per_node_and_model_until_the_node_leaves():
    state = ordered("start")
    assert state.download_orders == {NODE: {MODEL: DownloadOrderEntry(order="start")}}
    assert apply_event(state, NodeTimedOut(node_id=NODE)).download_orders == {}


def test_a_new_start_drops_a_failed_or_cancelled_record_and_keeps_others():
    assert MODEL not in ordered("start", DownloadFailed(error_message="x")).downloads[NODE]
    assert MODEL not in ordered("start", DownloadCancelled(downloaded_bytes=5, total_bytes=9)).downloads[NODE]
    assert ordered("start", ONGOING).downloads[NODE][MODEL] == ONGOING
    assert ordered("cancel", DownloadFailed(error_message="x")).downloads[NODE][MODEL].kind == "DownloadFailed"


def test_a_deletion_removes_the_record_and_the_order():
    state = ordered("delete", DownloadCompleted(total_bytes=1, path="/m"))
    state = apply_event(state, NodeDownloadDeleted(node_id=NODE, model_id=MODEL))
    assert state.downloads == {NODE: {}} and state.download_orders == {NODE: {}}


def test_start_downloads_a_model_without_a_record_once():
    assert plan(NODE, ordered("start"), {}, NOW) == StartModelDownload(MODEL)
    assert plan(NODE, ordered("start"), {}, NOW, frozenset({MODEL})) is None
    assert plan(NODE, ordered("start", DownloadCompleted(total_bytes=1, path="/m")), {}, NOW) is None
    # Left by an earlier run of this node: started again, resuming.
    assert plan(NODE, ordered("start", ONGOING), {}, NOW) == StartModelDownload(MODEL)
    # Only some layers' files (a pipeline rank's): the rest is fetched.
    some_layers = DownloadCompleted(total_bytes=1, path="/m", layers=(0, 3))
    assert plan(NODE, ordered("start", some_layers), {}, NOW) == StartModelDownload(MODEL)
    # An attempt that failed after the order: not again until a new order.
    failed = ordered("start").model_copy(update={"downloads": {NODE: {MODEL: DownloadFailed(error_message="x")}}})
    assert plan(NODE, failed, {}, NOW) is None


def test_start_of_some_layers_fetches_until_a_record_covers_them():
    state = apply_event(State(), DownloadOrdered(node_id=NODE, model_id=MODEL, order="start", layers=(2, 4)))
    assert plan(NODE, state, {}, NOW) == StartModelDownload(MODEL, (2, 4))
    for held, again in (((0, 3), True), ((2, 6), False), (None, False)):
        record = DownloadCompleted(total_bytes=1, path="/m", layers=held)
        with_record = state.model_copy(update={"downloads": {NODE: {MODEL: record}}})
        assert (plan(NODE, with_record, {}, NOW) is not None) is again, held


def test_cancel_stops_only_a_running_download():
    assert plan(NODE, ordered("cancel", ONGOING), {}, NOW, frozenset({MODEL})) == CancelModelDownload(MODEL)
    cancelled = DownloadCancelled(downloaded_bytes=10, total_bytes=100)
    assert plan(NODE, ordered("cancel", cancelled), {}, NOW) is None


def test_delete_waits_while_an_instance_on_this_node_runs_the_model():
    state = ordered("delete", DownloadCompleted(total_bytes=1, path="/m"))
    assert plan(NODE, state, {}, NOW) == DeleteModelFiles(MODEL)
    card = builtin_cards()[MODEL]
    with_instance = state.model_copy(update={"instances": {INSTANCE: instance_over(card, [(NODE, RUNNER)])}})
    assert not isinstance(plan(NODE, with_instance, {}, NOW), DeleteModelFiles)
    other_node = state.model_copy(update={"instances": {INSTANCE: instance_over(card, [(NodeId("node-z"), RUNNER)])}})
    assert plan(NODE, other_node, {}, NOW) == DeleteModelFiles(MODEL)
