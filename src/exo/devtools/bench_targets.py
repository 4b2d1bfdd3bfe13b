"""What exo-bench measures: exo nodes (started here on loopback, or an existing cluster
at a URL) with the model placed one way at a time, mlx_lm.server on the same weights,
and raw mlx-lm in this process (generate_step for one stream, BatchGenerator for
several). Each target answers a round of concurrent chat requests with a `Round`."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from exo.devtools.bench_client import Measured, Round, chat_body, concurrent_round

PLACEMENTS = {"single": ("Pipeline", 1), "pipeline": ("Pipeline", 2), "tensor": ("Tensor", 2)}
# Disaggregated serving (issue 36): prefill on the node whose URL the bench talks to,
# decode on another; and the model whole on either node alone, to compare with.
NODE_PLACEMENTS = ("disaggregated", "prefill-node", "decode-node")


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_http(url: str, process: subprocess.Popen[bytes] | None, log: Path | None, path: str) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}; see {log}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + path, timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not start; see {log}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@contextlib.contextmanager
def loopback_nodes(
    count: int, scratch: Path, models_dir: Path | None, engine: str | None, cpus: list[str] | None = None
) -> Iterator[str]:
    """`count` exo nodes on 127.0.0.1, each with its own home, joined by bootstrap peers
    (no multicast), running `engine` if given (else the node's default); yields the
    first node's API URL once all see each other. `cpus[i]` (taskset's list, "0-1")
    pins node i and its runners to those cores (and llama.cpp to as many threads): a
    mixed cluster simulated on one machine."""
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    processes: list[subprocess.Popen[bytes]] = []
    listen_ports: list[int] = []
    urls: list[str] = []
    try:
        for index in range(count):
            home = scratch / f"node{index}"
            home.mkdir(parents=True, exist_ok=True)
            api_port, listen_port = free_port(), free_port()
            args = [sys.executable, "-m", "exo.main", "--api-port", str(api_port), "--api-host", "127.0.0.1"]
            args += ["--listen-port", str(listen_port), "--discovery-port", str(free_port(socket.SOCK_DGRAM))]
            args += ["--namespace", namespace, "--no-multicast", "--offline"]
            if listen_ports:
                args += ["--bootstrap-peers", ",".join(f"tcp/127.0.0.1:{p}" for p in listen_ports)]
            env = {**os.environ, "EXO_HOME": str(home)}
            if cpus is not None:
                # OpenBLAS keeps its one thread (engine/mlx/blas.py: more spin beside MLX's).
                args = ["taskset", "-c", cpus[index], *args]
                env["EXO_LLAMACPP_THREADS"] = str(len(_cpu_list(cpus[index])))
            if models_dir is not None:
                env["EXO_MODELS_DIRS"] = str(models_dir)
            if engine is not None:
                env["EXO_ENGINE"] = engine
            log = home / "node.log"
            with log.open("wb") as out:
                processes.append(
                    subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
                )
            listen_ports.append(listen_port)
            urls.append(f"http://127.0.0.1:{api_port}")
            _wait_http(urls[-1], processes[-1], log, "/node_id")
        _wait_for(urls[0], lambda state: len(state["nodes"]) == count, "every node in the cluster")
        if count > 1:
            _wait_for(urls[0], lambda state: len(state["topology"]["connections"]) >= count, "the links probed")
        yield urls[0]
    finally:
        for process in processes:
            _stop(process)


def _wait_for(url: str, ready: Any, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready(httpx.get(url + "/state", timeout=10).json()):
            return
        time.sleep(0.25)
    raise RuntimeError(f"timed out waiting for {what}")


def _cpu_list(spec: str) -> list[int]:
    cores: list[int] = []
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cores += range(int(first), int(last or first) + 1)
    return cores


@dataclass
class ExoTarget:
    """An exo cluster at `url` with `model` placed as `placement` (single, pipeline,
    tensor) while the target is in use."""

    url: str
    model: str
    placement: str
    api_key: str | None = None
    # Tokens proposed per verify by prompt lookup (exo's speculative field); 0: plain.
    speculative: int = 0
    instance_id: str | None = field(default=None, init=False)
    # The runner's weights and KV bytes a token (/state), where the instance is one runner.
    runner_memory: dict[str, int] | None = field(default=None, init=False)

    @property
    def name(self) -> str:
        return f"exo {self.placement}" + (" spec" if self.speculative else "")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def open(self) -> None:
        """Place the model alone: the cluster's other instances of it are deleted first,
        so every request lands on this placement."""
        state = httpx.get(self.url + "/state", headers=self.headers, timeout=30).json()
        for instance_id, instance in state["instances"].items():
            if _instance_model(instance) == self.model:
                httpx.delete(f"{self.url}/instance/{instance_id}", headers=self.headers, timeout=30)
        _wait_for(self.url, lambda s: not any(_instance_model(i) == self.model for i in s["instances"].values()), "old")
        self.instance_id = self._place()
        self._await(self.instance_id)
        # A prefill instance placed with it serves too before the rounds start.
        state = httpx.get(self.url + "/state", headers=self.headers, timeout=30).json()
        for instance_id, instance in state["instances"].items():
            if (instance.get("prefillFor") or {}).get("instanceId") == self.instance_id:
                self._await(instance_id)
        runners = list(state["instances"][self.instance_id]["shardAssignments"]["nodeToRunner"].values())
        memory = (state["runners"].get(runners[0]) or {}).get("memory") if len(runners) == 1 else None
        if memory and memory.get("weightsBytes"):
            self.runner_memory = {"weights": memory["weightsBytes"], "kv_per_token": memory["kvBytesPerToken"]}

    def _await(self, instance_id: str) -> None:
        params = {"instance_id": instance_id}
        with httpx.stream(
            "GET", self.url + "/instance/await", params=params, headers=self.headers, timeout=1800
        ) as events:
            last = [line for line in events.iter_lines() if line.startswith("event:")][-1]
        if last != "event: ready":
            raise RuntimeError(f"{self.name}: the instance did not become ready ({last})")

    def _place(self) -> str:
        if self.placement in NODE_PLACEMENTS:
            return self._place_on_nodes()
        sharding, min_nodes = PLACEMENTS[self.placement]
        body = {"model_id": self.model, "sharding": sharding, "min_nodes": min_nodes}
        response = httpx.post(self.url + "/place_instance", json=body, headers=self.headers, timeout=60)
        response.raise_for_status()
        return response.json()["instance_id"]

    def _place_on_nodes(self) -> str:
        """Prefill on this URL's node and decode on another (every prompt of a token or
        more prefilled there), or the model whole on one of the two alone."""
        prefill = httpx.get(self.url + "/node_id", headers=self.headers, timeout=30).json()
        state = httpx.get(self.url + "/state", headers=self.headers, timeout=30).json()
        decode = next(node_id for node_id in sorted(state["nodes"]) if node_id != prefill)
        if self.placement == "disaggregated":
            body = {"model_id": self.model, "prefill_node_id": prefill, "decode_node_id": decode}
            response = httpx.post(
                self.url + "/place_instance", json={**body, "prefill_min_tokens": 1}, headers=self.headers, timeout=60
            )
            response.raise_for_status()
            return response.json()["instance_id"]
        node = prefill if self.placement == "prefill-node" else decode
        params = {"model_id": self.model, "sharding": "Pipeline"}
        previews = httpx.get(self.url + "/instance/previews", params=params, headers=self.headers, timeout=60).json()
        instance = next(p["instance"] for p in previews if p["nodeIds"] == [node] and p.get("instance"))
        response = httpx.post(self.url + "/instance", json={"instance": instance}, headers=self.headers, timeout=60)
        response.raise_for_status()
        return response.json()["instance_id"]

    def round(self, messages: list[list[dict[str, str]]], max_tokens: int, banned: list[int]) -> Round:
        bodies = [chat_body(self.model, m, max_tokens, banned) for m in messages]
        if self.speculative:
            for body in bodies:
                body["speculative"] = {"method": "prompt_lookup", "num_draft": self.speculative}
        return concurrent_round(self.url, bodies, self.headers)

    def close(self) -> None:
        if self.instance_id is not None:
            httpx.delete(f"{self.url}/instance/{self.instance_id}", headers=self.headers, timeout=30)
            self.instance_id = None


def _instance_model(instance: dict[str, Any]) -> str:
    return instance["shardAssignments"]["modelId"]


@dataclass
class ServerTarget:
    """`python -m mlx_lm.server` on the same weights, on a free loopback port."""

    model_dir: Path
    scratch: Path
    concurrency: int = 8
    name: str = "mlx_lm.server"
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)
    url: str = field(default="", init=False)

    def open(self) -> None:
        port = free_port()
        # Started as exo's runners start MLX: on OpenBLAS (engine/mlx/blas.py).
        launch = "import exo.engine.mlx, runpy; runpy.run_module('mlx_lm.server', run_name='__main__')"
        args = [sys.executable, "-c", launch, "--model", str(self.model_dir), "--host", "127.0.0.1"]
        args += ["--port", str(port), "--decode-concurrency", str(self.concurrency)]
        log = self.scratch / "mlx_lm_server.log"
        with log.open("wb") as out:
            self.process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        _wait_http(self.url, self.process, log, "/v1/models")

    def round(self, messages: list[list[dict[str, str]]], max_tokens: int, banned: list[int]) -> Round:
        # mlx_lm.server serves the model by its path.
        bodies = [chat_body(str(self.model_dir), m, max_tokens, banned) for m in messages]
        return concurrent_round(self.url, bodies)

    def close(self) -> None:
        if self.process is not None:
            _stop(self.process)
            self.process = None


@dataclass
class RawTarget:
    """mlx-lm in this process, no server: generate_step for one stream, BatchGenerator
    for several, on the chat template's tokens. No prefix cache: every round is cold."""

    model_dir: Path
    name: str = "mlx-lm"
    model: Any = field(default=None, init=False)
    tokenizer: Any = field(default=None, init=False)

    def open(self) -> None:
        self.model, self.tokenizer = load(str(self.model_dir))[:2]

    def _tokens(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def round(self, messages: list[list[dict[str, str]]], max_tokens: int, banned: list[int]) -> Round:
        prompts = [self._tokens(m) for m in messages]
        processors = make_logits_processors(logit_bias={token: -100.0 for token in banned}) if banned else []
        if len(prompts) == 1:
            return Round([self._one(prompts[0], max_tokens, processors)])
        return self._batch(prompts, max_tokens, processors)

    def _one(self, prompt: list[int], max_tokens: int, processors: list[Any]) -> Measured:
        measured = Measured(prompt_tokens=len(prompt), sent_at=time.perf_counter())
        tokens: list[int] = []
        stream = generate_step(
            mx.array(prompt),
            self.model,
            max_tokens=max_tokens,
            sampler=make_sampler(temp=0.0),
            logits_processors=processors or None,
        )
        for token, _ in stream:
            now = time.perf_counter()
            measured.first_at = measured.first_at or now
            measured.last_at = now
            tokens.append(int(token))
        measured.tokens, measured.text = len(tokens), self.tokenizer.decode(tokens)
        return measured

    def _batch(self, prompts: list[list[int]], max_tokens: int, processors: list[Any]) -> Round:
        start = time.perf_counter()
        generator = BatchGenerator(
            self.model,
            max_tokens=max_tokens,
            sampler=make_sampler(temp=0.0),
            logits_processors=processors,
            completion_batch_size=len(prompts),
            prefill_batch_size=len(prompts),
        )
        uids = generator.insert(prompts, [max_tokens] * len(prompts))
        measured = {uid: Measured(prompt_tokens=len(p), sent_at=start) for uid, p in zip(uids, prompts, strict=True)}
        tokens: dict[int, list[int]] = {uid: [] for uid in uids}
        done: set[int] = set()
        while len(done) < len(uids):
            for response in generator.next_generated():
                now = time.perf_counter()
                entry = measured[response.uid]
                entry.first_at = entry.first_at or now
                entry.last_at = now
                tokens[response.uid].append(response.token)
                if response.finish_reason is not None:
                    done.add(response.uid)
        generator.close()
        for uid in uids:
            measured[uid].tokens, measured[uid].text = len(tokens[uid]), self.tokenizer.decode(tokens[uid])
        return Round([measured[uid] for uid in uids])

    def close(self) -> None:
        self.model = self.tokenizer = None


@dataclass
class RawLlamaCppTarget:
    """llama.cpp in this process, no server, on the GGUF exo converts from the same dir:
    every stream a sequence of one context, each prompt prefilled by one llama_decode,
    then one llama_decode per step for every stream's next token (greedy, the banned ids
    masked). No prefix cache: every round is cold."""

    model_dir: Path
    scratch: Path
    concurrency: int = 8
    name: str = "llama.cpp"
    tokenizer: Any = field(default=None, init=False)
    model: Any = field(default=None, init=False)
    context: Any = field(default=None, init=False)

    def open(self) -> None:
        from transformers import AutoTokenizer

        from exo.engine.llamacpp.engine import keeps_f32_cache
        from exo.engine.llamacpp.gguf_convert import gguf_for
        from exo.engine.llamacpp.native import Context, Model

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = Model(gguf_for(self.model_dir, self.scratch / "gguf"))
        # The KV cache exo's engine gives this checkpoint, so the texts can be compared.
        f32 = keeps_f32_cache(json.loads((self.model_dir / "config.json").read_text()))
        self.context = Context(self.model, 16384, self.concurrency, 4096, f32_kv=f32)

    def round(self, messages: list[list[dict[str, str]]], max_tokens: int, banned: list[int]) -> Round:
        import numpy as np

        start = time.perf_counter()
        texts = [self.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]
        prompts = [self.tokenizer.encode(text, add_special_tokens=False) for text in texts]
        measured = [Measured(prompt_tokens=len(p), sent_at=start) for p in prompts]
        batch = self.context.batch
        outputs: list[list[int]] = [[] for _ in prompts]

        def choose(index: int) -> int:
            logits = np.array(self.context.logits(index))
            logits[banned] = -np.inf
            return int(np.argmax(logits))

        for stream, prompt in enumerate(prompts):
            batch.clear()
            batch.add(prompt, 0, stream, True)
            self.context.decode()
            outputs[stream].append(choose(batch.n - 1))
            measured[stream].first_at = measured[stream].last_at = time.perf_counter()
        for step in range(1, max_tokens):
            batch.clear()
            rows = [
                batch.add(out[-1:], len(p) + step - 1, s, True)
                for s, (p, out) in enumerate(zip(prompts, outputs, strict=True))
            ]
            self.context.decode()
            now = time.perf_counter()
            for stream, row in enumerate(rows):
                outputs[stream].append(choose(row))
                measured[stream].last_at = now
        for stream, out in enumerate(outputs):
            measured[stream].tokens, measured[stream].text = len(out), self.tokenizer.decode(out)
            self.context.remove(stream)
        return Round(measured)

    def close(self) -> None:
        if self.context is not None:
            self.context.close()
            self.model.close()
        self.context = self.model = None
