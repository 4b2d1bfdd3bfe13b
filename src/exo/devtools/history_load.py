"""A cluster left serving for a long time (issue 35): many short requests through one node
of a 3-node cluster, then what each node keeps on disk, how its memory moved, and how soon
a node restarted at the end serves again; and the API's own share of the time to first
token, on one node.

    python -m exo.devtools.history_load --requests 100000      # the issue's figure
    python -m exo.devtools.history_load --requests 10000 --clients 4
    python -m exo.devtools.history_load --ttft 100              # one node, one-token requests

Starts its own nodes on 127.0.0.1 (offline, no multicast, joined by --bootstrap-peers),
serving a random tiny llama placed on the node the requests go through (not the master,
so every event crosses the network); stops by itself after the requests and prints the
figures (and one JSON line); exits non-zero if a check fails: the history (snapshots and
event segments under each node's data/history) over --max-history-mb on any node, RSS of
that node and its runner after the run over x1.1 of a quarter in, or the restarted node
not serving within 3 s. --ttft N: N one-token streaming requests one after another; the
API's time to first token minus the engine's own (the prompt's tokens over its prompt
tok/s, from generation_stats), median; target 5 ms."""

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from exo.devtools.load_test import MODEL_ID, WORDS, _free_port, _state, _tree_rss, _wait, start_node, stop_node
from exo.devtools.tiny_models import make_tiny_llama

MAX_HISTORY_MB = 20.0
MAX_RESTART_SECONDS = 3.0
MAX_TTFT_OVERHEAD_MS = 5.0
MAX_RSS_GROWTH = 1.1


@dataclass
class Node:
    home: Path
    process: subprocess.Popen[bytes]
    url: str
    port: int
    args: tuple[str, ...]

    def history_bytes(self) -> int:
        directory = self.home / "data" / "history"
        return sum(path.stat().st_size for path in directory.iterdir() if path.is_file())


def start_cluster(scratch: Path, count: int, env: dict[str, str]) -> list[Node]:
    namespace = f"history-load-{os.getpid()}"
    nodes: list[Node] = []
    for index in range(count):
        listen = _free_port()
        peers = ",".join(f"tcp/127.0.0.1:{node.args[1]}" for node in nodes)
        args = ("--listen-port", str(listen), *(("--bootstrap-peers", peers) if peers else ()))
        port = _free_port()
        home = scratch / f"node{index}"
        process, url = start_node(home, env, args, namespace=namespace, port=port)
        nodes.append(Node(home, process, url, port, args))
    _wait(lambda: all(len(_state(n.url)["nodes"]) == count for n in nodes), 60, f"{count} nodes in every State")
    return nodes


def restart(node: Node, env: dict[str, str], namespace: str) -> float:
    """kill -9 the node, start it again on its home and ports; seconds from its start
    until a request through it is answered."""
    os.killpg(node.process.pid, 9)
    node.process.wait()
    started = time.monotonic()
    node.process, node.url = start_node(node.home, env, node.args, namespace=namespace, port=node.port)

    def answered() -> bool:
        body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "back?"}], "max_tokens": 1}
        return httpx.post(node.url + "/v1/chat/completions", json=body, timeout=5).status_code == 200

    _wait(answered, 120, "the restarted node to serve")
    return time.monotonic() - started


def place_on(url: str, others: list[str]) -> None:
    """The tiny model on this node alone; ready in every node's State."""
    node_id = httpx.get(url + "/node_id", timeout=10).json()
    _wait(lambda: node_id in _state(url)["nodes"], 60, "the node in State")
    previews = httpx.get(url + "/instance/previews", params={"model_id": MODEL_ID}, timeout=30).json()
    preview = next(p for p in previews if p["instance"] and p["nodeIds"] == [node_id])
    httpx.post(url + "/instance", json={"instance": preview["instance"]}, timeout=30).raise_for_status()
    for each in [url, *others]:
        _wait(lambda each=each: [r["kind"] for r in _state(each)["runners"].values()] == ["RunnerReady"], 120, "ready")


@dataclass
class Counter:
    left: int
    deadline: float = float("inf")
    done: int = 0
    errors: int = 0
    first_error: str = ""
    lock: threading.Lock = threading.Lock()

    def take(self) -> bool:
        with self.lock:
            if self.left <= 0 or time.monotonic() > self.deadline:
                return False
            self.left -= 1
            return True


def _requests(url: str, counter: Counter, seed: int) -> None:
    rng = random.Random(seed)
    with httpx.Client(timeout=60) as http:
        while counter.take():
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
            body = {
                "model": MODEL_ID,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": rng.randint(1, 4),
            }
            try:
                response = http.post(url + "/v1/chat/completions", json=body)
                ok, error = response.status_code == 200, f"{response.status_code} {response.text[:200]}"
            except httpx.HTTPError as exc:
                ok, error = False, f"{type(exc).__name__}: {exc}"
            with counter.lock:
                counter.done += 1
                if not ok:
                    counter.errors += 1
                    counter.first_error = counter.first_error or error


@dataclass
class LongRunResult:
    requests: int
    seconds: float
    errors: int
    first_error: str
    events: int
    history_bytes: list[int]
    # History bytes on the serving node after each tenth of the requests: flat, not rising.
    history_curve: list[int]
    rss_quarter: int
    rss_after: int
    # The master node's process (it orders and logs every event).
    master_rss_quarter: int
    master_rss_after: int
    restart_seconds: float

    def problems(self, max_history_mb: float) -> list[str]:
        found = [f"{self.errors} request(s) failed, first: {self.first_error}"] if self.errors else []
        if max(self.history_bytes) > max_history_mb * 2**20:
            found.append(f"history {max(self.history_bytes) / 2**20:.1f} MB on a node (max {max_history_mb})")
        if self.rss_after > MAX_RSS_GROWTH * self.rss_quarter:
            found.append(f"RSS grew x{self.rss_after / self.rss_quarter:.3f} from a quarter in")
        if self.master_rss_after > MAX_RSS_GROWTH * self.master_rss_quarter:
            found.append(
                f"the master's RSS grew x{self.master_rss_after / self.master_rss_quarter:.3f} from a quarter in"
            )
        if self.restart_seconds > MAX_RESTART_SECONDS:
            found.append(f"the restarted node served after {self.restart_seconds:.2f} s")
        return found

    def report(self) -> str:
        return (
            f"{self.requests} requests in {self.seconds:.0f} s ({self.requests / self.seconds:.1f}/s), "
            f"{self.errors} errors, {self.events} events ({self.events / max(self.requests, 1):.2f} per request); "
            f"history on disk per node {[round(b / 2**20, 2) for b in self.history_bytes]} MB, on the serving node "
            f"by tenths {[round(b / 2**20, 2) for b in self.history_curve]} MB; RSS (serving node and runner) "
            f"{self.rss_quarter / 2**20:.0f} MiB a quarter in, {self.rss_after / 2**20:.0f} MiB after "
            f"(x{self.rss_after / self.rss_quarter:.3f}), master {self.master_rss_quarter / 2**20:.0f} -> "
            f"{self.master_rss_after / 2**20:.0f} MiB (x{self.master_rss_after / self.master_rss_quarter:.3f}); restarted node served {self.restart_seconds:.2f} s after its start"
        )


def run_long(
    requests: int, clients: int, scratch: Path, env_extra: dict[str, str], max_seconds: float = float("inf")
) -> LongRunResult:
    models_dir = scratch / "models"
    make_tiny_llama(models_dir / MODEL_ID.replace("/", "--"))
    env = {"EXO_MODELS_DIRS": str(models_dir), **env_extra}
    nodes = start_cluster(scratch, 3, env)
    try:
        # Requests through the youngest node (not the master), served there.
        serving = nodes[-1]
        place_on(serving.url, [n.url for n in nodes[:-1]])
        counter = Counter(left=requests, deadline=time.monotonic() + max_seconds)
        threads = [threading.Thread(target=_requests, args=(serving.url, counter, seed)) for seed in range(clients)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        curve: list[int] = []
        rss_quarter = master_quarter = 0
        while any(thread.is_alive() for thread in threads):
            time.sleep(0.5)
            tenth = len(curve) + 1
            if counter.done >= tenth * requests / 10 or time.monotonic() - started >= tenth * max_seconds / 10:
                curve.append(serving.history_bytes())
                rss, _ = _tree_rss(serving.process.pid)
                master_rss = _tree_rss(nodes[0].process.pid)[0]
                print(
                    f"{counter.done} requests, {time.monotonic() - started:.0f} s, {counter.errors} errors: history "
                    f"{[round(n.history_bytes() / 2**20, 2) for n in nodes]} MB, RSS serving {rss / 2**20:.0f} MiB, "
                    f"master {master_rss / 2**20:.0f} MiB",
                    flush=True,
                )
            if not rss_quarter and (counter.done >= requests / 4 or time.monotonic() - started >= max_seconds / 4):
                rss_quarter, _ = _tree_rss(serving.process.pid)
                master_quarter = _tree_rss(nodes[0].process.pid)[0]
        seconds = time.monotonic() - started
        _wait(lambda: not _state(serving.url)["tasks"], 30, "the tasks to leave State")
        time.sleep(1)
        rss_after, _ = _tree_rss(serving.process.pid)
        master_after = _tree_rss(nodes[0].process.pid)[0]
        events = _state(nodes[0].url)["lastEventAppliedIdx"] + 1
        history = [node.history_bytes() for node in nodes]
        restart_seconds = restart(serving, env, f"history-load-{os.getpid()}")
        return LongRunResult(
            requests=counter.done,
            seconds=seconds,
            errors=counter.errors,
            first_error=counter.first_error,
            events=events,
            history_bytes=history,
            history_curve=curve,
            rss_quarter=rss_quarter,
            rss_after=rss_after,
            master_rss_quarter=master_quarter,
            master_rss_after=master_after,
            restart_seconds=restart_seconds,
        )
    finally:
        for node in nodes:
            stop_node(node.process)


def ttft_overhead(url: str, requests: int) -> dict[str, float]:
    """Medians over one-token streaming requests sent one at a time: the API's time to
    the first chunk, the engine's own (prompt tokens / prompt tok/s, the runner's clock
    from submitting the request to its first token), and their difference."""
    api, engine, overhead = [], [], []
    rng = random.Random(0)
    with httpx.Client(timeout=60) as http:
        for _ in range(requests + 5):
            prompt = " ".join(rng.choice(WORDS) for _ in range(12))
            body = {
                "model": MODEL_ID,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 1,
                "stream": True,
            }
            sent = time.perf_counter()
            first, stats = None, None
            with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    first = first or time.perf_counter()
                    stats = json.loads(line[6:]).get("generation_stats") or stats
            assert first is not None and stats is not None, "no chunk with generation_stats"
            api.append(1000 * (first - sent))
            engine.append(1000 * stats["prompt_tokens"] / stats["prompt_tps"])
            overhead.append(api[-1] - engine[-1])
    # The first few warm the caches (prefix cache, connections).
    api, engine, overhead = api[5:], engine[5:], overhead[5:]
    return {
        "api_ms": statistics.median(api),
        "engine_ms": statistics.median(engine),
        "overhead_ms": statistics.median(overhead),
    }


def run_ttft(requests: int, scratch: Path) -> dict[str, float]:
    models_dir = scratch / "models"
    make_tiny_llama(models_dir / MODEL_ID.replace("/", "--"))
    process, url = start_node(scratch / "ttft", {"EXO_MODELS_DIRS": str(models_dir)})
    try:
        place_on(url, [])
        return ttft_overhead(url, requests)
    finally:
        stop_node(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-seconds", type=float, default=float("inf"), help="stop sending requests after this long")
    parser.add_argument("--max-history-mb", type=float, default=MAX_HISTORY_MB)
    parser.add_argument("--snapshot-events", type=int, help="EXO_SNAPSHOT_EVENTS for the nodes (default theirs)")
    parser.add_argument("--ttft", type=int, metavar="N", help="only the TTFT overhead, over N requests on one node")
    parser.add_argument("--scratch", type=Path, help="keep the nodes' homes and logs here (default: a temporary dir)")
    args = parser.parse_args()
    if args.scratch:
        args.scratch.mkdir(parents=True, exist_ok=True)
    with (
        contextlib.nullcontext(str(args.scratch))
        if args.scratch
        else tempfile.TemporaryDirectory(prefix="exo-history-load-") as scratch
    ):
        if args.ttft:
            figures = run_ttft(args.ttft, Path(scratch))
            print(
                f"TTFT over {args.ttft} one-token requests: API {figures['api_ms']:.2f} ms, engine "
                f"{figures['engine_ms']:.2f} ms, API minus engine (median of each) {figures['overhead_ms']:.2f} ms"
            )
            print(json.dumps(figures))
            sys.exit(0 if figures["overhead_ms"] <= MAX_TTFT_OVERHEAD_MS else 1)
        env = {"EXO_SNAPSHOT_EVENTS": str(args.snapshot_events)} if args.snapshot_events else {}
        result = run_long(args.requests, args.clients, Path(scratch), env, args.max_seconds)
    print(result.report())
    print(json.dumps(asdict(result)))
    problems = result.problems(args.max_history_mb)
    for problem in problems:
        print(f"FAIL: {problem}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
