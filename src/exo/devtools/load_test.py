"""Many streaming clients against one real node for a while: every stream must end well,
and afterwards /state must hold no task and only the one runner, and the node's memory
(its process and its runners) must not have grown much.

    python bench/load.py                      # 32 clients for 60 s (the issue's figure)
    python bench/load.py --clients 8 --seconds 10

Starts its own node on 127.0.0.1 (offline, its own home, no multicast) serving a random
tiny llama; prints the figures and exits non-zero if a check fails."""

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from exo.devtools.tiny_models import make_tiny_llama

MODEL_ID = "acme/tiny"
WORDS = "the cluster node model token answer stream runner request memory".split()
# Memory may settle higher after the first minutes (caches, allocator arenas); more
# than this is a leak.
MAX_MEMORY_GROWTH = 1.5
# From a quarter of the way in to the end, the batch full all along: a leak, not caches.
MAX_MEMORY_GROWTH_UNDER_LOAD = 1.1


@dataclass
class Tally:
    streams: int = 0
    tokens: int = 0
    errors: list[str] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class LoadResult:
    clients: int
    seconds: float
    streams: int
    tokens: int
    errors: list[str]
    p50_s: float
    p95_s: float
    memory_before: int
    # Once the clients have filled the batch (a quarter of the way in): from here on a
    # leak shows as growth, where before it the batch's own caches are still arriving.
    memory_loaded: int
    memory_after: int
    tasks_left: int
    runners: list[str]
    runner_processes: int
    # The events of State's snapshots on disk after the run, and the history's bytes.
    snapshots: list[int] = field(default_factory=list)
    history_bytes: int = 0

    @property
    def memory_growth(self) -> float:
        return self.memory_after / max(self.memory_before, 1)

    @property
    def memory_growth_under_load(self) -> float:
        return self.memory_after / max(self.memory_loaded, 1)

    def problems(self) -> list[str]:
        found = [f"{len(self.errors)} stream(s) failed, first: {self.errors[0]}"] if self.errors else []
        if self.tasks_left:
            found.append(f"{self.tasks_left} task(s) left in /state")
        if self.runners != ["RunnerReady"] or self.runner_processes != 1:
            found.append(f"runners {self.runners}, {self.runner_processes} runner process(es)")
        if self.memory_growth > MAX_MEMORY_GROWTH:
            found.append(f"memory grew x{self.memory_growth:.2f}")
        if self.memory_growth_under_load > MAX_MEMORY_GROWTH_UNDER_LOAD:
            found.append(f"memory grew x{self.memory_growth_under_load:.2f} after the batch filled")
        return found

    def report(self) -> str:
        return (
            f"{self.clients} clients for {self.seconds:.0f} s: {self.streams} streams "
            f"({self.streams / self.seconds:.1f}/s), {self.tokens} tokens, {len(self.errors)} errors; "
            f"stream time p50 {self.p50_s:.2f} s, p95 {self.p95_s:.2f} s; "
            f"memory {self.memory_before / 2**20:.0f} MiB idle, {self.memory_loaded / 2**20:.0f} MiB a quarter in, "
            f"{self.memory_after / 2**20:.0f} MiB after (x{self.memory_growth:.2f} from idle, "
            f"x{self.memory_growth_under_load:.2f} under load); after: {self.tasks_left} tasks, runners {self.runners}, "
            f"{self.runner_processes} runner process(es); history {self.history_bytes / 2**20:.2f} MB, "
            f"snapshots at events {self.snapshots}"
        )


def _free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_node(
    home: Path,
    env_extra: dict[str, str],
    args: tuple[str, ...] = (),
    offline: bool = True,
    namespace: str | None = None,
    port: int | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    """A real node on 127.0.0.1 (offline unless told, no multicast, its own home, and
    its own namespace unless given one) and its URL."""
    home.mkdir(parents=True, exist_ok=True)
    port = port or _free_port()
    command = [sys.executable, "-m", "exo.main", "--api-port", str(port), "--api-host", "127.0.0.1"]
    command += ["--offline"] if offline else []
    command += ["--no-multicast", "--discovery-port", str(_free_port(socket.SOCK_DGRAM))]
    command += ["--namespace", namespace or home.name]
    env = {**os.environ, "EXO_HOME": str(home), **env_extra}
    with (home / "node.log").open("wb") as log:
        process = subprocess.Popen(
            [*command, *args], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    _wait(lambda: httpx.get(url + "/node_id", timeout=1).status_code == 200, 60, "the node to start")
    return process, url


def stop_node(process: subprocess.Popen[bytes]) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def place_and_wait(url: str, model_id: str) -> None:
    node_id = httpx.get(url + "/node_id", timeout=10).json()
    _wait(lambda: node_id in _state(url)["nodes"], 60, "the node in State")
    httpx.post(url + "/place_instance", json={"model_id": model_id}, timeout=60).raise_for_status()
    _wait(lambda: [r["kind"] for r in _state(url)["runners"].values()] == ["RunnerReady"], 120, "the runner")


def _wait_for_speed_probe(url: str, env: dict[str, str]) -> None:
    """The node measures its speed once, in a child process, ~10 s after it starts
    (worker/speed_probe.py): a one-off that holds a few hundred MB while it runs. The
    baseline is taken after it, so a probe still running at the end is not read as a leak."""
    if env.get("EXO_SPEED_PROBE") == "0":
        return
    node_id = httpx.get(url + "/node_id", timeout=10).json()
    _wait(lambda: _state(url)["nodes"][node_id].get("speed") is not None, 180, "the node's speed probe")


def _wait(ready, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if ready():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


def _state(url: str) -> dict:
    return httpx.get(url + "/state", timeout=30).json()


def _tree_rss(pid: int) -> tuple[int, int]:
    """Resident bytes of the node and its runner processes, and how many runners live."""
    node = psutil.Process(pid)
    total, runners = node.memory_info().rss, 0
    for child in node.children(recursive=True):
        try:
            total += child.memory_info().rss
            if "spawn_main" in " ".join(child.cmdline()) and "resource_tracker" not in " ".join(child.cmdline()):
                runners += 1
        except psutil.Error:
            continue
    return total, runners


def _client(url: str, deadline: float, tally: Tally, seed: int) -> None:
    rng = random.Random(seed)
    with httpx.Client(timeout=120) as http:
        while time.monotonic() < deadline:
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 24)))
            body = {
                "model": MODEL_ID,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": rng.randint(4, 32),
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            started = time.monotonic()
            try:
                tokens, finished = _one_stream(http, url, body)
            except (httpx.HTTPError, RuntimeError) as error:
                with tally.lock:
                    tally.errors.append(f"{type(error).__name__}: {error}")
                continue
            with tally.lock:
                if not finished:
                    tally.errors.append("the stream ended without a finish_reason")
                tally.streams += 1
                tally.tokens += tokens
                tally.seconds.append(time.monotonic() - started)


def _one_stream(http: httpx.Client, url: str, body: dict) -> tuple[int, bool]:
    tokens, finished = 0, False
    with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{response.status_code} {response.text[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                raise RuntimeError(str(event["error"]))
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            finished = finished or any(c.get("finish_reason") for c in event.get("choices") or [])
    return tokens, finished


def run_load(clients: int, seconds: float, scratch: Path, env_extra: dict[str, str] | None = None) -> LoadResult:
    models_dir = scratch / "models"
    make_tiny_llama(models_dir / MODEL_ID.replace("/", "--"))
    home = scratch / f"load-{os.getpid()}"
    process, url = start_node(home, {"EXO_MODELS_DIRS": str(models_dir), **(env_extra or {})})
    try:
        place_and_wait(url, MODEL_ID)
        _wait_for_speed_probe(url, {**os.environ, **(env_extra or {})})
        # A short warm-up, so the baseline holds what a first request allocates once.
        warm = Tally()
        _client(url, time.monotonic() + 2, warm, seed=-1)
        memory_before, _ = _tree_rss(process.pid)
        tally = Tally()
        deadline = time.monotonic() + seconds
        threads = [threading.Thread(target=_client, args=(url, deadline, tally, seed)) for seed in range(clients)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        time.sleep(seconds / 4)
        memory_loaded, _ = _tree_rss(process.pid)
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - started
        # Tasks leave State as their streams are collected: give the last ones a moment.
        try:
            _wait(lambda: not _state(url)["tasks"], 10, "the tasks to leave State")
        except RuntimeError:
            pass
        state = _state(url)
        memory_after, runner_processes = _tree_rss(process.pid)
        times = sorted(tally.seconds) or [0.0]
        return LoadResult(
            clients=clients,
            seconds=elapsed,
            streams=tally.streams,
            tokens=tally.tokens,
            errors=tally.errors,
            p50_s=statistics.median(times),
            p95_s=times[int(0.95 * (len(times) - 1))],
            memory_before=memory_before,
            memory_loaded=memory_loaded,
            memory_after=memory_after,
            tasks_left=len(state["tasks"]),
            runners=[r["kind"] for r in state["runners"].values()],
            runner_processes=runner_processes,
            snapshots=sorted(int(path.stem.split("-")[1]) for path in (home / "data" / "history").glob("snapshot-*")),
            history_bytes=sum(path.stat().st_size for path in (home / "data" / "history").iterdir()),
        )
    finally:
        stop_node(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="exo-load-") as scratch:
        result = run_load(args.clients, args.seconds, Path(scratch))
    print(result.report())
    problems = result.problems()
    for problem in problems:
        print(f"FAIL: {problem}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
