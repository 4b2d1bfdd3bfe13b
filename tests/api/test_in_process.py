"""The API app in process, against a fake cluster port (tests/support/fake_cluster.py):
the routers, the one generation flow, the encoders and the error shapes, in milliseconds
instead of an `exo` process. What the fake stands in for (master, worker, runner) is
covered by the node and cluster tests with real processes."""

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import httpx

from exo.api.app import create_app
from exo.catalog.cards import builtin_cards
from exo.shared.types.commands import Command, TaskFinished, TextGeneration
from exo.shared.types.common import CommandId, NodeId
from exo.shared.types.events import RunnerStatusUpdated
from exo.shared.types.runners import RunnerReady, RunnerShutdown
from exo.shared.types.text_generation import ChunkGenerated, Usage
from exo.worker.link_probes import measure_link
from tests.support.fake_cluster import FakeCluster

MODEL = "mlx-community/Qwen3.5-2B-MLX-8bit"


def answer(command_id: CommandId) -> list[ChunkGenerated]:
    return [
        ChunkGenerated(command_id=command_id, reasoning="Sky."),
        ChunkGenerated(command_id=command_id, text="Blue"),
        ChunkGenerated(
            command_id=command_id, text=".", finish_reason="stop", usage=Usage(prompt_tokens=5, completion_tokens=2)
        ),
    ]


def run(test: Callable[[FakeCluster, httpx.AsyncClient], Awaitable[None]], **settings: Any) -> FakeCluster:
    """Runs the test with a client of an app whose port is a fresh fake cluster."""

    async def main() -> FakeCluster:
        cluster = FakeCluster({MODEL: builtin_cards()[MODEL]})
        cluster.settings = replace(cluster.settings, **settings)
        cluster.script = answer
        transport = httpx.ASGITransport(app=create_app(cluster))
        async with httpx.AsyncClient(transport=transport, base_url="http://exo") as client:
            await test(cluster, client)
        return cluster

    return asyncio.run(main())


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "What colour is the sky?"}]}


def test_an_unknown_model_is_a_404_in_each_api_shape():
    async def test(cluster: FakeCluster, client: httpx.AsyncClient) -> None:
        openai = await client.post("/v1/chat/completions", json={**CHAT, "model": "nobody/nothing"})
        claude = await client.post("/v1/messages", json={**CHAT, "model": "nobody/nothing", "max_tokens": 4})
        ollama = await client.post("/ollama/api/chat", json={**CHAT, "model": "nobody/nothing"})
        assert [r.status_code for r in (openai, claude, ollama)] == [404, 404, 404]
        assert openai.json()["error"]["code"] == "model_not_found"
        assert claude.json()["type"] == "error" and claude.json()["error"]["type"] == "not_found_error"
        assert "nobody/nothing" in ollama.json()["error"]
        assert not any(isinstance(c, TextGeneration) for c in cluster.commands)

    run(test)


def test_a_chat_places_the_model_answers_and_finishes_its_task():
    async def test(cluster: FakeCluster, client: httpx.AsyncClient) -> None:
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["message"] == {"role": "assistant", "content": "Blue.", "reasoning_content": "Sky."}
        assert body["usage"]["total_tokens"] == 7
        generation = next(c for c in cluster.commands if isinstance(c, TextGeneration))
        assert body["id"] == f"chatcmpl-{generation.command_id}"
        # One instance placed for the request (auto-placement: a one-node cluster), and the
        # task finished once the answer was complete.
        assert len(cluster.state.instances) == 1
        assert isinstance(cluster.commands[-1], TaskFinished) and not cluster.state.tasks

    run(test)


def test_with_auto_placement_off_a_model_without_instance_is_a_404():
    async def test(cluster: FakeCluster, client: httpx.AsyncClient) -> None:
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "model_not_loaded"
        assert cluster.state.instances == {}

    run(test, auto_place=False)


def test_each_stream_format_carries_the_same_answer():
    async def test(cluster: FakeCluster, client: httpx.AsyncClient) -> None:
        placed = await client.post("/place_instance", json={"model_id": MODEL})
        assert placed.status_code == 200, placed.text
        chat = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        lines = [line.removeprefix("data: ") for line in chat.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        deltas = [json.loads(line)["choices"][0]["delta"] for line in lines[:-1]]
        assert "".join(d.get("content") or "" for d in deltas) == "Blue."

        claude = await client.post("/v1/messages", json={**CHAT, "stream": True, "max_tokens": 8})
        events = [json.loads(line[6:]) for line in claude.text.splitlines() if line.startswith("data: ")]
        assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
        text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
        assert text == "Blue."

        ollama = await client.post("/ollama/api/chat", json={**CHAT, "stream": True})
        assert ollama.headers["content-type"].startswith("application/x-ndjson")
        objects = [json.loads(line) for line in ollama.text.splitlines()]
        assert "".join(o["message"]["content"] for o in objects) == "Blue." and objects[-1]["done"]
        assert not cluster.state.tasks

    run(test)


def test_awaiting_a_deleted_instance_ends_with_its_deletion_reason():
    async def test(cluster: FakeCluster, client: httpx.AsyncClient) -> None:
        instance_id = (await client.post("/place_instance", json={"model_id": MODEL})).json()["instance_id"]
        assert (await client.delete(f"/instance/{instance_id}")).status_code == 200
        response = await client.get("/instance/await", params={"instance_id": instance_id})
        assert response.text.splitlines()[-3:-1] == [
            "event: error",
            f'data: {{"message": "instance {instance_id} was deleted: deleted by the test"}}',
        ]

    run(test)


def test_cancelling_an_unknown_request_is_a_404():
    async def test(cluster: FakeCluster, client: httpx.AsyncClient) -> None:
        response = await client.post("/v1/cancel/chatcmpl-nothing")
        assert response.status_code == 404 and response.json()["error"]["code"] == "request_not_found"

    run(test)


def lost_on_first_try(cluster: FakeCluster, replace: bool) -> Callable[[CommandId], list[ChunkGenerated]]:
    """The first generation's instance is lost before its first token (a node left);
    later ones are answered."""
    tries: list[CommandId] = []

    def script(command_id: CommandId) -> list[ChunkGenerated]:
        tries.append(command_id)
        if len(tries) == 1:
            task = next(t for t in cluster.state.tasks.values() if t.command_id == command_id)
            cluster.lose_instance(task.instance_id, replace)
            return []
        return answer(command_id)

    return script


def test_a_request_whose_instance_is_lost_before_its_first_token_is_routed_again():
    async def test(cluster: FakeCluster, client: httpx.AsyncClient) -> None:
        assert (await client.post("/place_instance", json={"model_id": MODEL})).status_code == 200
        cluster.script = lost_on_first_try(cluster, replace=True)
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == "Blue."
        sent = [c for c in cluster.commands if isinstance(c, TextGeneration)]
        # Sent twice under one id: the client's id does not change.
        assert len(sent) == 2 and sent[0].command_id == sent[1].command_id
        assert response.json()["id"] == f"chatcmpl-{sent[0].command_id}"

        cluster.script = lost_on_first_try(cluster, replace=True)
        stream = await client.post("/v1/messages", json={**CHAT, "stream": True, "max_tokens": 8})
        events = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: ")]
        assert "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta") == "Blue."
        assert not any(e["type"] == "error" for e in events)

    run(test)


def test_a_request_refused_while_this_nodes_state_was_stale_is_served_once_the_runner_is_back():
    """A node restarted on its old history shows its runner ready before the master has
    heard from the new one: the master finds no instance serving. The request waits
    until this node has seen the runner go down and come back, and is sent again."""

    async def test(cluster: FakeCluster, client: httpx.AsyncClient) -> None:
        assert (await client.post("/place_instance", json={"model_id": MODEL})).status_code == 200
        runner_id = next(iter(cluster.state.runners))
        send, refused = cluster.send_command, []
        loop = asyncio.get_running_loop()

        def refuse_the_first(command: Command) -> None:
            if not isinstance(command, TextGeneration) or refused:
                return send(command)
            refused.append(command)
            message = f"no running instance serves model '{MODEL}'"
            cluster.publish_chunk(
                ChunkGenerated(
                    command_id=command.command_id, finish_reason="error", error_message=message, retryable=True
                )
            )
            # The restarted runner's reports reach this node later: down, then ready again.
            loop.call_later(0.2, cluster.emit, RunnerStatusUpdated(runner_id=runner_id, status=RunnerShutdown()))
            loop.call_later(0.4, cluster.emit, RunnerStatusUpdated(runner_id=runner_id, status=RunnerReady()))

        cluster.send_command = refuse_the_first
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == "Blue."
        assert sum(isinstance(c, TextGeneration) for c in cluster.commands) == 1  # the second try

    run(test, reroute_seconds=3, auto_place=False)


def test_when_no_instance_comes_back_the_request_gets_a_503_with_retry_after():
    async def test(cluster: FakeCluster, client: httpx.AsyncClient) -> None:
        for path, body in [("/v1/chat/completions", CHAT), ("/v1/messages", {**CHAT, "max_tokens": 8})]:
            assert (await client.post("/place_instance", json={"model_id": MODEL})).status_code == 200
            cluster.script = lost_on_first_try(cluster, replace=False)
            response = await client.post(path, json=body)
            assert response.status_code == 503, response.text
            assert response.headers["retry-after"] == "5"
            message = response.json()["error"]["message"]
            assert "left the cluster" in message and "retry later" in message
        assert response.json()["type"] == "error" and response.json()["error"]["type"] == "overloaded_error"

    run(test, reroute_seconds=0.5, auto_place=False)


def test_a_link_probe_is_streamed_whole_and_timed():
    async def test(cluster: FakeCluster, client: httpx.AsyncClient) -> None:
        for size in (0, 1, 65_536, 100_001):
            response = await client.get("/link_probe", params={"size": size})
            assert response.content == bytes(size) and response.headers["content-length"] == str(size)
        connection = await measure_link(client, NodeId("node-b"), cluster.state.nodes[cluster.node_id], "127.0.0.1")
        assert connection is not None and connection.bandwidth_mbps is not None and connection.bandwidth_mbps > 0

    run(test)
