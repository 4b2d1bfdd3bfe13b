"""The cluster transport over eclipse-zenoh: peers found by UDP multicast scouting on the
LAN and by explicit bootstrap peers; every key lives under the cluster's namespace, so
two clusters on one network never see each other's messages."""

import json
from collections.abc import Callable

import zenoh

from exo.routing.router import Topic

DEFAULT_DISCOVERY_PORT = 7446
MULTICAST_GROUP = "224.0.0.224"


def zenoh_config(
    listen_port: int,
    discovery_port: int,
    bootstrap_peers: list[str],
    multicast: bool = True,
    discovery_interface: str = "auto",
) -> zenoh.Config:
    config = zenoh.Config()
    config.insert_json5("mode", json.dumps("peer"))
    config.insert_json5("listen/endpoints", json.dumps([f"tcp/0.0.0.0:{listen_port}"]))
    config.insert_json5("connect/endpoints", json.dumps(bootstrap_peers))
    config.insert_json5("scouting/multicast/enabled", json.dumps(multicast))
    config.insert_json5("scouting/multicast/address", json.dumps(f"{MULTICAST_GROUP}:{discovery_port}"))
    config.insert_json5("scouting/multicast/interface", json.dumps(discovery_interface))
    # Peers found by multicast connect to each other directly, forming a full mesh.
    config.insert_json5("scouting/multicast/autoconnect", json.dumps({"peer": ["peer"]}))
    return config


class ZenohTransport:
    def __init__(
        self,
        namespace: str,
        listen_port: int = 0,
        discovery_port: int = DEFAULT_DISCOVERY_PORT,
        bootstrap_peers: list[str] | None = None,
        multicast: bool = True,
        discovery_interface: str = "auto",
    ) -> None:
        self.prefix = f"exo/{namespace}"
        self.config = zenoh_config(
            listen_port, discovery_port or DEFAULT_DISCOVERY_PORT, bootstrap_peers or [], multicast, discovery_interface
        )
        self.session: zenoh.Session | None = None
        self._publishers: dict[Topic, zenoh.Publisher] = {}
        self._subscribers: list[zenoh.Subscriber] = []

    def start(self, on_message: Callable[[Topic, bytes], None]) -> None:
        self.session = zenoh.open(self.config)
        for topic in Topic:
            key = f"{self.prefix}/{topic.value}"
            self._publishers[topic] = self.session.declare_publisher(
                key, reliability=zenoh.Reliability.RELIABLE, congestion_control=zenoh.CongestionControl.BLOCK
            )
            self._subscribers.append(
                self.session.declare_subscriber(
                    key, lambda sample, topic=topic: on_message(topic, sample.payload.to_bytes())
                )
            )

    def send(self, topic: Topic, payload: bytes) -> None:
        self._publishers[topic].put(payload)

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None
