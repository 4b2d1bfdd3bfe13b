"""The dashboard in a real browser: Playwright for Python driving Debian's chromium
(/usr/bin/chromium, never a downloaded browser) against two real nodes joined over
loopback, with scripted thinking models (devtools/scripted_models.py) and the fake hub
(tests/support/fake_hub.py) for downloads. Every page loads with no console error; a
model is placed from the Models page; a streamed chat shows thinking and tool calls apart,
takes the tool's result from the user and sends all of it back (`reasoning_content`,
`tool_calls`, `tool` messages); the Integrations page's opencode JSON marks `interleaved`
per reasoning dialect, and the copied config works in the real opencode client (npm's
opencode-ai, run offline), which sends the reasoning back; a hub model's download shows
progress, is cancelled, resumed and deleted; the API key prompt. Screenshots of every
page at 1440x900 and 390x844 go to $EXO_TEST_ARTIFACTS/dashboard (default
/tmp/exo-dashboard-shots/dashboard)."""

import json
import os
import re
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, Playwright, Request, Route, expect, sync_playwright

from exo.devtools.scripted_families import AFTER_TOOL_RESULT_SCRIPTS, FAMILY_SCRIPTS, GET_WEATHER_TOOL
from exo.devtools.scripted_models import make_scripted_model
from exo.devtools.tiny_models import make_tiny_llama
from exo.devtools.tiny_vlms import make_tiny_vlm
from tests.support.capture import loopback_capture
from tests.support.cluster import Cluster, loopback_cluster
from tests.support.fake_hub import FakeHub, running_fake_hub
from tests.support.images import noise_png
from tests.support.node import TINY_MODEL_ID, ExoNode, start_node, stop_node
from tests.support.opencode import run_opencode

CHROMIUM = "/usr/bin/chromium"
THINKER = "scripted/qwen3-thinker"
SCRIPT = FAMILY_SCRIPTS["qwen3"]  # thinks, then calls get_weather
AFTER_TOOL = AFTER_TOOL_RESULT_SCRIPTS["qwen3"]  # given the tool's result: thinks, answers
HUB_MODEL = "acme/hub-model"
VLM = "acme/qwen2.5-vl-tiny"
# What opencode talks to: a Qwen3 that thinks, then greets (no tool call: opencode runs
# here with its tools off).
GREETER = "scripted/qwen3-greeter"
# get_weather with a long description (about 2000 prompt tokens): a prompt's prefill must
# outlast the page's reads to be drawn, and on a busy machine one read can bring a short
# prompt's progress together with its first tokens (a full run's failure).
SLOW_PREFILL_TOOL = {
    **GET_WEATHER_TOOL,
    "function": {**GET_WEATHER_TOOL["function"], "description": "The current weather in a city. " * 70},
}
GREETER_SCRIPT = ("<think>", "\nA greeting", ".\n", "</think>", "\n\nHello", " from", " exo.")
PAGES = ("cluster", "models", "downloads", "chat", "integrations")
SIZES = {"desktop": (1440, 900), "phone": (390, 844)}
SHOTS = Path(os.environ.get("EXO_TEST_ARTIFACTS", "/tmp/exo-dashboard-shots")) / "dashboard"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    root = tmp_path_factory.mktemp("hub")
    make_tiny_llama(root / HUB_MODEL.replace("/", "--"))
    # About 6 s for the model's 470 KB, so its progress can be watched.
    with running_fake_hub(root, throttle_bytes_per_second=80_000) as fake:
        yield fake


@pytest.fixture(scope="module")
def keyed_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Future[ExoNode]]:
    """A node started with --api-key, starting in the background while the cluster does."""
    home = tmp_path_factory.mktemp("keyed")
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(start_node, home, None, ("--api-key", "sesame"))
        yield starting
        stop_node(starting.result())


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    models = tmp_path_factory.mktemp("models")
    make_scripted_model(
        models / THINKER.replace("/", "--"), "qwen3", SCRIPT.script, after_tool_result=AFTER_TOOL.script
    )
    make_tiny_llama(models / TINY_MODEL_ID.replace("/", "--"))
    make_tiny_vlm(models / VLM.replace("/", "--"), "qwen2_5_vl")
    make_scripted_model(models / GREETER.replace("/", "--"), "qwen3", GREETER_SCRIPT)
    return models


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, models: Path, hub: FakeHub, keyed_node: Future[ExoNode]
) -> Iterator[Cluster]:
    env = {
        "EXO_MODELS_DIRS": str(models),
        "HF_ENDPOINT": hub.endpoint,
        "HF_HUB_DISABLE_TELEMETRY": "1",
        # Prompts prefill in steps of 64 tokens, so the chat has progress to show.
        "EXO_PREFILL_STEP": "64",
    }
    with loopback_cluster(2, tmp_path_factory.mktemp("cluster"), env, offline=False) as nodes:
        nodes[0].wait_for_state(
            lambda s: len(s["nodes"]) == 2 and len(s["topology"]["connections"]) >= 2, what="2 linked nodes"
        )
        # Loading while the first tests run: the models later tests chat with.
        for model in (VLM, TINY_MODEL_ID, GREETER):
            assert nodes[0].post("/place_instance", json={"model_id": model}).status_code == 200
        yield nodes


def node_name(node: ExoNode, node_id: str) -> str:
    """The name the dashboard gives a node: its friendly name, with its short id when
    another node has the same name."""
    nodes = node.state()["nodes"]
    name = nodes[node_id]["friendlyName"]
    namesakes = [n for n in nodes.values() if n["friendlyName"] == name]
    return f"{name} ({node_id[:8]})" if len(namesakes) > 1 else name


def wait_serving(node: ExoNode, model_id: str) -> str:
    """The id of an instance of the model whose runners all serve."""

    def serving(state: dict) -> str | None:
        for instance_id, instance in state["instances"].items():
            runners = instance["shardAssignments"]["runnerToShard"]
            kinds = [state["runners"].get(runner, {}).get("kind") for runner in runners]
            if instance["shardAssignments"]["modelId"] == model_id and all(
                kind in ("RunnerReady", "RunnerRunning") for kind in kinds
            ):
                return instance_id
        return None

    instance_id = serving(
        node.wait_for_state(lambda s: serving(s) is not None, timeout=120, what=f"{model_id} serving")
    )
    assert instance_id is not None
    return instance_id


def posted_json(request: Request) -> dict:
    body = request.post_data_json
    assert isinstance(body, dict), body
    return body


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as driver:
        yield driver


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
    yield browser
    browser.close()


class Console:
    """Console errors and uncaught exceptions of a page."""

    def __init__(self, page: Page) -> None:
        self.errors: list[str] = []
        page.on("console", self._message)
        page.on("pageerror", lambda error: self.errors.append(f"pageerror: {error}"))

    def _message(self, message: ConsoleMessage) -> None:
        if message.type in ("error", "warning") and "DevTools" not in message.text:
            self.errors.append(f"{message.type}: {message.text}")


def open_page(browser: Browser, node: ExoNode, size: str = "desktop", storage_state=None) -> tuple[Page, Console]:
    width, height = SIZES[size]
    context = browser.new_context(viewport={"width": width, "height": height}, storage_state=storage_state)
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=node.url)
    page = context.new_page()
    console = Console(page)
    page.goto(f"{node.url}/")
    expect(page.locator("#connection")).to_have_text("online")
    return page, console


def goto(page: Page, name: str) -> None:
    page.locator(f'#nav a[data-page="{name}"]').click()
    expect(page.locator(f"#page-{name}")).to_be_visible()


@pytest.fixture(scope="module")
def page(browser: Browser, cluster: Cluster) -> Iterator[Page]:
    """One desktop page for the tests in order (they build on each other: place, chat...)."""
    page, console = open_page(browser, cluster[0])
    yield page
    page.context.close()
    assert console.errors == []


def test_the_cluster_page_shows_both_nodes_and_no_line_crosses_a_label(page: Page, cluster: Cluster) -> None:
    goto(page, "cluster")
    expect(page.locator("#nodes .card")).to_have_count(2)
    expect(page.locator("#topology circle")).to_have_count(2)
    expect(page.locator("#topology line")).to_have_count(1)
    expect(page.locator("#cluster-summary")).to_contain_text("2 nodes")
    assert "event" not in page.locator("header").inner_text()
    crossings = page.evaluate(
        """async () => {
            const { segmentCrossesBox } = await import("/dashboard/view.mjs");
            const lines = [...document.querySelectorAll("#topology line")];
            const labels = [...document.querySelectorAll("#topology .node-label, #topology .node-detail, #topology .link-label")];
            const out = [];
            for (const line of lines) {
              const [x1, y1, x2, y2] = ["x1", "y1", "x2", "y2"].map((a) => Number(line.getAttribute(a)));
              for (const label of labels) {
                if (segmentCrossesBox(x1, y1, x2, y2, label.getBBox())) out.push(label.textContent);
              }
            }
            return { out, labels: labels.length };
        }"""
    )
    assert crossings["labels"] >= 4 and crossings["out"] == [], crossings


@dataclass
class OpencodeRuns:
    """Two turns of the real opencode client on the config the page copied, run in the
    background while the other tests go on: what it printed, and the Chat Completions
    requests the node received meanwhile (from a loopback capture)."""

    outputs: list[str]
    requests: list[dict]


def http_requests(stream: bytes) -> Iterator[tuple[bytes, bytes]]:
    """(request line, body) of each request a client sent on one captured connection (a
    kept-alive one carries several), by their Content-Length."""
    while b"\r\n\r\n" in stream:
        head, rest = stream.split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        length = next(
            (int(v) for k, _, v in (h.partition(b":") for h in lines[1:]) if k.lower() == b"content-length"), 0
        )
        yield lines[0], rest[:length]
        stream = rest[length:]


def chat_requests(streams: list[bytes]) -> list[dict]:
    """The bodies of the Chat Completions requests among captured TCP streams."""
    return [
        json.loads(body)
        for stream in streams
        if stream.startswith((b"GET ", b"POST ", b"DELETE ", b"PUT ", b"HEAD "))
        for line, body in http_requests(stream)
        if line.startswith(b"POST /v1/chat/completions ")
    ]


def two_opencode_turns(project: Path, node: ExoNode) -> OpencodeRuns:
    with loopback_capture([node.api_port]) as capture:
        first = run_opencode(project, f"exo/{GREETER}", "say hello")
        second = run_opencode(project, f"exo/{GREETER}", "once more", "--continue")
    return OpencodeRuns([first, second], chat_requests(capture.streams([node.api_port])))


@pytest.fixture(scope="module")
def background() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(1) as pool:
        yield pool


@pytest.fixture(scope="module")
def opencode_runs() -> list[Future[OpencodeRuns]]:
    """Where the test that starts opencode leaves its runs for the test that checks them."""
    return []


def test_a_model_is_placed_from_the_models_page(page: Page, cluster: Cluster) -> None:
    goto(page, "models")
    page.locator("#model-search").fill("qwen3-thinker")
    row = page.locator(f'.model-row[data-model="{THINKER}"]')
    expect(row.locator(".fit")).to_contain_text("fits on", timeout=15000)
    expect(row).to_contain_text("reasoning: post_last_user")
    row.get_by_role("button", name="Place", exact=True).click()
    expect(page.locator("#placing")).to_contain_text(f"placing {THINKER}")
    expect(row.locator(".badge.ok")).to_have_text("serving", timeout=90000)
    # "placing …" goes once the model serves.
    expect(page.locator("#placing")).not_to_contain_text("placing", timeout=5000)
    assert THINKER in [m["id"] for m in cluster[0].get("/v1/models").json()["data"]]


def test_opencode_starts_on_the_config_the_integrations_page_copies(
    page: Page,
    cluster: Cluster,
    background: ThreadPoolExecutor,
    opencode_runs: list[Future[OpencodeRuns]],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """What the Copy button puts on the clipboard, saved unchanged as a project's
    opencode.json, for the real opencode client (npm's opencode-ai); the runs go on in the
    background while the tests up to the downloads' go on, and are checked after them."""
    node = cluster[0]
    wait_serving(node, GREETER)
    goto(page, "integrations")
    block = page.locator("#integration-opencode")
    expect(block).to_contain_text(GREETER)
    block.get_by_role("button", name="Copy").click()
    copied = page.evaluate("navigator.clipboard.readText()")
    assert json.loads(copied)["provider"]["exo"]["models"][GREETER]["interleaved"] == {"field": "reasoning_content"}
    project = tmp_path_factory.mktemp("opencode") / "project"
    project.mkdir()
    (project / "opencode.json").write_text(copied)
    opencode_runs.append(background.submit(two_opencode_turns, project, node))


def test_a_streamed_chat_shows_thinking_apart_and_sends_it_back(page: Page) -> None:
    goto(page, "chat")
    # Record the Stop button's states: enabled only while the reply streams.
    page.evaluate(
        """() => {
            const stop = document.getElementById("stop-button");
            window.stopStates = [stop.disabled];
            new MutationObserver(() => window.stopStates.push(stop.disabled)).observe(stop, { attributes: true });
            window.prefillShown = [];
            new MutationObserver(() => {
              for (const line of document.querySelectorAll("#transcript .prefill")) window.prefillShown.push(line.textContent);
            }).observe(document.getElementById("transcript"), { childList: true, subtree: true });
        }"""
    )
    page.locator("#new-chat").click()
    page.locator("#chat-model").select_option(THINKER)
    expect(page.locator("#attach-label")).to_be_hidden()  # the model has no vision
    page.locator("#tools-box summary").click()
    page.locator("#chat-tools").fill(json.dumps([SLOW_PREFILL_TOOL]))
    page.locator("#chat-input").fill("What is the weather in Paris?")
    page.locator("#send-button").click()
    reply = page.locator(".message.assistant").last
    expect(reply.locator(".stats")).to_contain_text("tokens", timeout=30000)
    expect(reply.locator(".reply-model")).to_have_text(THINKER)
    thinking = reply.locator("details.thinking")
    expect(thinking.locator(".thinking-text")).to_have_text(SCRIPT.reasoning.strip())
    assert thinking.get_attribute("open") is None  # folded once the answer came
    thinking.locator("summary").click()
    expect(thinking).to_have_attribute("open", "")
    expect(reply.locator(".content")).to_have_text(SCRIPT.content.strip())
    assert SCRIPT.reasoning.strip() not in reply.locator(".content").inner_text()
    expect(reply.locator(".tool-call")).to_contain_text('get_weather({"city": "Paris"})')
    prefill = page.evaluate("window.prefillShown")
    assert any(re.fullmatch(r"reading the prompt: (\d+)/(\d+) tokens", line) for line in prefill), prefill
    done, total = map(int, re.findall(r"\d+", prefill[0]))
    assert 0 < done < total and total > 1500, prefill
    states = page.evaluate("window.stopStates")
    assert states[0] is True and False in states and states[-1] is True, states

    # The call answered from the page: the result goes back as a tool message after the
    # call (Chat Completions' shape), the reasoning with it, and the model answers from it.
    page.locator(".tool-result input").fill('{"sky": "sunny"}')
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
        page.locator(".tool-result").get_by_role("button", name="Send result").click()
    body = posted_json(sent.value)
    assert body["model"] == THINKER and body["stream"] is True
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "tool"]
    assistant, result = body["messages"][1:]
    assert assistant["reasoning_content"] == SCRIPT.reasoning and assistant["content"] == SCRIPT.content
    [call] = assistant["tool_calls"]
    assert call["id"] and call["type"] == "function", call
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert result == {"role": "tool", "tool_call_id": call["id"], "content": '{"sky": "sunny"}'}
    answer = page.locator(".message.assistant").last
    expect(answer.locator(".stats")).to_contain_text("tokens", timeout=30000)
    expect(answer.locator(".content")).to_have_text(AFTER_TOOL.content)
    expect(answer.locator(".thinking-text")).to_have_text(AFTER_TOOL.reasoning)
    expect(page.locator(".message.tool")).to_contain_text('get_weather: {"sky": "sunny"}')
    expect(page.locator(".tool-result")).to_have_count(0)

    # The next question sends every earlier turn back, each reply's reasoning with it.
    page.locator("#chat-input").fill("And tomorrow?")
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
        page.locator("#chat-input").press("Enter")
    messages = posted_json(sent.value)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "user"]
    assert messages[1]["tool_calls"] == [call] and messages[2] == result
    assert messages[3] == {
        "role": "assistant",
        "content": AFTER_TOOL.content,
        "reasoning_content": AFTER_TOOL.reasoning,
    }
    expect(page.locator(".message.assistant").last.locator(".stats")).to_contain_text("tokens", timeout=30000)

    # Kept in the browser: a reload shows the conversation; rename and delete work.
    page.reload()
    goto(page, "chat")
    expect(page.locator(".message.assistant")).to_have_count(3)
    expect(page.locator(".message.tool")).to_have_count(1)
    item = page.locator("#conversation-list li.active")
    expect(item).to_contain_text("What is the weather in Paris?")
    item.get_by_role("button", name="Rename").click()
    page.locator("input.rename").fill("Paris weather")
    page.locator("input.rename").press("Enter")
    expect(page.locator("#conversation-list li.active")).to_have_text(re.compile("Paris weather"))
    page.locator("#new-chat").click()
    expect(page.locator("#conversation-list li")).to_have_count(2)
    page.locator("#conversation-list li.active").get_by_role("button", name="Delete").click()
    expect(page.locator("#conversation-list li")).to_have_count(1)
    stored = json.loads(page.evaluate("localStorage.getItem('exo-conversations')"))
    assert [c["title"] for c in stored] == ["Paris weather"] and len(stored[0]["messages"]) == 6


def with_body(page: Page, extra: dict) -> None:
    """Adds `extra` to the body of the chat requests the page sends from now on (a knob the
    page has no control for: the answer still streams from the real node)."""

    def add(route: Route) -> None:
        route.continue_(post_data=json.dumps({**posted_json(route.request), **extra}))

    page.route("**/v1/chat/completions", add)


def test_images_are_offered_for_a_vision_model_and_sent_as_parts(page: Page, cluster: Cluster) -> None:
    vlm_instance = wait_serving(cluster[0], VLM)
    with_body(page, {"max_tokens": 8})  # the random VLM could write thousands
    goto(page, "chat")
    page.locator("#new-chat").click()
    expect(page.locator("#chat-model")).to_contain_text(VLM)
    page.locator("#chat-model").select_option(VLM)
    expect(page.locator("#attach-label")).to_be_visible()
    page.locator("#attach-input").set_input_files(
        files=[{"name": "noise.png", "mimeType": "image/png", "buffer": noise_png(1)}]
    )
    expect(page.locator("#attachments img")).to_have_count(1)
    page.evaluate("document.getElementById('chat-tools').value = ''")
    page.locator("#chat-input").fill("what is in the picture")
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
        page.locator("#send-button").click()
    [message] = posted_json(sent.value)["messages"]
    assert message["content"][0] == {"type": "text", "text": "what is in the picture"}
    assert message["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
    reply = page.locator(".message.assistant").last
    expect(reply.locator(".stats")).to_contain_text("tokens", timeout=30000)
    expect(reply.locator(".error")).to_have_count(0)
    expect(page.locator(".message.user img.thumb")).to_have_count(1)
    # Back to a text-only model: no image control, and nothing left attached.
    page.locator("#chat-model").select_option(THINKER)
    expect(page.locator("#attach-label")).to_be_hidden()
    expect(page.locator("#attachments img")).to_have_count(0)
    page.unroute("**/v1/chat/completions")
    node = cluster[0]
    assert node.delete(f"/instance/{vlm_instance}").status_code == 200
    node.wait_for_state(lambda s: vlm_instance not in s["instances"], what="the VLM's instance gone")
    # The picker's options follow what serves, and keep the model picked.
    expect(page.locator(f'#chat-model option[value="{VLM}"]')).to_have_count(0)
    expect(page.locator("#chat-model")).to_have_value(THINKER)


def test_the_integrations_configs_point_here_and_mark_interleaved_per_dialect(page: Page, cluster: Cluster) -> None:
    node = cluster[0]
    wait_serving(node, TINY_MODEL_ID)
    wait_serving(node, GREETER)
    goto(page, "integrations")
    opencode_block = page.locator("#integration-opencode")
    expect(opencode_block).to_contain_text(TINY_MODEL_ID)
    expect(opencode_block).not_to_contain_text(VLM)  # its instance went in the test before
    opencode = json.loads(opencode_block.locator("pre").inner_text())
    provider = opencode["provider"]["exo"]
    assert provider["options"]["baseURL"] == f"{node.url}/v1"
    models = provider["models"]
    assert sorted(models) == sorted([THINKER, TINY_MODEL_ID, GREETER])
    assert models[THINKER]["interleaved"] == {"field": "reasoning_content"}  # qwen3: post_last_user
    assert "interleaved" not in models[TINY_MODEL_ID]  # llama: none
    opencode_block.get_by_role("button", name="Copy").click()
    assert json.loads(page.evaluate("navigator.clipboard.readText()")) == opencode

    page.locator("#integration-model").select_option(THINKER)
    claude = page.locator("#integration-claude pre").inner_text()
    assert f"ANTHROPIC_BASE_URL={node.url}\n" in claude and f"ANTHROPIC_MODEL={THINKER}" in claude
    codex = page.locator("#integration-codex pre").inner_text()
    assert f'base_url = "{node.url}/v1"' in codex and f'model = "{THINKER}"' in codex
    webui = page.locator("#integration-openwebui pre").inner_text()
    assert f"OPENAI_API_BASE_URL={node.url}/v1" in webui and f"OLLAMA_BASE_URL={node.url}/ollama" in webui

    # Every dialect of the catalog's cards, through the page's own config builder.
    per_dialect = page.evaluate(
        """async (base) => {
            const { opencodeConfig } = await import("/dashboard/view.mjs");
            const cards = await (await fetch("/models")).json();
            const models = opencodeConfig(base, cards).provider.exo.models;
            const out = {};
            for (const card of cards) (out[card.reasoning_dialect] ??= []).push(models[card.model_id].interleaved ?? null);
            return out;
        }""",
        node.url,
    )
    assert set(per_dialect) == {"none", "post_last_user", "suffix", "channel", "tool_conditional"}, per_dialect
    for dialect, entries in per_dialect.items():
        expected = (
            {"field": "reasoning_content"} if dialect in ("tool_conditional", "post_last_user", "channel") else None
        )
        assert all(entry == expected for entry in entries), (dialect, entries)


def test_stop_ends_a_streaming_reply(page: Page, cluster: Cluster, models: Path) -> None:
    """The tiny llama with its EOS banned and room for 4,000 tokens (added to the page's
    request on its way out) writes until its context is full unless stopped (the default
    1,024 tokens could end under a slow click)."""
    eos = json.loads((models / TINY_MODEL_ID.replace("/", "--") / "config.json").read_text())["eos_token_id"]
    with_body(page, {"logit_bias": {str(eos): -100}, "max_tokens": 4000})
    goto(page, "chat")
    page.locator("#new-chat").click()
    page.locator("#chat-model").select_option(TINY_MODEL_ID)
    page.locator("#chat-input").fill("hello")
    page.locator("#send-button").click()
    stop = page.locator("#stop-button")
    expect(stop).to_be_enabled()
    expect(page.locator("#send-button")).to_be_disabled()
    expect(page.locator(".message.assistant.live .content")).not_to_be_empty(timeout=20000)
    stop.click()
    reply = page.locator(".message.assistant").last
    expect(reply.locator(".stats")).to_contain_text("stopped")
    expect(stop).to_be_disabled()
    expect(page.locator("#send-button")).to_be_enabled()
    page.unroute("**/v1/chat/completions")
    # The page left, so the request's task ends on the cluster (opencode's may be running).
    cluster[0].wait_for_state(
        lambda s: TINY_MODEL_ID not in json.dumps(s["tasks"]), timeout=15, what=f"no {TINY_MODEL_ID} task left"
    )


def test_a_hub_download_shows_progress_is_cancelled_resumed_placed_and_deleted(
    page: Page, hub: FakeHub, cluster: Cluster
) -> None:
    node_id = cluster[0].node_id()
    goto(page, "models")
    page.locator("#hub-query").fill("hub-model")
    page.locator("#hub-form button").click()
    page.locator(f'.hub-row[data-model="{HUB_MODEL}"]').get_by_role("button").click()
    goto(page, "downloads")
    rows = page.locator(f'.dl-row[data-model="{HUB_MODEL}"]')
    row = rows.and_(page.locator(f'[data-node="{node_id}"]'))
    expect(row.locator(".dl-eta")).to_contain_text("s left", timeout=20000)
    expect(row.locator(".dl-speed")).to_contain_text("/s")
    fraction = float(row.locator(".bar").get_attribute("aria-valuenow") or "0")
    assert 0 <= fraction < 100
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / "downloads-in-progress-desktop.png"), full_page=True)
    row.get_by_role("button", name="Cancel").click()
    expect(row.locator(".dl-text")).to_contain_text("cancelled", timeout=15000)
    hub.throttle_bytes_per_second = None
    row.get_by_role("button", name="Resume").click()
    expect(row.locator(".dl-text")).to_contain_text("downloaded", timeout=30000)
    # Downloaded, it is placed from the Models page, then stopped.
    goto(page, "models")
    page.locator("#model-search").fill(HUB_MODEL)
    card = page.locator(f'.model-row[data-model="{HUB_MODEL}"]')
    expect(card).not_to_contain_text("not downloaded")
    # On this node, where the files are: the option of the options table naming it alone.
    card.get_by_role("button", name="Options").click()
    alone = re.compile(f"^{re.escape(node_name(cluster[0], node_id))}$")
    option = card.locator("table.previews tbody tr").filter(has=page.locator("td:first-child", has_text=alone))
    option.filter(has_text="Pipeline").first.get_by_role("button", name="Place", exact=True).click()
    expect(card.locator(".badge.ok")).to_have_text("serving", timeout=60000)
    card.get_by_role("button", name="Stop").click()
    expect(card.locator(".model-actions").get_by_role("button", name="Place", exact=True)).to_be_visible(timeout=15000)
    # The files on every node that holds them (the placed node took them from its peer).
    goto(page, "downloads")
    page.on("dialog", lambda dialog: dialog.accept())
    for left in range(rows.count(), 0, -1):
        rows.first.get_by_role("button", name="Delete").click()
        expect(rows).to_have_count(left - 1, timeout=15000)
    # No files left anywhere: the card added from the hub can go too.
    goto(page, "models")
    card.get_by_role("button", name="Remove").click()
    expect(card).to_have_count(0, timeout=15000)


def test_opencode_got_the_answer_and_sent_its_reasoning_back(opencode_runs: list[Future[OpencodeRuns]]) -> None:
    """opencode printed the greeter's answer from this node both turns, and on the second
    sent the first answer's reasoning back as `reasoning_content`, as the copied config's
    `interleaved` asks."""
    [started] = opencode_runs
    runs = started.result(timeout=300)
    assert [out.strip() for out in runs.outputs] == ["Hello from exo.", "Hello from exo."], runs.outputs
    bodies = [b for b in runs.requests if b["model"] == GREETER]
    later = [b["messages"] for b in bodies if any(m["role"] == "assistant" for m in b["messages"])]
    assert later, bodies
    [assistant] = [m for m in later[-1] if m["role"] == "assistant"]
    assert assistant["reasoning_content"].strip() == "A greeting."
    assert assistant["content"].strip() == "Hello from exo."
    assert "once more" in json.dumps(later[-1][-1])


def test_every_page_at_desktop_and_phone_size_fits_with_no_console_error(
    browser: Browser, cluster: Cluster, page: Page
) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    kept = page.context.storage_state()  # the conversation the chat test left
    for size in SIZES:
        page, console = open_page(browser, cluster[0], size, kept)
        for name in PAGES:
            goto(page, name)
            if name == "models":
                expect(page.locator(".model-row .fit.yes").first).to_be_visible(timeout=15000)
            if name == "chat":
                page.locator("#conversation-list button.conversation", has_text="Paris weather").click()
                expect(page.locator(".message.assistant .thinking").first).to_be_visible()
                expect(page.locator("#chat-model")).to_have_value(THINKER)  # the conversation's own
            # Fonts in and the page painted (no fixed wait: it was 3 s of the test).
            page.evaluate(
                "() => document.fonts.ready.then(() => new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r))))"
            )
            page.screenshot(path=str(SHOTS / f"{name}-{size}.png"))
            if name != "models":  # the catalog runs to many screens
                page.screenshot(path=str(SHOTS / f"{name}-{size}-full.png"), full_page=True)
            overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
            assert overflow <= 0, f"{name} at {size} is {overflow}px wider than the window"
        page.context.close()
        assert console.errors == [], (size, console.errors)


def test_the_api_key_prompt_keeps_the_key(browser: Browser, keyed_node: Future[ExoNode]) -> None:
    node = keyed_node.result()
    context = browser.new_context()
    page = context.new_page()
    page.goto(f"{node.url}/")
    dialog = page.locator("#key-dialog")
    expect(dialog).to_be_visible()
    page.locator("#key-input").fill("sesame")
    dialog.get_by_role("button", name="Save").click()
    expect(page.locator("#connection")).to_have_text("online")
    assert page.evaluate("localStorage.getItem('exo-api-key')") == "sesame"
    page.reload()
    expect(page.locator("#connection")).to_have_text("online")
    expect(dialog).to_be_hidden()
    context.close()
