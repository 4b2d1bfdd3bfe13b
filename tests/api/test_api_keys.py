"""--api-key / EXO_API_KEY on a real node: every endpoint but the health check answers
401 without a key, in its own API's shape; the official openai and anthropic SDKs and
the ollama client are refused with no key or a wrong one and served with a right one;
the dashboard's fetch asks for the key once and keeps it; no key reaches the log."""

import json
import re
import subprocess
import uuid
from collections.abc import Iterator
from importlib.resources import files
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest

from exo.main import parse_args
from tests.support.node import TINY_MODEL_ID, ExoNode, start_node, stop_node

KEY_ONE = f"key-one-{uuid.uuid4().hex}"
KEY_TWO = f"key-two-{uuid.uuid4().hex}"
WRONG = f"wrong-{uuid.uuid4().hex}"
MESSAGES = [{"role": "user", "content": "hello"}]
DASHBOARD_VIEW = Path(str(files("exo") / "resources" / "dashboard" / "view.mjs"))
KEYED_FETCH_CHECK = Path(__file__).parents[1] / "node" / "js" / "dashboard_api_key.mjs"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, tiny_models_dir: Path) -> Iterator[ExoNode]:
    # Two keys, comma-separated in the environment, as a deployment would give them.
    env = {"EXO_MODELS_DIRS": str(tiny_models_dir), "EXO_API_KEY": f"{KEY_ONE}, {KEY_TWO}"}
    exo = start_node(tmp_path_factory.mktemp("node") / "home", env)
    try:
        exo.api_key = KEY_ONE
        exo.place(TINY_MODEL_ID)
        yield exo
    finally:
        stop_node(exo)


def test_keys_and_the_secret_come_from_flags_or_the_environment(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("EXO_API_KEY", "a, b,,")
    monkeypatch.setenv("EXO_CLUSTER_SECRET", "from-env")
    assert parse_args([]).api_keys == ["a", "b"] and parse_args([]).cluster_secret == "from-env"
    flags = parse_args(["--api-key", "x", "--api-key", "y", "--cluster-secret", "s"])
    assert flags.api_keys == ["x", "y"] and flags.cluster_secret == "s"  # flags win
    monkeypatch.delenv("EXO_API_KEY")
    monkeypatch.delenv("EXO_CLUSTER_SECRET")
    assert parse_args([]).api_keys == [] and parse_args([]).cluster_secret is None


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x", path)


def test_every_endpoint_but_the_health_check_needs_a_key_and_answers_in_its_apis_shape(node: ExoNode):
    schema = node.get("/openapi.json").json()
    assert httpx.get(f"{node.url}/openapi.json").status_code == 401
    checked = 0
    for path, operations in schema["paths"].items():
        for method in operations:
            if (method, path) == ("get", "/node_id"):
                continue
            for headers in ({}, {"Authorization": f"Bearer {WRONG}"}, {"x-api-key": WRONG}):
                response = httpx.request(method, node.url + _concrete(path), headers=headers, json={}, timeout=10)
                assert response.status_code == 401, (method, path, headers, response.text)
                assert response.headers["www-authenticate"] == "Bearer"
                body = response.json()
                if path.startswith("/v1/messages"):
                    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
                elif path.startswith("/ollama/"):
                    assert isinstance(body["error"], str)
                else:
                    assert body["error"]["code"] == "invalid_api_key", body
                expected = "invalid API key" if headers else "needs an API key"
                assert expected in json.dumps(body)
            checked += 1
    assert checked >= 30, checked
    # Routes outside the schema too: the docs, and the peer endpoints (without the peer token).
    for path in ("/docs", "/redoc", "/peer-hub/api/models/acme/tiny/revision/main", "/link_probe", "/dashboardx"):
        assert httpx.get(node.url + path).status_code == 401, path
    # The health check, the dashboard's files and a browser's CORS preflight need none.
    assert httpx.get(f"{node.url}/node_id").json() == node.node_id()
    assert httpx.get(f"{node.url}/", follow_redirects=True).status_code == 200
    assert httpx.get(f"{node.url}/dashboard/app.mjs").status_code == 200
    preflight = httpx.options(
        f"{node.url}/v1/chat/completions",
        headers={"Origin": "http://x", "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status_code == 200
    # A key in the query string is not a key.
    assert httpx.get(f"{node.url}/state", params={"api_key": KEY_ONE}).status_code == 401


def test_the_openai_sdk_is_refused_without_the_key_and_served_with_either_key(node: ExoNode):
    sdk = openai.OpenAI(base_url=f"{node.url}/v1", api_key=WRONG, max_retries=0, timeout=30)
    # The SDK needs a key to start; omitting its header sends none.
    for headers in ({"Authorization": openai.omit}, {}):
        with pytest.raises(openai.AuthenticationError) as refused:
            sdk.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, max_tokens=4, extra_headers=headers)  # type: ignore[arg-type]
        assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    for key in (KEY_ONE, KEY_TWO):
        sdk = openai.OpenAI(base_url=f"{node.url}/v1", api_key=key, max_retries=0, timeout=60)
        reply = sdk.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
        assert reply.choices[0].finish_reason in ("length", "stop")
        assert [m.id for m in sdk.models.list()] and reply.usage is not None


def test_the_anthropic_sdk_is_refused_without_the_key_and_served_by_x_api_key_or_bearer(node: ExoNode):
    claude = anthropic.Anthropic(base_url=node.url, api_key=WRONG, max_retries=0, timeout=30)
    for headers in ({"X-Api-Key": anthropic.omit, "Authorization": anthropic.omit}, {}):
        with pytest.raises(anthropic.AuthenticationError) as refused:
            claude.messages.create(model=TINY_MODEL_ID, messages=MESSAGES, max_tokens=4, extra_headers=headers)  # type: ignore[arg-type]
        assert refused.value.status_code == 401
        assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    for claude in (
        anthropic.Anthropic(base_url=node.url, api_key=KEY_TWO, max_retries=0, timeout=60),
        anthropic.Anthropic(base_url=node.url, auth_token=KEY_ONE, max_retries=0, timeout=60),  # Bearer
    ):
        reply = claude.messages.create(model=TINY_MODEL_ID, messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
        assert reply.stop_reason in ("max_tokens", "end_turn") and reply.usage.output_tokens > 0


def test_the_ollama_client_is_refused_without_the_key_and_served_with_its_bearer_header(node: ExoNode):
    host = f"{node.url}/ollama"
    for headers in ({}, {"Authorization": f"Bearer {WRONG}"}):
        with pytest.raises(ollama.ResponseError) as refused:
            ollama.Client(host=host, headers=headers).chat(model=TINY_MODEL_ID, messages=MESSAGES)
        assert refused.value.status_code == 401 and "API key" in refused.value.error
    client = ollama.Client(host=host, headers={"Authorization": f"Bearer {KEY_TWO}"})
    reply = client.chat(model=TINY_MODEL_ID, messages=MESSAGES, options={"num_predict": 4})
    assert reply.done and reply.eval_count
    assert TINY_MODEL_ID in [m.model for m in client.list().models]


def test_the_dashboard_asks_for_the_key_once_and_keeps_it(node: ExoNode):
    """view.mjs's keyedFetch (what app.mjs calls the API with) in Node against the real
    node, with a Map for localStorage and a scripted answer for the browser's prompt."""
    result = subprocess.run(
        ["node", str(KEYED_FETCH_CHECK), str(DASHBOARD_VIEW), node.url, KEY_TWO],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    shown = json.loads(result.stdout)
    # Three polls at once before any key: one question, then all served.
    assert shown["first"] == [200, 200, 200] and shown["asked"] == [None]
    assert shown["stored"] == KEY_TWO
    # Later calls, a new page on the same storage too, use the kept key without asking.
    assert shown["later"] == [200, 200] and shown["askedLater"] == 0
    # A refused key is asked for again (told it was refused); declined, it asks no more.
    assert shown["afterRefusal"] == 200 and shown["refusedShown"] == "wrong-"
    assert shown["declined"] == [401, 401] and shown["askedWhenDeclined"] == 1


def test_no_key_reaches_the_log(node: ExoNode):
    logs = node.logs() + (node.home / "logs" / "exo.log").read_text(errors="replace")
    assert "GET /state 401" in logs or "401" in logs
    for secret in (KEY_ONE, KEY_TWO, WRONG):
        assert secret not in logs
