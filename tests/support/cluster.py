"""A harness for tests that need several real `exo` nodes forming one cluster.

    with loopback_cluster(3, tmp_path, env) as nodes:   # joined by --bootstrap-peers
        states = wait_converged(nodes)
    with netns_cluster(3, tmp_path, env) as nodes:      # joined by multicast scouting only
        states = wait_converged(nodes)

Both yield a `Cluster`: a list of the running nodes (`ClusterNode`, an `ExoNode` with
its ports and network namespace) that can also `add_node()` and `stop_node()`. On the
way out they always stop every node they started and remove every namespace, veth and
bridge they created; if the body raised, they first print the tail of each node's log.

Network rule: every packet stays on loopback or on links this harness creates. So
`loopback_cluster` nodes run with --no-multicast (zenoh's "auto" scouting interface
would include the host's NIC), and multicast is exercised only by `netns_cluster`, whose
nodes sit in namespaces whose only link is the harness's own bridge.
"""

import contextlib
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.node import ExoNode, free_port, free_udp_port

SUBNET_PREFIX = "10.231"
# Namespaces are named exo-<pid of the test process>-<run tag>-<suffix>; interfaces
# exobr<tag> (bridge), exv<tag>h<i> (veth end in the root namespace) and exv<tag>n<i>
# (end inside namespace i). A run whose process is gone left them behind: removed at
# the start of the next run.
_NETNS_NAME = re.compile(r"^exo-(\d+)-([0-9a-f]{4})-[0-9a-z]+$")
_LINK_NAME = re.compile(r"^ex(?:obr|v)([0-9a-f]{4})")
LOG_TAIL_CHARS = 6000
START_TIMEOUT_SECONDS = 60


@dataclass
class ClusterNode(ExoNode):
    listen_port: int = 0
    discovery_port: int = 0
    namespace: str = ""  # the exo --namespace
    netns: str | None = None  # the Linux network namespace it runs in, if any
    # How it was started, so it can be started again on the same home and ports.
    command: tuple[str, ...] = ()
    env: dict[str, str] | None = None


class Cluster(list):
    """The running nodes, in start order; `started` also keeps the stopped ones."""

    def __init__(self, spawn: Callable[..., ClusterNode]) -> None:
        super().__init__()
        self._spawn = spawn
        self.started: list[ClusterNode] = []

    def _launch(self, count: int, **options) -> list[ClusterNode]:
        new = []
        for _ in range(count):
            node = self._spawn(len(self.started), self, **options)
            self.started.append(node)
            new.append(node)
        wait_started(new)
        self.extend(new)
        return new

    def add_node(self, **options) -> ClusterNode:
        """Start one more node, joined like the others (options: namespace, args)."""
        return self._launch(1, **options)[0]

    def stop_node(self, node: ClusterNode) -> None:
        stop_nodes([node])
        self.remove(node)

    def kill_and_restart(
        self, nodes: Sequence[ClusterNode], api_ports: Sequence[int] | None = None
    ) -> list[ClusterNode]:
        """kill -9 every node of `nodes` (their runners die with them), then start each
        again as it was started: same home, ports and arguments (or the API ports
        `api_ports`, one per node)."""
        for node in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.process.pid, signal.SIGKILL)
        for node in nodes:
            node.process.wait()
        restarted = []
        for index, node in enumerate(nodes):
            command, api_port = list(node.command), node.api_port
            if api_ports is not None:
                api_port = api_ports[index]
                command[command.index("--api-port") + 1] = str(api_port)
            with node.log_path.open("ab") as log:
                process = subprocess.Popen(
                    command, env=node.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            again = dataclasses.replace(node, process=process, api_port=api_port, command=tuple(command))
            self[self.index(node)] = again
            self.started.append(again)
            restarted.append(again)
        wait_started(restarted)
        return restarted


# ---------------------------------------------------------------------------
# Processes


def spawn_node(
    home: Path,
    api_port: int,
    args: Sequence[str],
    env_extra: dict[str, str] | None,
    *,
    host: str = "127.0.0.1",
    netns: str | None = None,
    offline: bool = True,
    **fields,
) -> ClusterNode:
    """Start `python -m exo.main` (inside `netns` if given) without waiting for it;
    `--offline` unless told otherwise (a test giving the nodes a fake hub)."""
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / "node-output.log"
    env = {**os.environ, "EXO_HOME": str(home), **(env_extra or {})}
    command = [
        sys.executable,
        "-m",
        "exo.main",
        "--api-port",
        str(api_port),
        *(["--offline"] if offline else []),
        *args,
    ]
    if netns is not None:
        command = ["ip", "netns", "exec", netns, *command]  # execs: the pid is python's
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return ClusterNode(
        process=process,
        api_port=api_port,
        home=home,
        log_path=log_path,
        host=host,
        netns=netns,
        command=tuple(command),
        env=env,
        **fields,
    )


def wait_started(nodes: Sequence[ExoNode], timeout: float = START_TIMEOUT_SECONDS) -> None:
    """Until every node's API answers /node_id (its transport is up before that)."""
    deadline = time.monotonic() + timeout
    pending = list(nodes)
    while pending:
        for node in list(pending):
            if node.process.poll() is not None:
                raise RuntimeError(f"exo at {node.url} exited with {node.process.returncode}:\n{_tail(node)}")
            try:
                if httpx.get(node.url + "/node_id", timeout=1).status_code == 200:
                    pending.remove(node)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            raise RuntimeError("exo did not start: " + "; ".join(f"{n.url}:\n{_tail(n)}" for n in pending))
        if pending:
            time.sleep(0.1)


def stop_nodes(nodes: Sequence[ExoNode], timeout: float = 15) -> None:
    """SIGTERM every node's process group at once, then SIGKILL whatever outlives timeout."""
    for node in nodes:
        if node.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for node in nodes:
        try:
            node.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.process.pid, signal.SIGKILL)
            node.process.wait()


def _tail(node: ExoNode, chars: int = LOG_TAIL_CHARS) -> str:
    return node.logs()[-chars:]


def print_log_tails(nodes: Sequence[ExoNode], chars: int = LOG_TAIL_CHARS) -> None:
    for index, node in enumerate(nodes):
        print(f"\n--- exo node {index} at {node.url} (exit code {node.process.poll()}): last {chars} chars of log ---")
        print(_tail(node, chars))


@contextlib.contextmanager
def _running(cluster: Cluster, teardown: Callable[[], None] = lambda: None) -> Iterator[Cluster]:
    try:
        yield cluster
    except pytest.skip.Exception:
        raise
    except BaseException:
        print_log_tails(cluster.started)
        raise
    finally:
        try:
            stop_nodes(cluster.started)
        finally:
            teardown()


# ---------------------------------------------------------------------------
# Convergence


def describe(nodes: Sequence[ExoNode], states: Sequence[dict | Exception]) -> str:
    lines = []
    for node, state in zip(nodes, states, strict=True):
        if isinstance(state, Exception):
            lines.append(f"  {node.url}: {type(state).__name__}: {state}")
        else:
            lines.append(
                f"  {node.url}: nodes={sorted(state['nodes'])} master={state['masterNodeId']} "
                f"lastEventAppliedIdx={state['lastEventAppliedIdx']}"
            )
    return "\n".join(lines)


def wait_converged(nodes: Sequence[ExoNode], timeout: float = 30, poll: float = 0.2) -> list[dict]:
    """Until every node's /state lists exactly these nodes, names the same master (not
    None) and has applied the same last event. Returns the states; raises AssertionError
    with each node's view on timeout."""
    ids = set()
    for node in nodes:
        response = node.get("/node_id")
        response.raise_for_status()
        ids.add(response.json())
    deadline = time.monotonic() + timeout
    while True:
        states: list[dict | Exception] = []
        for node in nodes:
            try:
                states.append(node.state())
            except httpx.HTTPError as error:
                states.append(error)
        if all(isinstance(s, dict) for s in states):
            views = {(frozenset(s["nodes"]), s["masterNodeId"], s["lastEventAppliedIdx"]) for s in states}
            if len(views) == 1:
                members, master, _ = views.pop()
                if members == ids and master is not None:
                    return states
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{len(nodes)} nodes did not converge in {timeout}s on nodes={sorted(ids)}; their views:\n"
                + describe(nodes, states)
            )
        time.sleep(poll)


# ---------------------------------------------------------------------------
# Network namespaces


def netns_unavailable_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _json(*args: str) -> list[dict]:
    out = _ip("-json", *args).stdout.strip()
    return json.loads(out) if out else []


def _netns_names() -> list[str]:
    return [entry["name"] for entry in _json("netns", "list")]


def _root_links() -> list[str]:
    return [entry["ifname"] for entry in _json("link", "show")]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_processes_in(netns: str) -> None:
    result = _ip("netns", "pids", netns, check=False)
    for pid in result.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def cleanup_stale_netns() -> list[str]:
    """Remove namespaces, veths and bridges of earlier runs whose test process is gone
    (killed processes left in those namespaces go too). Returns what it removed."""
    removed = []
    live_tags = set()
    for name in _netns_names():
        match = _NETNS_NAME.match(name)
        if match is None:
            continue
        if _pid_alive(int(match[1])):
            live_tags.add(match[2])
            continue
        _kill_processes_in(name)
        _ip("netns", "del", name, check=False)
        removed.append(name)
    # A run creates its namespaces before its links, so a link whose tag has no live
    # namespace belongs to no running test.
    for link in _root_links():
        match = _LINK_NAME.match(link)
        if match is not None and match[1] not in live_tags:
            if _ip("link", "del", link, check=False).returncode == 0:
                removed.append(link)
    return removed


def _pick_third_octet() -> int:
    used = {int(m[1]) for m in re.finditer(rf"{re.escape(SUBNET_PREFIX)}\.(\d+)\.", _ip("-4", "-o", "addr").stdout)}
    used |= {int(m[1]) for m in re.finditer(rf"{re.escape(SUBNET_PREFIX)}\.(\d+)\.", _ip("-4", "route").stdout)}
    return random.choice([x for x in range(16, 250) if x not in used])


class Network:
    """What one cluster created: namespaces, veth pairs, maybe a bridge, on 10.231.X.0/24."""

    def __init__(self) -> None:
        reason = netns_unavailable_reason()
        if reason is not None:
            pytest.skip(f"needs Linux network namespaces: {reason}")
        cleanup_stale_netns()
        taken = {m[2] for name in _netns_names() if (m := _NETNS_NAME.match(name))}
        taken |= {m[1] for link in _root_links() if (m := _LINK_NAME.match(link))}
        self.tag = random.choice([t for t in (f"{random.getrandbits(16):04x}" for _ in range(64)) if t not in taken])
        self.octet = _pick_third_octet()
        self.namespaces: list[str] = []
        self.root_links: list[str] = []
        self.bridge: str | None = None

    def address(self, host: int) -> str:
        return f"{SUBNET_PREFIX}.{self.octet}.{host}"

    @property
    def root_address(self) -> str:
        return self.address(1)

    def add_namespace(self, suffix: str) -> str:
        name = f"exo-{os.getpid()}-{self.tag}-{suffix}"
        result = _ip("netns", "add", name, check=False)
        if result.returncode != 0:
            if not self.namespaces and ("not permitted" in result.stderr or "denied" in result.stderr):
                pytest.skip(f"cannot create network namespaces here: {result.stderr.strip()}")
            raise RuntimeError(f"`ip netns add {name}` failed: {result.stderr.strip()}")
        self.namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        return name

    def add_bridge(self) -> str:
        name = f"exobr{self.tag}"
        _ip("link", "add", name, "type", "bridge")
        self.bridge = name
        _ip("addr", "add", f"{self.root_address}/24", "dev", name)
        _ip("link", "set", name, "up")
        return name

    def connect(self, netns: str, index: int, host: int) -> str:
        """A veth pair from the root namespace (on the bridge, or holding the root
        address if there is no bridge) into netns, with address .host there; multicast
        leaves netns through it. Returns the address."""
        outside, inside = f"exv{self.tag}h{index}", f"exv{self.tag}n{index}"
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside, "netns", netns)
        self.root_links.append(outside)
        if self.bridge is not None:
            _ip("link", "set", outside, "master", self.bridge)
        else:
            _ip("addr", "add", f"{self.root_address}/24", "dev", outside)
        _ip("link", "set", outside, "up")
        address = self.address(host)
        _ip("-n", netns, "addr", "add", f"{address}/24", "dev", inside)
        _ip("-n", netns, "link", "set", inside, "up")
        _ip("-n", netns, "route", "add", "224.0.0.0/4", "dev", inside)
        # zenoh lists interfaces once, when it starts: they must be up and running by then.
        deadline = time.monotonic() + 10
        while _json("-n", netns, "link", "show", "dev", inside)[0].get("operstate") != "UP":
            if time.monotonic() > deadline:
                raise RuntimeError(f"{inside} in {netns} did not come up")
            time.sleep(0.05)
        return address

    def teardown(self) -> None:
        """Remove everything, best effort, reporting what could not be removed."""
        failures = []
        for link in self.root_links:  # deleting one end deletes the pair, right away
            result = _ip("link", "del", link, check=False)
            if result.returncode != 0 and "Cannot find device" not in result.stderr:
                failures.append(f"link {link}: {result.stderr.strip()}")
        for netns in self.namespaces:
            _kill_processes_in(netns)
            result = _ip("netns", "del", netns, check=False)
            if result.returncode != 0:
                failures.append(f"netns {netns}: {result.stderr.strip()}")
        if self.bridge is not None:
            result = _ip("link", "del", self.bridge, check=False)
            if result.returncode != 0:
                failures.append(f"bridge {self.bridge}: {result.stderr.strip()}")
        if failures:
            warnings.warn("network teardown left: " + "; ".join(failures), stacklevel=2)


# ---------------------------------------------------------------------------
# The clusters


def _distinct_port(pick: Callable[[], int], taken: set[int]) -> int:
    while (port := pick()) in taken:
        pass
    taken.add(port)
    return port


@contextlib.contextmanager
def loopback_cluster(
    n: int,
    tmp_path: Path,
    env_extra: dict[str, str] | None = None,
    namespace: str | None = None,
    args: Sequence[str] = (),
    offline: bool = True,
) -> Iterator[Cluster]:
    """n nodes joined over 127.0.0.1 by --bootstrap-peers only (no multicast): each has
    its own EXO_HOME, API port and --listen-port, and bootstraps from every node started
    before it. `offline=False` lets them download (from HF_ENDPOINT in env_extra)."""
    namespace = namespace or f"test-{uuid.uuid4().hex[:8]}"
    ports: set[int] = set()

    def spawn(index: int, cluster: Cluster, namespace: str = namespace, args: Sequence[str] = args) -> ClusterNode:
        api_port = _distinct_port(free_port, ports)
        listen_port = _distinct_port(free_port, ports)
        discovery_port = _distinct_port(free_udp_port, ports)
        peers = ",".join(f"tcp/127.0.0.1:{node.listen_port}" for node in cluster)
        return spawn_node(
            tmp_path / f"node{index}",
            api_port,
            [
                "--api-host",
                "127.0.0.1",
                "--listen-port",
                str(listen_port),
                "--discovery-port",
                str(discovery_port),
                "--no-multicast",
                "--namespace",
                namespace,
                *(["--bootstrap-peers", peers] if peers else []),
                *args,
            ],
            env_extra,
            host="127.0.0.1",
            netns=None,
            offline=offline,
            listen_port=listen_port,
            discovery_port=discovery_port,
            namespace=namespace,
        )

    cluster = Cluster(spawn)
    with _running(cluster):
        for _ in range(n):  # one at a time: each bootstraps from the ones before
            cluster.add_node()
        yield cluster


@contextlib.contextmanager
def netns_cluster(
    n: int,
    tmp_path: Path,
    env_extra: dict[str, str] | None = None,
    namespaces: Sequence[str] | None = None,
    args: Sequence[str] = (),
) -> Iterator[Cluster]:
    """n nodes, each in a network namespace of its own, all on one bridge, found by
    multicast scouting only (one shared --discovery-port, no bootstrap peers).
    namespaces: the exo --namespace of each node (default: one shared, fresh one).
    Node i listens at 10.231.X.(10+i); the test process reaches it over the bridge
    (10.231.X.1). Skips when namespaces are unavailable."""
    if namespaces is not None and len(namespaces) != n:
        raise ValueError(f"{n} nodes but {len(namespaces)} namespaces")
    default_namespace = f"test-{uuid.uuid4().hex[:8]}"
    network = Network()
    discovery_port = free_udp_port()
    try:
        # Namespaces before links: cleanup_stale_netns keeps links whose tag has a live namespace.
        first = network.add_namespace("0")
        network.add_bridge()

        def spawn(
            index: int, cluster: Cluster, namespace: str | None = None, args: Sequence[str] = args
        ) -> ClusterNode:
            netns = first if index == 0 else network.add_namespace(str(index))
            address = network.connect(netns, index, 10 + index)
            if namespace is None:
                namespace = namespaces[index] if namespaces is not None and index < n else default_namespace
            api_port, listen_port = free_port(), free_port()
            return spawn_node(
                tmp_path / f"node{index}",
                api_port,
                [
                    "--api-host",
                    "0.0.0.0",
                    "--listen-port",
                    str(listen_port),
                    "--discovery-port",
                    str(discovery_port),
                    "--namespace",
                    namespace,
                    *args,
                ],
                env_extra,
                host=address,
                netns=netns,
                listen_port=listen_port,
                discovery_port=discovery_port,
                namespace=namespace,
            )

        cluster = Cluster(spawn)
        with _running(cluster):
            cluster._launch(n)  # all at once: nothing to wait for between them
            yield cluster
    finally:
        network.teardown()


def await_ready(node: ExoNode, instance_id: str, timeout: float = 180) -> None:
    """Until /instance/await says the instance serves; fails with its last events if not."""
    params = {"instance_id": instance_id}
    with httpx.stream("GET", f"{node.url}/instance/await", params=params, timeout=timeout) as stream:
        events = [line for line in stream.iter_lines() if line.startswith(("event:", "data:"))]
    assert "event: ready" in events, events[-4:]
