"""Which models the client-facing lists show. /v1/models and Ollama's tags list what this
cluster can serve; the whole catalog stays at /models."""

from exo.api.port import ClusterPort
from exo.shared.models.model_cards import ModelCard
from exo.shared.types.downloads import DownloadCompleted


def downloaded_model_ids(cluster: ClusterPort) -> set[str]:
    """Models whose weights are on some node: in a models dir of this node, or downloaded
    by any node of the cluster."""
    downloaded = {
        model_id
        for per_model in cluster.state.downloads.values()
        for model_id, progress in per_model.items()
        if isinstance(progress, DownloadCompleted)
    }
    return cluster.local_model_ids() | downloaded


def servable_cards(cluster: ClusterPort) -> list[ModelCard]:
    """Every card when this node can download (any model is then a request away); offline
    (--offline), only the models already on some node, so a client such as Open WebUI
    offers nothing the cluster cannot run."""
    cards = cluster.cards()
    if cluster.settings.offline:
        on_some_node = downloaded_model_ids(cluster)
        cards = {model_id: card for model_id, card in cards.items() if model_id in on_some_node}
    return sorted(cards.values(), key=lambda card: card.model_id)
