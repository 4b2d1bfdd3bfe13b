"""Real exo nodes as subprocesses, on free ports, each with its own EXO_HOME (the
fixtures that start them for tests are in tests/conftest.py)."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from exo.shared.types.instances import EngineKind
from exo.worker.hardware import choose_engine, probe

TINY_MODEL_ID = "acme/tiny"
# What a node started without --engine runs here (llama.cpp on this Linux machine).
DEFAULT_ENGINE: EngineKind = choose_engine("auto", probe())[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ExoNode:
    process: subprocess.Popen[bytes]
    api_port: int
    home: Path
    log_path: Path
    # Where the test process reaches the API (a network namespace's address for nodes
    # started by tests/support/cluster.py's netns harness).
    host: str = "127.0.0.1"
    # Sent as a Bearer token by the helpers below, for a node started with --api-key.
    api_key: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.api_port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, **kwargs) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30, **{"headers": self.headers, **kwargs})

    def post(self, path: str, **kwargs) -> httpx.Response:
        return httpx.post(self.url + path, timeout=30, **{"headers": self.headers, **kwargs})

    def delete(self, path: str) -> httpx.Response:
        return httpx.delete(self.url + path, timeout=30, headers=self.headers)

    def state(self) -> dict:
        response = self.get("/state")
        response.raise_for_status()
        return response.json()

    def wait_for_state(self, condition, timeout: float = 60, what: str = "condition") -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state()
            if condition(state):
                return state
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}; last state: {state}")

    def node_id(self) -> str:
        response = self.get("/node_id")
        response.raise_for_status()
        return response.json()

    def place(
        self,
        model_id: str = TINY_MODEL_ID,
        timeout: float = 120,
        sharding: str | None = None,
        min_nodes: int | None = None,
        draft_model: str | None = None,
    ) -> str:
        """Place model_id (optionally with a sharding, a node count and a draft model) and
        wait until it serves; with min_nodes, the instance must span exactly that many nodes."""
        node_id = self.node_id()
        self.wait_for_state(lambda s: node_id in s["nodes"], what="this node in the topology")
        body: dict = {"model_id": model_id}
        if sharding is not None:
            body["sharding"] = sharding
        if min_nodes is not None:
            body["min_nodes"] = min_nodes
        if draft_model is not None:
            body["draft_model"] = draft_model
        response = self.post("/place_instance", json=body)
        assert response.status_code == 200, response.text
        instance_id = response.json()["instance_id"]
        with httpx.stream(
            "GET",
            f"{self.url}/instance/await",
            params={"instance_id": instance_id},
            headers=self.headers,
            timeout=timeout,
        ) as stream:
            lines = [line for line in stream.iter_lines() if line.startswith(("event:", "data:"))]
        events = [line for line in lines if line.startswith("event:")]
        assert events and events[-1] == "event: ready", f"{model_id} did not become ready: {lines[-4:]}"
        if min_nodes is not None:
            instance = self.get(f"/instance/{instance_id}").json()
            assert len(instance["shardAssignments"]["nodeToRunner"]) == min_nodes, instance
        return instance_id

    def runner_pids(self) -> list[int]:
        """Live runner subprocesses of this node; an exited runner the node has not reaped
        yet (a zombie for a moment) counts as gone."""
        import psutil

        pids = []
        for child in psutil.Process(self.process.pid).children(recursive=True):
            try:
                cmdline = " ".join(child.cmdline())
            except (psutil.ZombieProcess, psutil.NoSuchProcess):
                continue
            if "spawn_main" in cmdline and "resource_tracker" not in cmdline:
                pids.append(child.pid)
        return pids

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("0.0.0.0", 0))
        return sock.getsockname()[1]


def start_node(
    home: Path,
    env_extra: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
    namespace: str | None = None,
    discovery_port: int | None = None,
    multicast: bool = False,
) -> ExoNode:
    """A real `exo` process. Unless told otherwise it gets a namespace and discovery port
    of its own, so nodes of concurrent tests never find each other."""
    api_port = free_port()
    namespace = namespace or f"test-{uuid.uuid4().hex[:8]}"
    discovery_port = discovery_port or free_udp_port()
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / "node-output.log"
    env = {**os.environ, "EXO_HOME": str(home), **(env_extra or {})}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "exo.main",
            "--api-port",
            str(api_port),
            "--api-host",
            "127.0.0.1",
            "--namespace",
            namespace,
            "--discovery-port",
            str(discovery_port),
            # Tests on the host reach peers by bootstrap only: no multicast leaves the
            # machine (the network-namespace tests exercise multicast on their own bridge).
            *(("--no-multicast",) if multicast is False else ()),
            *args,
        ],
        env=env,
        stdout=log_path.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    node = ExoNode(process=process, api_port=api_port, home=home, log_path=log_path)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"exo exited with {process.returncode}:\n{node.logs()}")
        try:
            if httpx.get(node.url + "/node_id", timeout=1).status_code == 200:
                return node
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    stop_node(node)
    raise RuntimeError(f"exo did not start:\n{node.logs()}")


def stop_node(node: ExoNode) -> None:
    if node.process.poll() is None:
        os.killpg(node.process.pid, signal.SIGTERM)
        try:
            node.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(node.process.pid, signal.SIGKILL)
            node.process.wait()


@contextlib.contextmanager
def running_node(
    home: Path, env_extra: dict[str, str] | None = None, args: tuple[str, ...] = (), models: Sequence[str] = ()
) -> Iterator[ExoNode]:
    """A started node with `models` placed and ready, stopped on the way out however the
    body ends."""
    node = start_node(home, env_extra, args)
    try:
        for model in models:
            node.place(model)
        yield node
    finally:
        stop_node(node)
