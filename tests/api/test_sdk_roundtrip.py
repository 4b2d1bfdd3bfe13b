"""Issue 7's client-SDK acceptance: the official openai (chat completions and responses),
anthropic and ollama SDKs drive one real node, streaming and not, over scripted Qwen3
models whose exact output is known: plain text, thinking, and a full tool round trip
(call, result, final answer), with stop reasons and usage. And a stream the client
aborts frees the runner within 2 s."""

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import ollama
import openai
import pytest

from exo.devtools.scripted_families import AFTER_TOOL_RESULT_SCRIPTS, FAMILY_SCRIPTS, GET_WEATHER_TOOL, PLAIN_SCRIPT
from exo.devtools.scripted_models import make_scripted_model
from exo.devtools.tiny_models import make_tiny_llama
from tests.support.node import ExoNode, running_node

WEATHER_MODEL = "scripted/qwen3-weather"
PLAIN_MODEL = "scripted/qwen3-plain"
# Random weights whose greedy output loops without the end token: a stream long enough to abort.
RANDOM_MODEL = "acme/tiny-random"

CALL = FAMILY_SCRIPTS["qwen3"]
ANSWER = AFTER_TOOL_RESULT_SCRIPTS["qwen3"]
QUESTION = "What is the weather in Paris?"
TOOL_RESULT = '{"weather": "sunny"}'
MAX_TOKENS = 64
ABORT_BOUND_S = 2.0


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExoNode]:
    models = tmp_path_factory.mktemp("scripted_models")
    make_scripted_model(models / "scripted--qwen3-weather", "qwen3", CALL.script, after_tool_result=ANSWER.script)
    make_scripted_model(models / "scripted--qwen3-plain", "qwen3", PLAIN_SCRIPT.script)
    make_tiny_llama(models / "acme--tiny-random")
    home = tmp_path_factory.mktemp("sdk") / "home"
    with running_node(home, {"EXO_MODELS_DIRS": str(models)}, models=(WEATHER_MODEL, PLAIN_MODEL, RANDOM_MODEL)) as exo:
        yield exo


@dataclass
class Turn:
    """One answer as any of the APIs gives it, read from the response or the stream."""

    reasoning: str
    content: str
    # (id, name, arguments) of each tool call; Ollama's calls have no id.
    tool_calls: list[tuple[str | None, str, dict[str, Any]]]
    stop: str
    # (prompt tokens, completion tokens)
    usage: tuple[int, int]
    # The assistant's turn in the API's own input format, to send back with a tool result.
    echo: list[dict[str, Any]]


class OpenAIChat:
    stops = {"text": "stop", "tool": "tool_calls"}

    def __init__(self, node: ExoNode) -> None:
        self.sdk = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def start(self, text: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": text}]

    def ask(self, model: str, conversation: list[dict[str, Any]], stream: bool) -> Turn:
        kwargs = dict(
            model=model, messages=conversation, tools=[GET_WEATHER_TOOL], temperature=0, max_tokens=MAX_TOKENS
        )
        if not stream:
            response = self.sdk.chat.completions.create(**kwargs)
            [choice] = response.choices
            message = choice.message
            calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
            reasoning = (message.model_extra or {}).get("reasoning_content") or ""
            usage = (response.usage.prompt_tokens, response.usage.completion_tokens)
            return self._turn(reasoning, message.content or "", calls, choice.finish_reason, usage)
        reasoning, content, stop, usage = "", "", "", (0, 0)
        calls: dict[int, list[str]] = {}
        for chunk in self.sdk.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
            if chunk.usage is not None:
                usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
            for choice in chunk.choices:
                reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
                content += choice.delta.content or ""
                for call in choice.delta.tool_calls or []:
                    # A call's id and name come in its first delta, its arguments in pieces.
                    parts = calls.setdefault(call.index, ["", "", ""])
                    parts[0] += call.id or ""
                    parts[1] += (call.function and call.function.name) or ""
                    parts[2] += (call.function and call.function.arguments) or ""
                stop = choice.finish_reason or stop
        return self._turn(reasoning, content, [tuple(calls[i]) for i in sorted(calls)], stop, usage)

    def _turn(self, reasoning: str, content: str, calls: list, stop: str, usage: tuple[int, int]) -> Turn:
        echo = {"role": "assistant", "content": content, "reasoning_content": reasoning or None}
        if calls:
            echo["tool_calls"] = [
                {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}
                for id_, name, arguments in calls
            ]
        parsed = [(id_, name, json.loads(arguments)) for id_, name, arguments in calls]
        return Turn(reasoning, content, parsed, stop, usage, [echo])

    def tool_result(self, call_id: str | None, name: str, result: str) -> list[dict[str, Any]]:
        return [{"role": "tool", "tool_call_id": call_id, "content": result}]


class OpenAIResponses:
    # Responses has no stop reason beside the status; a call shows as a function_call item.
    stops = {"text": "completed", "tool": "completed"}
    tool = {"type": "function", **GET_WEATHER_TOOL["function"]}

    def __init__(self, node: ExoNode) -> None:
        self.sdk = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def start(self, text: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": text}]

    def ask(self, model: str, conversation: list[dict[str, Any]], stream: bool) -> Turn:
        kwargs = dict(model=model, input=conversation, tools=[self.tool], temperature=0, max_output_tokens=MAX_TOKENS)
        if not stream:
            return self._turn(self.sdk.responses.create(**kwargs))
        deltas = {"response.reasoning_text.delta": "", "response.output_text.delta": ""}
        final = None
        for event in self.sdk.responses.create(**kwargs, stream=True):
            if event.type in deltas:
                deltas[event.type] += event.delta
            elif event.type in ("response.completed", "response.incomplete", "response.failed"):
                final = event.response
        assert final is not None
        turn = self._turn(final)
        # What the deltas said is what the final response holds.
        assert (deltas["response.reasoning_text.delta"], deltas["response.output_text.delta"]) == (
            turn.reasoning,
            turn.content,
        )
        return turn

    def _turn(self, response) -> Turn:
        reasoning = "".join(
            part.text for item in response.output if item.type == "reasoning" for part in item.content or []
        )
        calls = [
            (item.call_id, item.name, json.loads(item.arguments))
            for item in response.output
            if item.type == "function_call"
        ]
        usage = (response.usage.input_tokens, response.usage.output_tokens)
        echo = [item.model_dump(exclude_none=True) for item in response.output]
        return Turn(reasoning, response.output_text, calls, response.status, usage, echo)

    def tool_result(self, call_id: str | None, name: str, result: str) -> list[dict[str, Any]]:
        return [{"type": "function_call_output", "call_id": call_id, "output": result}]


class AnthropicMessages:
    stops = {"text": "end_turn", "tool": "tool_use"}
    tool = {
        "name": GET_WEATHER_TOOL["function"]["name"],
        "description": GET_WEATHER_TOOL["function"]["description"],
        "input_schema": GET_WEATHER_TOOL["function"]["parameters"],
    }

    def __init__(self, node: ExoNode) -> None:
        self.sdk = anthropic.Anthropic(base_url=node.url, api_key="unused", max_retries=0, timeout=60)

    def start(self, text: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": text}]

    def ask(self, model: str, conversation: list[dict[str, Any]], stream: bool) -> Turn:
        kwargs = dict(
            model=model,
            messages=conversation,
            tools=[self.tool],
            max_tokens=MAX_TOKENS,
            thinking={"type": "enabled", "budget_tokens": 1024},
            # This SDK has no temperature argument any more; the API still takes it.
            extra_body={"temperature": 0},
        )
        if not stream:
            message = self.sdk.messages.create(**kwargs)
            blocks = [block.model_dump() for block in message.content]
            return self._turn(blocks, message.stop_reason, (_prompt_tokens(message.usage), message.usage.output_tokens))
        blocks: dict[int, dict[str, Any]] = {}
        stop, usage = "", (0, 0)
        for event in self.sdk.messages.create(**kwargs, stream=True):
            if event.type == "message_start":
                usage = (event.message.usage.input_tokens, 0)
            elif event.type == "content_block_start":
                blocks[event.index] = {**event.content_block.model_dump(), "partial_json": ""}
            elif event.type == "content_block_delta":
                block, delta = blocks[event.index], event.delta
                if delta.type == "text_delta":
                    block["text"] += delta.text
                elif delta.type == "thinking_delta":
                    block["thinking"] += delta.thinking
                elif delta.type == "input_json_delta":
                    block["partial_json"] += delta.partial_json
            elif event.type == "content_block_stop":
                block = blocks[event.index]
                if block["type"] == "tool_use":
                    block["input"] = json.loads(block["partial_json"])
            elif event.type == "message_delta":
                stop = event.delta.stop_reason
                usage = (_prompt_tokens(event.usage) or usage[0], event.usage.output_tokens)
        ordered = [{k: v for k, v in blocks[i].items() if k != "partial_json"} for i in sorted(blocks)]
        return self._turn(ordered, stop, usage)

    def _turn(self, blocks: list[dict[str, Any]], stop: str, usage: tuple[int, int]) -> Turn:
        def text(kind: str, field: str) -> str:
            return "".join(block[field] for block in blocks if block["type"] == kind)

        calls = [(block["id"], block["name"], block["input"]) for block in blocks if block["type"] == "tool_use"]
        echo = [{"role": "assistant", "content": blocks}]
        return Turn(text("thinking", "thinking"), text("text", "text"), calls, stop, usage, echo)

    def tool_result(self, call_id: str | None, name: str, result: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": result}]}]


class Ollama:
    # Ollama says "stop" for a turn that ends in tool calls too.
    stops = {"text": "stop", "tool": "stop"}

    def __init__(self, node: ExoNode) -> None:
        self.sdk = ollama.Client(host=f"{node.url}/ollama", timeout=60)

    def start(self, text: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": text}]

    def ask(self, model: str, conversation: list[dict[str, Any]], stream: bool) -> Turn:
        kwargs = dict(
            model=model,
            messages=conversation,
            tools=[GET_WEATHER_TOOL],
            think=True,
            options={"temperature": 0, "num_predict": MAX_TOKENS},
        )
        if not stream:
            response = self.sdk.chat(**kwargs)
            message = response.message
            calls = [(c.function.name, dict(c.function.arguments)) for c in message.tool_calls or []]
            return self._turn(message.thinking or "", message.content or "", calls, response)
        reasoning, content, calls, last = "", "", [], None
        for part in self.sdk.chat(**kwargs, stream=True):
            reasoning += part.message.thinking or ""
            content += part.message.content or ""
            calls += [(c.function.name, dict(c.function.arguments)) for c in part.message.tool_calls or []]
            last = part
        assert last is not None and last.done
        return self._turn(reasoning, content, calls, last)

    def _turn(self, reasoning: str, content: str, calls: list, final) -> Turn:
        echo = {"role": "assistant", "content": content, "thinking": reasoning or None}
        if calls:
            echo["tool_calls"] = [{"function": {"name": name, "arguments": arguments}} for name, arguments in calls]
        usage = (final.prompt_eval_count, final.eval_count)
        parsed = [(None, name, arguments) for name, arguments in calls]
        return Turn(reasoning, content, parsed, final.done_reason, usage, [echo])

    def tool_result(self, call_id: str | None, name: str, result: str) -> list[dict[str, Any]]:
        return [{"role": "tool", "tool_name": name, "content": result}]


APIS: dict[str, Callable[[ExoNode], Any]] = {
    "openai-chat": OpenAIChat,
    "openai-responses": OpenAIResponses,
    "anthropic": AnthropicMessages,
    "ollama": Ollama,
}


def both_ways(api, model: str, conversation: list[dict[str, Any]]) -> tuple[Turn, Turn]:
    """The same request streamed and not; they must agree on everything but the ids."""
    whole, streamed = api.ask(model, conversation, stream=False), api.ask(model, conversation, stream=True)
    for turn in (whole, streamed):
        assert turn.usage[0] > 0 and turn.usage[1] > 0, turn.usage
    assert streamed.usage == whole.usage
    assert (streamed.reasoning, streamed.content, streamed.stop) == (whole.reasoning, whole.content, whole.stop)
    assert [call[1:] for call in streamed.tool_calls] == [call[1:] for call in whole.tool_calls]
    return whole, streamed


@pytest.mark.parametrize("api_name", APIS)
def test_plain_text(node: ExoNode, api_name: str):
    api = APIS[api_name](node)
    for turn in both_ways(api, PLAIN_MODEL, api.start("Hello there")):
        assert turn.content == PLAIN_SCRIPT.content
        assert turn.reasoning == ""
        assert turn.tool_calls == []
        assert turn.stop == api.stops["text"]


@pytest.mark.parametrize("api_name", APIS)
def test_thinking_then_a_tool_call(node: ExoNode, api_name: str):
    api = APIS[api_name](node)
    for turn in both_ways(api, WEATHER_MODEL, api.start(QUESTION)):
        assert turn.reasoning == CALL.reasoning
        assert turn.content == CALL.content
        [(call_id, name, arguments)] = turn.tool_calls
        assert (name, arguments) == ("get_weather", {"city": "Paris"})
        if api_name != "ollama":
            assert call_id
        assert turn.stop == api.stops["tool"]


@pytest.mark.parametrize("api_name", APIS)
def test_the_tool_result_brings_the_final_answer(node: ExoNode, api_name: str):
    api = APIS[api_name](node)
    question = api.start(QUESTION)
    for call in both_ways(api, WEATHER_MODEL, question):
        [(call_id, name, _)] = call.tool_calls
        conversation = [*question, *call.echo, *api.tool_result(call_id, name, TOOL_RESULT)]
        for answer in both_ways(api, WEATHER_MODEL, conversation):
            assert answer.reasoning == ANSWER.reasoning
            assert answer.content == ANSWER.content
            assert answer.tool_calls == []
            assert answer.stop == api.stops["text"]
            # The prompt now holds the first turn and the tool's result.
            assert answer.usage[0] > call.usage[0]


def open_long_stream(node: ExoNode, api_name: str) -> tuple[Iterator[Any], Callable[[], None]]:
    """A stream of the random model that would run for thousands of tokens, and how the
    client closes it."""
    messages = [{"role": "user", "content": "Tell me a long story"}]
    long = {"temperature": 0}
    if api_name == "openai-chat":
        stream = OpenAIChat(node).sdk.chat.completions.create(
            model=RANDOM_MODEL, messages=messages, max_tokens=3000, stream=True, **long
        )
        return iter(stream), stream.close
    if api_name == "openai-responses":
        stream = OpenAIResponses(node).sdk.responses.create(
            model=RANDOM_MODEL, input=messages, max_output_tokens=3000, temperature=0, stream=True
        )
        return iter(stream), stream.close
    if api_name == "anthropic":
        stream = AnthropicMessages(node).sdk.messages.create(
            model=RANDOM_MODEL, messages=messages, max_tokens=3000, stream=True, extra_body=long
        )
        return iter(stream), stream.close
    parts = Ollama(node).sdk.chat(
        model=RANDOM_MODEL, messages=messages, stream=True, options={"num_predict": 3000, **long}
    )
    return parts, parts.close


@pytest.mark.parametrize("api_name", APIS)
def test_an_aborted_stream_frees_the_runner_within_2_s(node: ExoNode, api_name: str):
    events, close = open_long_stream(node, api_name)
    for _ in range(5):
        next(events)
    assert node.state()["tasks"], "the generation should still be running"

    close()
    aborted = time.monotonic()
    while (tasks := node.state()["tasks"]) and time.monotonic() - aborted < ABORT_BOUND_S:
        time.sleep(0.05)
    assert tasks == {}, f"the runner still has a task {ABORT_BOUND_S} s after the abort"

    # The runner serves the next request, in the same API.
    api = APIS[api_name](node)
    turn = api.ask(RANDOM_MODEL, api.start("Hello there"), stream=False)
    assert turn.usage[1] > 0


def _prompt_tokens(usage: Any) -> int:
    """Anthropic's usage splits the prompt: read fresh, and read from the prefix cache."""
    return (usage.input_tokens or 0) + (usage.cache_read_input_tokens or 0)
